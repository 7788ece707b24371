"""A counter of the host's reads of tensor values: what makes a GPU wait.

On a GPU, the host reading a device value (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`,
`.to("cpu")`, `.numpy()`) or calling `synchronize` waits for every kernel queued before it; a
decode step that does so inside its layer loop runs at the speed of the host. The same reads can
be counted on a CPU, where the GPU code path runs with the torch backend or the Triton
interpreter: every tensor of that path stands for device memory, so each read of one counts.

    with HostReads() as reads:
        ... one decode step ...
    reads.count, reads.by_phase, reads.sites

Only reads made by kvpage's own code are counted (the Triton interpreter and torch's internals
read values to emulate the device; they are not the host's reads). `phase(name)` labels the reads
that follow (the step function marks its layer loop), so that a test can require none there.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NUMPY = torch.Tensor.numpy  # unpatched: `host_array` reads no device
_ROOT = Path(__file__).resolve().parents[2]
_OURS = (str(_ROOT / "kvpage_cli") + "/", str(_ROOT / "kvpage_kernels") + "/")  # the engine and its kernels' launchers
_ACTIVE: list["HostReads"] = []


def phase(name: str | None):
    """Labels the host reads that follow, in every active counter (a no-op when none is)."""
    for reads in _ACTIVE:
        reads.current = name


class HostReads(TorchDispatchMode):
    """Counts, while active, kvpage's reads of tensor values on the host (see the module docstring).

    count: all of them; by_phase: per label given with `phase` (None before any); sites:
    "file:line what" of each read, for finding them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_phase: Counter = Counter()
        self.sites: Counter = Counter()
        self.current: str | None = None
        self._patches: list[tuple[object, str, object]] = []

    def _record(self, what: str) -> None:
        site = _caller()
        if site is None:
            return
        self.count += 1
        self.by_phase[self.current] += 1
        self.sites[f"{site} {what}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # item(), int(t), float(t), bool(t), t as index
            self._record("item")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        super().__enter__()
        _ACTIVE.append(self)
        counter = self

        def wrap(owner, name: str, counts):
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                if counts(*args, **kwargs):
                    counter._record(name)
                return original(*args, **kwargs)

            self._patches.append((owner, name, original))
            setattr(owner, name, wrapper)

        always = lambda *args, **kwargs: True  # noqa: E731
        wrap(torch.Tensor, "tolist", always)
        wrap(torch.Tensor, "numpy", always)
        wrap(torch.Tensor, "cpu", always)
        wrap(torch.Tensor, "to", _to_host)
        if hasattr(torch, "cuda"):
            wrap(torch.cuda, "synchronize", always)
            wrap(torch.cuda.Event, "synchronize", always)
            wrap(torch.cuda.Stream, "synchronize", always)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
        _ACTIVE.remove(self)
        return super().__exit__(*exc)


def _to_host(tensor, *args, **kwargs) -> bool:
    """Whether `tensor.to(...)` copies to the host without non_blocking: a read of its values."""
    if kwargs.get("non_blocking"):
        return False
    target = kwargs.get("device")
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            target = arg
        elif isinstance(arg, torch.Tensor):
            target = arg.device
    return target is not None and torch.device(target).type == "cpu"


def _caller() -> str | None:
    """file:line of the code that made the read, when kvpage's code is on the stack below it (the
    engine's own reads, and those of callbacks the engine calls); None for a read inside a Triton
    kernel (the interpreter emulating the device) or one kvpage has no part in (a test's)."""
    frame, site = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/triton/" in name:
            return None
        if name != __file__ and "/torch/" not in name and not name.startswith("<"):
            if site is None:
                path = Path(name)
                site = f"{path.relative_to(_ROOT).as_posix() if path.is_relative_to(_ROOT) else path.name}:{frame.f_lineno}"
            if name.startswith(_OURS):
                return site
        frame = frame.f_back
    return None


def host_array(tensor: torch.Tensor):
    """A numpy view of a tensor in host memory (a step's pinned metadata buffer): no device read,
    so not counted."""
    assert tensor.device.type == "cpu"
    return _NUMPY(tensor)
