"""The mover: copies blocks into pool slots ahead of the layer that will read them.

On CUDA the copies run on a separate stream and an event marks each one done; on a CPU a
worker thread does them. A slot's valid bit is set only when its copy has completed, and a
layer that needs a slot still in flight waits for it (the time waited is counted), so attention
never reads a slot whose copy has not finished.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Mover:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prefetched = 0
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._executor = None
        else:
            self._stream = None
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpage-mover")

    def start(self, copy, valid: torch.Tensor, slot: int):
        """Runs copy() (which fills `slot`) asynchronously; sets valid[slot] = 1 when it is done.

        Returns a handle for `wait`."""
        valid[slot] = 0
        self.prefetched += 1
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                copy()
                valid[slot] = 1
                event = torch.cuda.Event()
                event.record(self._stream)
            return event

        def run() -> None:
            copy()
            valid[slot] = 1

        return self._executor.submit(run)

    def wait(self, handle) -> float:
        """Blocks until the copy behind `handle` has completed; returns the seconds waited."""
        started = time.perf_counter()
        if isinstance(handle, Future):
            handle.result()
        else:
            torch.cuda.current_stream(self.device).wait_event(handle)
            handle.synchronize()
        return time.perf_counter() - started

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
