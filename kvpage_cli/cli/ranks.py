"""`--tp N`: a command run by N processes that split the model (engine/parallel.py).

Every rank runs the same command with the same arguments, so the engines make the same
collective calls in the same order. Rank 0 alone reads the input (the others receive the
document it read), writes the output and draws progress; the other ranks write nothing.

How the ranks start:
- `kvpage ... --tp N`: the process the user started is rank 0; it starts ranks 1..N-1 itself,
  as new processes of this Python running the same command, and joins them in a gloo (CPU) or
  NCCL (CUDA) process group on a free local port. A rank that fails ends the run: rank 0 stops
  the others and reports the failed rank's own error line with its exit code. Ctrl-C reaches
  every rank (they share the terminal's process group) and rank 0 waits for them to exit.
- under `torchrun --nproc-per-node N [--nnodes ...] $(which kvpage) ... --tp W` (W = every rank
  of every node), torchrun starts the ranks and sets RANK, WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT; each joins the group from them. torchrun ends the others when one fails.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import KvpageError, UsageError

WORKER_FILE = "KVPAGE_TP_COMMAND"  # env: the pickled command a rank started by rank 0 runs
WATCH_GRACE_S = 10.0  # after a collective breaks, how long rank 0 waits to learn which rank failed


class RankFailed(KvpageError):
    """Another rank failed: its own message and exit code."""

    def __init__(self, rank: int, text: str, code: int) -> None:
        super().__init__(f"rank {rank} of the tensor-parallel run: {text}")
        self.exit_code = code if code > 0 else 1


def rank() -> int:
    """This process's rank (0 when not tensor-parallel)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def from_rank_zero(produce: Callable[[], Any]) -> Any:
    """Rank 0's `produce()`, on every rank: rank 0 calls it and sends the value (or its error) to
    the others, which raise the same error."""
    if world() == 1:
        return produce()
    import torch.distributed as dist

    if rank() == 0:
        try:
            value = produce()
        except BaseException as exc:
            dist.broadcast_object_list([(False, f"{exc}", getattr(exc, "exit_code", 1))], src=0)
            raise
        dist.broadcast_object_list([(True, value, 0)], src=0)
        return value
    box = [None]
    dist.broadcast_object_list(box, src=0)
    ok, value, code = box[0]
    if not ok:
        error = KvpageError(value)
        error.exit_code = code
        raise error
    return value


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank ([value] when not tensor-parallel)."""
    if world() == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value)
    return out


def run(opts, command: Callable, kwargs: dict, body: Callable[[], Any]) -> Any:
    """Runs `body` as this process's rank of an `opts.tp`-rank run (or alone when tp is 1).
    command/kwargs: the CLI command and all its arguments, for the ranks this process starts.
    A rank other than 0 runs quietly, without --out, its stdout discarded."""
    import torch.distributed as dist

    tp, device = opts.get("tp") or 1, opts.get("device") or "auto"
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if (tp == 1 and not torchrun) or (dist.is_available() and dist.is_initialized()):
        return body()
    if device != "cuda" and opts.get("threads") is None:  # the ranks share the CPU's cores
        opts.__dict__["threads"] = max(1, (os.cpu_count() or 1) // tp)
    if not dist.is_available():
        raise UsageError("--tp needs torch.distributed, which this torch build lacks")
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())  # as the engine resolves it
    backend = "nccl" if cuda else "gloo"
    if cuda:  # one GPU per rank of a node
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if torchrun:  # torchrun's rank, or one rank 0 started
        if int(os.environ["WORLD_SIZE"]) != tp:
            raise UsageError(f"--tp {tp}, but torchrun started {os.environ['WORLD_SIZE']} ranks (WORLD_SIZE)")
        dist.init_process_group(backend)
        try:
            if dist.get_rank() != 0:
                opts.__dict__.update(quiet=True, verbose=False, out=None)
                _discard_stdout()
            result = body()
            dist.barrier()  # no rank tears its connections down while another still uses them
            return result
        finally:
            dist.destroy_process_group()
    return _lead(tp, backend, command, kwargs, body)


def _lead(tp: int, backend: str, command: Callable, kwargs: dict, body: Callable[[], Any]) -> Any:
    """Rank 0: starts ranks 1..tp-1, joins them, runs body, and ends them whatever happens."""
    import torch.distributed as dist

    port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="kvpage-tp-"))
    job = folder / "command.pickle"
    job.write_bytes(pickle.dumps((command, kwargs)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(tp), **{WORKER_FILE: str(job)})
    # the ranks import the kvpage rank 0 runs: `python -c` would put the working directory first on
    # the path, and a folder there named kvpage_cli (a checkout of another version) would answer
    root = str(Path(__file__).resolve().parents[2])
    start = "import sys; sys.path.insert(0, sys.argv[1]); from kvpage_cli.cli.ranks import worker; worker()"
    workers = []
    for r in range(1, tp):
        log = open(folder / f"rank{r}.err", "w+b")
        workers.append((r, log, subprocess.Popen(
            [sys.executable, "-c", start, root],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=log)))
    failed: list[RankFailed] = []
    watcher = threading.Thread(target=_watch, args=(workers, failed), daemon=True)
    watcher.start()
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=tp)
        try:
            result = body()
            dist.barrier()
            return result
        finally:
            dist.destroy_process_group()
    except Exception as exc:
        if isinstance(exc, RuntimeError) and not failed:  # a broken collective: give the watcher time to see why
            deadline = time.monotonic() + WATCH_GRACE_S
            while not failed and watcher.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        if failed:  # the collective failed because a rank did: its error is the one to show
            raise failed[0] from None
        raise
    finally:
        for _, log, process in workers:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, log, process in workers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def _watch(workers: list, failed: list) -> None:
    """Watches the ranks rank 0 started; the first that fails: keeps its error and ends the others,
    so that rank 0's wait in a collective ends (their connections close, the collective raises)."""
    while True:
        codes = [process.poll() for _, _, process in workers]
        for (r, log, _), code in zip(workers, codes):
            if code not in (None, 0):
                log.flush()
                log.seek(0)
                lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
                if lines:
                    text = lines[-1].removeprefix("kvpage: error: ")
                elif code < 0:
                    text = f"ended by signal {signal.Signals(-code).name}"
                else:
                    text = f"exited with code {code}"
                failed.append(RankFailed(r, text, code))
                for _, _, other in workers:
                    if other.poll() is None:
                        other.send_signal(signal.SIGTERM)
                return
        if all(code is not None for code in codes):
            return
        time.sleep(0.05)


def _discard_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker() -> None:
    """A rank started by rank 0: runs the pickled command with its arguments; exits with its code."""
    import typer

    command, kwargs = pickle.loads(Path(os.environ[WORKER_FILE]).read_bytes())
    try:
        command(**kwargs)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(0)
