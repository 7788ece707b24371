"""Tensor parallelism: the model split over N ranks of one torch.distributed process group.

Megatron's split of a decoder: each rank holds a share of the attention heads (Q/K/V rows of its
KV heads and their query heads, the output projection's matching columns; shares may differ by
one KV head's group, as SmolLM2's 3 KV heads over 2 ranks do) and 1/N of the MLP (gate/up rows,
down columns), and sums the partial outputs of attention and of the MLP with one all-reduce each;
the embedding and the LM head are split by vocabulary (a token's row lives on one rank: the
others add zeros; each rank's logits are gathered). Norms are replicated. A model with fewer KV heads than ranks
(Gemma 3 270M has one) gives every rank the KV head its query heads read.

Every rank runs the same engine on its own heads: the store, the pool, the disk tier and the
saved KV hold the rank's KV heads only (a rank's saved KV is its own cache entry; a prefix or an
index window is restored only where every rank has it, so the ranks compute the same tokens). What is not split is identical on every rank, so greedy
tokens are chosen the same everywhere. The all-reduce adds the ranks' partial sums in an order a
single process does not use: logits agree with one process's to rounding, not bit for bit.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ...errors import ModelError, UsageError
from .spec import ModelSpec


@dataclass
class Shard:
    """This process's part: rank `rank` of `world`, in torch.distributed's default group.
    comm_seconds/comm_calls: time spent in (and number of) the collectives, measured here
    (waiting for a slower rank included)."""

    rank: int
    world: int
    comm_seconds: float = 0.0
    comm_calls: int = 0

    @classmethod
    def current(cls, world: int) -> "Shard":
        """The shard of this process in the running process group, which must have `world` ranks."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(f"tensor parallelism over {world} ranks needs a torch.distributed process group: run "
                             f"`kvpage ... --tp {world}` (it starts the ranks) or start it under torchrun")
        if dist.get_world_size() != world:
            raise UsageError(f"--tp {world}, but the process group has {dist.get_world_size()} ranks")
        return cls(dist.get_rank(), world)

    # -- what each rank holds ------------------------------------------------------------------

    def check(self, spec: ModelSpec) -> None:
        """Raises ModelError when the model cannot be split over this many ranks."""
        n, kv = self.world, spec.num_kv_heads
        if kv < n and (n % kv or spec.group_size % (n // kv)):
            raise ModelError(f"the model cannot be split over {n} ranks: its {kv} KV heads, each read by "
                             f"{spec.group_size} query heads, do not share out evenly over {n} ranks")
        if spec.intermediate_size < n:
            raise ModelError(f"the model cannot be split over {n} ranks: its MLP has {spec.intermediate_size} rows")

    def kv_heads(self, spec: ModelSpec) -> range:
        """The KV heads this rank's query heads read: a share of them (shares differ by at most one
        head: SmolLM2's 3 over 2 ranks are 2 and 1), or, with fewer KV heads than ranks, the one
        it shares with other ranks."""
        n, kv = self.world, spec.num_kv_heads
        if kv >= n:
            return _share(kv, n, self.rank, 1)
        head = self.rank // (n // kv)
        return range(head, head + 1)

    def q_heads(self, spec: ModelSpec) -> range:
        """The query heads of this rank's KV heads (all of their group, or this rank's part of it)."""
        n, kv, group = self.world, spec.num_kv_heads, spec.group_size
        heads = self.kv_heads(spec)
        if kv >= n:
            return range(heads.start * group, heads.stop * group)
        per = group // (n // kv)
        first = heads.start * group + (self.rank % (n // kv)) * per
        return range(first, first + per)

    def mlp(self, spec: ModelSpec) -> range:
        """This rank's rows of the MLP, cut at multiples of 256 where the size allows (a quantized
        down projection is cut along its inputs, on its blocks' boundaries)."""
        size = spec.intermediate_size
        unit = next(u for u in (256, 32, 1) if size % u == 0 and size // u >= self.world)
        return _share(size, self.world, self.rank, unit)

    def vocab(self, spec: ModelSpec) -> range:
        """This rank's rows of the embedding and the LM head (the last rank's may be fewer)."""
        per = self.vocab_per_rank(spec)
        return range(min(self.rank * per, spec.vocab_size), min((self.rank + 1) * per, spec.vocab_size))

    def vocab_per_rank(self, spec: ModelSpec) -> int:
        """Rows per rank (the gathered logits are padded to this on every rank)."""
        return -(-spec.vocab_size // self.world)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The model as one rank runs it: its heads and its part of the MLP (the vocabulary stays whole)."""
        return replace(spec, num_heads=len(self.q_heads(spec)), num_kv_heads=len(self.kv_heads(spec)),
                       intermediate_size=len(self.mlp(spec)))

    def split(self, tensors: dict, spec: ModelSpec) -> dict:
        """This rank's part of every weight, by Hugging Face tensor name; norms whole; the output
        projections' and the MLP's biases whole (added once, after the all-reduce)."""
        d = spec.head_dim
        q = self.q_heads(spec)
        kv = self.kv_heads(spec)
        mlp = self.mlp(spec)
        vocab = self.vocab(spec)
        rows_of = {"q_proj": (q.start * d, q.stop * d), "k_proj": (kv.start * d, kv.stop * d),
                   "v_proj": (kv.start * d, kv.stop * d), "gate_proj": (mlp.start, mlp.stop),
                   "up_proj": (mlp.start, mlp.stop)}
        cols_of = {"o_proj": (q.start * d, q.stop * d), "down_proj": (mlp.start, mlp.stop)}
        out, done = {}, {}
        for name, tensor in tensors.items():
            if id(tensor) in done:  # a tied LM head: the embedding's own part
                out[name] = done[id(tensor)]
                continue
            parts = name.split(".")
            module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                piece = _rows(tensor, vocab.start, vocab.stop)
            elif module in rows_of:
                piece = _rows(tensor, *rows_of[module]) if kind in ("weight", "bias") else tensor
            elif module in cols_of and kind == "weight":
                piece = _cols(tensor, *cols_of[module])
            else:
                piece = tensor
            out[name] = done[id(tensor)] = piece
        return out

    # -- communication ---------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (float32 on the wire for other dtypes)."""
        import torch.distributed as dist

        wire = x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x.clone()
        started = time.perf_counter()
        dist.all_reduce(wire)
        self._count(started)
        return wire.to(x.dtype)

    def least(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise minimum over the ranks (what every rank has: saved KV they can all restore)."""
        import torch.distributed as dist

        wire = x.to(torch.int64).contiguous().clone()
        started = time.perf_counter()
        dist.all_reduce(wire, op=dist.ReduceOp.MIN)
        self._count(started)
        return wire

    def _count(self, started: float) -> None:
        self.comm_seconds += time.perf_counter() - started
        self.comm_calls += 1

    def all_gather_vocab(self, logits: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
        """[R, this rank's vocabulary] -> [R, V]: every rank's columns side by side."""
        import torch.distributed as dist

        per = self.vocab_per_rank(spec)
        padded = torch.zeros(logits.shape[0], per, dtype=torch.float32, device=logits.device)
        padded[:, :logits.shape[1]] = logits
        pieces = [torch.empty_like(padded) for _ in range(self.world)]
        started = time.perf_counter()
        dist.all_gather(pieces, padded)
        self._count(started)
        return torch.cat(pieces, dim=1)[:, :spec.vocab_size]


def _share(size: int, parts: int, index: int, unit: int) -> range:
    """Part `index` of `parts` of range(size), in whole units, the first parts one unit larger."""
    units = size // unit
    per, extra = divmod(units, parts)
    start = (index * per + min(index, extra)) * unit
    return range(start, start + (per + (index < extra)) * unit)


def _rows(tensor, start: int, stop: int):
    from .quant import QuantMatrix

    if isinstance(tensor, QuantMatrix):
        return tensor.row_slice(start, stop)
    return tensor[start:stop].contiguous()


def _cols(tensor, start: int, stop: int):
    from .quant import QuantMatrix

    if isinstance(tensor, QuantMatrix):
        return tensor.col_slice(start, stop)
    return tensor[:, start:stop].contiguous()


# -- starting the ranks --------------------------------------------------------------------------


def _rank_main(rank: int, fn: Callable, world: int, store: str, backend: str, args: tuple) -> None:
    import torch.distributed as dist

    faulthandler.enable()  # a rank that crashes prints where each of its threads was
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()
    # fn has returned (what it writes is written; the engine's prefill waits for its saved-KV
    # writes) and the group is gone: the rank ends here, without the interpreter's teardown. A
    # rank of tests/test_tp.py aborted in CI once (SIGABRT, "terminate called without an active
    # exception"; when and why not found, nor reproduced here in 30 runs of the test), a message
    # C++ prints for a thread ended inside C++ code, as Python ends a thread that takes the GIL
    # while the interpreter finalizes; faulthandler above says where, should a rank abort again.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, world: int, args: tuple = (), backend: str = "gloo") -> None:
    """Runs fn(rank, *args) in `world` new processes joined in one process group (gloo on CPU,
    nccl on GPUs). Returns when every rank has returned; when one fails, the others are ended
    and the failure is raised here (torch.multiprocessing's ProcessRaisedException). A rank whose
    fn returned exits at once (os._exit, after the group's teardown): fn must have finished its
    work, with no thread of its own still writing."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="kvpage-tp-") as folder:
        store = str(Path(folder) / "store")
        mp.spawn(_rank_main, args=(fn, world, store, backend, args), nprocs=world, join=True)
