"""The retrieval index: a document longer than the model's context, indexed once into blocks.

Indexing (docs/modes.md, Retrieval): the prompt's head (the instructions and the document's
first tokens, up to a block boundary) is prefilled once. The rest of the document is cut into
windows of `window` tokens (but its last tokens, less than a block, which every question reads
again); each window is prefilled on a fork of the head, after the `overlap` tokens before it
(read again for context, not kept), so every token is computed inside the model's trained
positions, with the head as its attention sink. The full-attention layers' blocks of each
window's own tokens are kept; sliding-window layers keep nothing (a question's sliding layers see
only the question's own recent window).

A lazy index (`build(..., lazy=True)`) computes no window at first: it maps the saved ones and
computes the others only when asked (`ensure`), each as the full build would have (the same
tokens after the same head, the same key, the same bits), so a question can read the few
windows its passages lie in without waiting for the whole document, and a later run maps them.

With the saved-KV cache on, every window is saved as it is computed, under a key over the model,
the head and the window's tokens; a later run maps the saved windows from disk instead of
computing them and reads only the blocks its questions use (each checked against its own
checksum when first read; a damaged window is computed again). A saved window's blocks leave the
store for its file. An index that is not saved (no cache, or larger than its limit) goes to files
of its own in the same way, removed when the index is released, so indexing holds only the
windows in flight in memory whatever the document's length.

Assembly: a question's selected blocks are put, in the order asked for (ask: document order, the
passage that matched best last), right after the head, each moved to its new place by one
rotation of its K rows (`rope.rotate`); nothing is recomputed. The result is a context like any
other: the question is appended and the answer decoded from it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import sqlite3
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import KvpageError
from .attention.policy import key_bound
from .config import BLOCK_TOKENS
from .events import EngineWarning, EventCallback, IndexProgress, emit
from .home import private_dir, sweep_leftovers
from .kv.context import BlockTable, Context
from .kv.saved.disk import BadSegment, KVCache, MappedBlocks
from .kv.store import decode_rows
from .model.rope import rotate


@dataclass(frozen=True)
class IndexedBlock:
    """One kept block: the 64 document tokens it holds (RetrievalIndex.tokens[first:first+64]), the
    logical block index its K was baked at, and the window it came from."""

    first: int
    position: int
    window: int


@dataclass(frozen=True)
class Window:
    """Document tokens start .. start+count-1 (count a multiple of 64), computed after the
    `context` tokens before them."""

    start: int
    count: int
    context: int


WINDOWS_IN_FLIGHT = 2  # windows prefilled together while the ones before are saved


class RetrievalIndex:
    """A document indexed window by window (see the module docstring). Build with `RetrievalIndex.build`."""

    def __init__(self, engine, head: Context, tokens: list[int], rest: list[int], window: int, overlap: int) -> None:
        self.engine = engine
        self.head = head  # the prompt's head: instructions and the document's first tokens
        self.tokens = tokens  # the document's tokens after the head, whole blocks of them
        self.rest = rest  # the document's last tokens (less than a block): read with every question
        self.base = len(head.tokens) // BLOCK_TOKENS  # logical index of the first block after the head
        self.windows = [Window(s, min(window, len(tokens) - s), min(s, overlap)) for s in range(0, len(tokens), window)]
        self.blocks = [IndexedBlock(w.start + j * BLOCK_TOKENS, self.base + w.context // BLOCK_TOKENS + j, n)
                       for n, w in enumerate(self.windows) for j in range(w.count // BLOCK_TOKENS)]
        self._first_block = np.cumsum([0] + [w.count // BLOCK_TOKENS for w in self.windows]).tolist()
        # where each block lies: in the store (per group: its id; None in sliding-window groups), or
        # in a saved window mapped from disk (MappedBlocks and the block's index in it)
        self.ids: list[list[int | None]] = [[None] * len(self.blocks) for _ in engine.store.groups]
        self.mapped: list[tuple[MappedBlocks, int] | None] = [None] * len(self.blocks)
        # per block, every full-attention layer's element-wise key min and max (Quest's bounds, for
        # retrieval's cheap first stage), bfloat16 rounded outward; [blocks, F, Hkv, D], F the layers of
        # the full-attention groups, group after group (the order of the saved blocks)
        full = self._full_groups()
        self.bound_layers = [layer for g in full for layer in g.layers]
        bound_shape = (len(self.blocks), len(self.bound_layers), *(full[0].block_shape[::2] if full else (0, 0)))
        self.kmin = torch.empty(bound_shape, dtype=torch.bfloat16)
        self.kmax = torch.empty(bound_shape, dtype=torch.bfloat16)
        self.has_bounds = torch.zeros(len(self.blocks), dtype=torch.bool)
        self.loaded_windows = 0  # of self.windows, those mapped from the saved-KV cache
        self.computed_tokens = 0  # document tokens prefilled into the index (the rest were mapped)
        self.missing: set[int] = set()  # windows neither computed nor mapped yet (a lazy index's)
        self._seed = ""
        self.on_event: EventCallback | None = None
        self._label: str | None = None
        self._max_batch = WINDOWS_IN_FLIGHT
        self._cache = None  # where the windows are saved: the saved-KV cache, or this index's own files
        self._remove_scratch = lambda: None  # removes this index's own files
        weakref.finalize(self, _release, engine.blocks, self.ids)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def seed(self) -> str:
        """What its windows' keys start from (the model, the engine's numerics, the window size,
        the head's tokens); what is saved beside them carries it (tasks/prepared.py)."""
        return self._seed

    @property
    def indexed_tokens(self) -> int:
        """Document tokens whose blocks are ready (computed or mapped): all of them but in a lazy
        index's missing windows."""
        return len(self.tokens) - sum(self.windows[n].count for n in self.missing)

    def ready(self, block: int) -> bool:
        """Whether block `block` (an index into `blocks`) can be read: its window is indexed."""
        return self.blocks[block].window not in self.missing

    def window_of(self, block: int) -> int:
        return self.blocks[block].window

    def window_cost(self, n: int) -> int:
        """Tokens prefilled to compute window n: its own and the overlap read before them."""
        return self.windows[n].count + self.windows[n].context

    @property
    def index_bytes(self) -> int:
        """K/V bytes of the kept blocks (full-attention layers only)."""
        return sum(g.block_bytes for g in self._full_groups()) * len(self.blocks)

    @classmethod
    def build(cls, engine, head_ids: list[int], doc_ids: list[int], window: int, overlap: int,
              on_event: EventCallback | None = None, label: str | None = None, max_batch: int | None = None,
              use_cache: bool = True, lazy: bool = False) -> "RetrievalIndex":
        """Indexes `doc_ids` after the prompt head `head_ids`. window, overlap: tokens (multiples of 64).

        max_batch: windows prefilled together (default WINDOWS_IN_FLIGHT): a window's prefill
        chunks are long enough to be compute bound alone, so more at once only holds more KV.
        lazy: prefill the head only; the saved windows are mapped, the others computed when
        `ensure` asks for them (`missing` until then)."""
        assert window % BLOCK_TOKENS == 0 and overlap % BLOCK_TOKENS == 0 and window > 0
        align = min(-len(head_ids) % BLOCK_TOKENS, len(doc_ids))
        # the head is only ever forked (no logits read): saved whole, restored whole (Engine.prefill)
        head = engine.prefill(head_ids + doc_ids[:align], on_event, label=label, use_cache=use_cache, logits=False)
        whole = (len(doc_ids) - align) // BLOCK_TOKENS * BLOCK_TOKENS
        index = cls(engine, head, doc_ids[align:align + whole], doc_ids[align + whole:], window, overlap)
        index.on_event = on_event
        cache = engine._open_cache(on_event) if use_cache else None
        if cache is not None and index.index_bytes > cache.limit_bytes:
            emit(on_event, EngineWarning(
                f"the document's index ({index.index_bytes / 2**30:.1f} GiB) is larger than the saved-KV cache's "
                f"limit ({cache.limit_bytes / 2**30:.1f} GiB): it is not saved (raise --cache-mib to keep it)"))
            cache = None
        if cache is None:
            # not saved: its windows still go to files as they are computed (removed afterwards), so
            # memory holds only the windows in flight, whatever the document's length
            cache = _scratch_cache(engine.home / "tmp", index.index_bytes)
            index._remove_scratch = weakref.finalize(index, _remove_scratch, cache)
        index._cache = cache
        free = shutil.disk_usage(cache.folder).free
        if index.index_bytes > free:
            index.release()
            raise KvpageError(
                f"indexing this document needs {index.index_bytes / 2**30:.1f} GiB of disk for its KV and "
                f"{cache.folder} has {free / 2**30:.1f} GiB free: free some space, set KVPAGE_HOME to a larger "
                "disk, or use --kv-dtype bfloat16 (half the bytes)")
        index._seed = hashlib.sha256(f"{engine.cache_seed}|library|{window}|{overlap}|".encode()
                                       + np.asarray(head.tokens, dtype="<i4").tobytes()).hexdigest()
        index._label, index._max_batch = label, max_batch or WINDOWS_IN_FLIGHT
        todo = index._map_saved(cache, None if lazy else on_event)
        if lazy:
            index.missing = set(todo)
        else:
            index._compute(todo, cache, on_event, label, index._max_batch)
        return index

    def ensure(self, windows, on_event: EventCallback | None = None) -> int:
        """Computes those of `windows` (indices into `windows`) that are missing, in the order
        given, saving them as a full build does; returns the tokens prefilled. IndexProgress
        counts the tokens of these windows only."""
        todo = [n for n in dict.fromkeys(windows) if n in self.missing]
        if not todo:
            return 0
        before = self.computed_tokens
        on_event = on_event if on_event is not None else self.on_event
        self._compute(todo, self._cache, on_event, self._label, self._max_batch,
                      total=sum(self.windows[n].count for n in todo))
        return self.computed_tokens - before + sum(self.windows[n].context for n in todo)

    # -- indexing ----------------------------------------------------------------------------------

    def _window_key(self, n: int) -> str:
        w = self.windows[n]
        tokens = np.asarray(self.tokens[w.start - w.context:w.start + w.count], dtype="<i4")
        return hashlib.sha256(f"{self._seed}|{w.context}|".encode() + tokens.tobytes()).hexdigest()

    def _map_saved(self, cache, on_event) -> list[int]:
        """Maps the windows the cache holds; returns the others."""
        keys = [self._window_key(n) for n in range(len(self.windows))]
        try:
            present = cache.present(keys)
        except (OSError, sqlite3.Error) as exc:
            emit(on_event, EngineWarning(f"the saved-KV index is unreadable ({exc}); indexing without it"))
            present = set()
        started = self.engine._clock()
        maps = []
        for n, key in enumerate(keys):
            mapped = None
            if key in present:
                try:
                    mapped = cache.map_blocks(key, self._seed)
                    if mapped.num_blocks != self.windows[n].count // BLOCK_TOKENS:
                        raise BadSegment("of another window size")
                except FileNotFoundError:
                    mapped = None
                except (BadSegment, OSError) as exc:
                    emit(on_event, EngineWarning(f"a saved window of the document was {exc}; computing it again"))
                    _quietly(cache.discard, key)
                    mapped = None
            maps.append(mapped)
        shard = self.engine.runner.shard
        if shard is not None:  # tensor parallel: a window is read only where every rank has it saved
            agreed = shard.least(torch.tensor([m is not None for m in maps])).tolist()
            maps = [m if ok else None for m, ok in zip(maps, agreed)]
        todo = []
        done = 0
        for n, mapped in enumerate(maps):
            if mapped is None:
                todo.append(n)
                continue
            for j, index in enumerate(range(self._first_block[n], self._first_block[n + 1])):
                self.mapped[index] = (mapped, j)
            self.loaded_windows += 1
            done += self.windows[n].count
        if done:
            _quietly(cache.touch, [keys[n] for n in range(len(keys)) if n not in todo], "")
            emit(on_event, IndexProgress(done, len(self.tokens), self.engine._clock() - started, cached=done))
        return todo

    def _compute(self, todo: list[int], cache, on_event, label, limit: int, total: int | None = None) -> None:
        """Prefills windows `todo` (batched), keeps their blocks, saves them when a cache is given.
        total: the tokens the progress counts to (default the document's, the others counted as
        cached; a lazy index's `ensure` counts these windows' alone)."""
        engine = self.engine
        if total is None:
            total = len(self.tokens)
            done = cached = total - sum(self.windows[n].count for n in todo)
        else:
            done = cached = 0
        started = engine._clock()
        pending = []
        for first in range(0, len(todo), limit):
            batch = todo[first:first + limit]
            forks = [engine.fork(self.head) for _ in batch]
            lists = [self.tokens[self.windows[n].start - self.windows[n].context:
                                 self.windows[n].start + self.windows[n].count] for n in batch]
            engine.append_many(forks, lists, max_batch=limit)
            cache = self._settle(cache, pending, on_event)  # the batch before: written while this one ran
            pending = []
            for ctx, n in zip(forks, batch):
                self._keep(ctx, n)
                self.missing.discard(n)
                engine.release(ctx)
                if cache is not None:
                    pending.append((n, self._save(cache, n, label)))
                done += self.windows[n].count
                self.computed_tokens += self.windows[n].count
            emit(on_event, IndexProgress(done, total, engine._clock() - started, cached))
        self._settle(cache, pending, on_event)

    def _settle(self, cache, saved: list, on_event):
        """Once windows are saved, their blocks leave the store: they are read from the files
        (mapped), so indexing a long document keeps only the windows in flight in memory. Returns
        the cache, or None when a save failed (nothing more is saved)."""
        for n, future in saved:
            if cache is None:
                break
            try:
                future.result()
                mapped = cache.map_blocks(self._window_key(n), self._seed)
            except (OSError, sqlite3.Error, BadSegment) as exc:
                emit(on_event, EngineWarning(f"could not save the document's index to {cache.folder}: {exc}"))
                return None
            indices = range(self._first_block[n], self._first_block[n + 1])
            tables = [BlockTable([ids[i] for i in indices]) for ids in self.ids]
            for j, i in enumerate(indices):
                self.mapped[i] = (mapped, j)
                for ids in self.ids:
                    ids[i] = None
            self.engine.blocks.release(tables)
        return cache

    def _keep(self, ctx: Context, n: int) -> None:
        """Takes a reference to window n's own blocks in the full-attention groups of `ctx`, and
        notes their key bounds."""
        indices = range(self._first_block[n], self._first_block[n + 1])
        for index in indices:
            position = self.blocks[index].position
            for group, table, ids in zip(self.engine.store.groups, ctx.tables, self.ids):
                if not group.window:
                    self.engine.blocks.share(group, [table.ids[position]])
                    ids[index] = table.ids[position]
            self.mapped[index] = None
        f = 0
        for group in self._full_groups():
            for pos in range(len(group.layers)):
                k = decode_rows(torch.stack([group.k_block(pos, self.ids[group.index][i]) for i in indices])).float().cpu()
                self._set_bounds(indices, f, k.amin(dim=2), k.amax(dim=2))  # k: [n, Hkv, 64, D]
                f += 1
        self.has_bounds[indices.start:indices.stop] = True

    def _set_bounds(self, indices: range, f: int, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """Blocks `indices`' bounds in bound layer f, rounded outward to bfloat16."""
        low, high = kmin.to(torch.bfloat16), kmax.to(torch.bfloat16)
        low = torch.where(low.float() > kmin, torch.nextafter(low, torch.full_like(low, float("-inf"))), low)
        high = torch.where(high.float() < kmax, torch.nextafter(high, torch.full_like(high, float("inf"))), high)
        self.kmin[indices.start:indices.stop, f] = low
        self.kmax[indices.start:indices.stop, f] = high

    def _save(self, cache, n: int, label: str | None):
        w = self.windows[n]
        groups = self._full_groups()
        blocks = []
        for index in range(self._first_block[n], self._first_block[n + 1]):
            blocks.append([torch.stack([torch.stack([g.k_block(pos, self.ids[g.index][index]),
                                                     g.v_block(pos, self.ids[g.index][index])])
                                        for pos in range(len(g.layers))]) for g in groups])
        header = {"key": self._window_key(n), "parent": "", "root": self._seed[:64], "seed": self._seed,
                  "start": len(self.head.tokens) + w.start, "end": len(self.head.tokens) + w.start + w.count,
                  "dtype": str(self.engine.store.groups[0].dtype).removeprefix("torch."), "block_shape": list(groups[0].stored_shape),
                  "group_layers": [len(g.layers) for g in groups]}
        first, end = self._first_block[n], self._first_block[n + 1]
        bounds = torch.stack([self.kmin[first:end], self.kmax[first:end]], dim=2)  # [n, F, 2, Hkv, D]
        return cache.submit(lambda: cache.write_blocks(header, blocks, label or "", self.engine.name, bounds))

    def _full_groups(self):
        return [g for g in self.engine.store.groups if not g.window]

    # -- reading blocks ----------------------------------------------------------------------------

    def _kv(self, group, pos: int, chosen: list[int], values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K, V values [n, Hkv, 64, D] of blocks `chosen` in the group's layer `pos` (V None when not
        `values`: a mapped block's V is then not read). A mapped block damaged on disk: its window
        is computed again first."""
        ks, vs = [], []
        full = [g.index for g in self._full_groups()].index(group.index)
        unready = [index for index in chosen if not self.ready(index)]
        if unready:
            raise ValueError(f"block {unready[0]} is in window {self.blocks[unready[0]].window}, not indexed yet (ensure it)")
        for index in chosen:
            if self.mapped[index] is not None:
                mapped, j = self.mapped[index]
                try:
                    data = mapped.block(j)[full][pos]  # [2, *stored block shape]
                except BadSegment as exc:
                    emit(self.on_event, EngineWarning(f"a saved window of the document was {exc}; computing it again"))
                    window = self.blocks[index].window
                    if self._cache is not None:
                        _quietly(self._cache.discard, self._window_key(window))
                    self._compute([window], self._cache, self.on_event, None, 1)
                    return self._kv(group, pos, chosen, values)
                ks.append(data[0])
                vs.append(data[1])
            else:
                block_id = self.ids[group.index][index]
                ks.append(group.k_block(pos, block_id))
                vs.append(group.v_block(pos, block_id))
        return decode_rows(torch.stack(ks)), decode_rows(torch.stack(vs)) if values else None

    def assemble(self, chosen: list[int]) -> Context:
        """A context holding the head and the chosen blocks (indices into `blocks`, each once), in
        the order given, at the positions right after the head; each block's K moved there by
        rotation."""
        engine = self.engine
        order = list(chosen)
        if len(set(order)) != len(order):
            raise ValueError("a block is chosen twice")
        ctx = engine.fork(self.head)
        tokens: list[int] = []
        for index in order:
            tokens += self.tokens[self.blocks[index].first:self.blocks[index].first + BLOCK_TOKENS]
        deltas = [(self.base + n - self.blocks[i].position) * BLOCK_TOKENS for n, i in enumerate(order)]
        # sliding-window layers get nothing from the document: they see the question's own window
        engine.blocks.append_moved(ctx.tables, deltas, engine.runner.rope, engine.spec.layers,
                                   lambda group, pos: self._kv(group, pos, order))
        ctx.tokens = ctx.tokens + tokens
        ctx.num_cached += len(tokens)
        ctx.last_logits = None
        return ctx

    def attention_scores(self, queries: dict[int, tuple[torch.Tensor, int]], chosen: list[int],
                         layers: list[int] | None = None) -> torch.Tensor:
        """How much attention the question's queries (layer -> (q [t, Hq, D], first position), from
        `Engine.queries_after` on the head) pay each of the blocks `chosen`, each block seen as if it
        sat right before the question (the queries rotated by the distance to it), in every
        full-attention layer (or `layers`): the share of the softmax over all the chosen blocks'
        keys, summed over query rows, heads and layers. Returns [len(chosen)] fp32."""
        engine = self.engine
        total = torch.zeros(len(chosen))
        if not chosen:
            return total
        for layer in layers if layers is not None else self.bound_layers:
            group = engine.store.group_of(layer)
            moved = self._moved_queries(queries, layer, chosen)  # [C, Hkv, G*t, D]
            k, _ = self._kv(group, engine.store.layer_pos[layer], chosen, values=False)  # [C, Hkv, 64, D]
            logits = torch.matmul(moved, k.float().transpose(-1, -2)) * engine.spec.attn_scale  # [C, Hkv, G*t, 64]
            block_lse = torch.logsumexp(logits, dim=-1)  # [C, Hkv, G*t]
            total += torch.softmax(block_lse, dim=0).sum(dim=(1, 2))
        return self._over_ranks(total)

    def bound_scores(self, queries: dict[int, tuple[torch.Tensor, int]], chosen: list[int] | None = None,
                     chunk: int = 512) -> torch.Tensor:
        """attention_scores from each block's key bounds instead of its keys (Quest's upper bound of
        a block's largest q.k in place of its log-sum-exp): it reads 2 rows per block and head, not
        64, held in memory, so it ranks every block of a long document cheaply. Over every block
        (or `chosen`); returns [len] fp32."""
        self._ensure_bounds()
        chosen = list(range(self.num_blocks)) if chosen is None else chosen
        total = torch.zeros(len(chosen))
        if not chosen:
            return total
        index = torch.tensor(chosen, dtype=torch.int64)
        for f, layer in enumerate(self.bound_layers):
            parts = []
            for first in range(0, len(chosen), chunk):
                part = chosen[first:first + chunk]
                moved = self._moved_queries(queries, layer, part)  # [c, Hkv, G*t, D]
                rows = index[first:first + chunk]
                parts.append(key_bound(moved, self.kmin[rows, f], self.kmax[rows, f]))  # [c, Hkv, G*t]
            bound = torch.cat(parts) * self.engine.spec.attn_scale
            total += torch.softmax(bound, dim=0).sum(dim=(1, 2))
        return self._over_ranks(total)

    def _moved_queries(self, queries: dict[int, tuple[torch.Tensor, int]], layer: int, chosen: list[int]) -> torch.Tensor:
        """The question's queries in `layer`, moved so that its first row sits right after each of
        the blocks `chosen`: [C, Hkv, G*t, D] fp32 (G query heads per KV head, t rows)."""
        engine = self.engine
        q, start = queries[layer]
        rope = engine.runner.rope[engine.spec.layers[layer].rope_key]
        # kept on the compute device (a GPU's): moved where the blocks and their bounds are
        qs = q.float().to(engine.store.group_of(layer).device).permute(1, 0, 2)  # [Hq, t, D]
        rows = qs.shape[1]
        positions = torch.tensor([self.blocks[i].position for i in chosen], dtype=torch.int64)
        delta = ((positions + 1) * BLOCK_TOKENS - start).repeat_interleave(rows)  # [C*t]
        moved = rotate(qs.repeat(1, len(chosen), 1), delta, rope)  # [Hq, C*t, D]
        num_kv_heads = self._full_groups()[0].block_shape[0]
        moved = moved.reshape(num_kv_heads, -1, len(chosen), rows, qs.shape[2])  # [Hkv, G, C, t, D]
        return moved.permute(2, 0, 1, 3, 4).reshape(len(chosen), num_kv_heads, -1, qs.shape[2])

    def _over_ranks(self, total: torch.Tensor) -> torch.Tensor:
        """Scores summed over this rank's heads, made the sum over every rank's (so they agree)."""
        shard = self.engine.runner.shard
        return shard.all_reduce(total) if shard is not None else total

    def _ensure_bounds(self) -> None:
        """Every block's key bounds: a saved window's read from its file (computed from its keys,
        read once, where the file has none or they are damaged). A lazy index has them once every
        window is indexed."""
        if self.missing:
            raise ValueError(f"{len(self.missing)} windows are not indexed yet: key bounds need every window (ensure them)")
        for n in sorted({self.blocks[i].window for i in (~self.has_bounds).nonzero().flatten().tolist()}):
            first, end = self._first_block[n], self._first_block[n + 1]
            saved = None
            if self.mapped[first] is not None:
                try:
                    saved = self.mapped[first][0].bounds()
                except BadSegment as exc:
                    emit(self.on_event, EngineWarning(f"a saved window's key bounds were {exc}; computing them again"))
            if saved is not None:
                self.kmin[first:end] = saved[:, :, 0]
                self.kmax[first:end] = saved[:, :, 1]
            else:
                f = 0
                for group in self._full_groups():
                    for pos in range(len(group.layers)):
                        k, _ = self._kv(group, pos, list(range(first, end)), values=False)
                        self._set_bounds(range(first, end), f, k.float().amin(dim=2), k.float().amax(dim=2))
                        f += 1
            self.has_bounds[first:end] = True

    def release(self) -> None:
        _release(self.engine.blocks, self.ids)
        self.engine.release(self.head)
        self._remove_scratch()


SCRATCH_PREFIX = "index-"


def _scratch_cache(folder: Path, index_bytes: int) -> KVCache:
    """A private cache for one unsaved index, in `folder/index-<pid>-<random>` (what dead processes
    left there is removed first)."""
    private_dir(folder)
    sweep_leftovers(folder, SCRATCH_PREFIX)
    return KVCache(folder / f"{SCRATCH_PREFIX}{os.getpid()}-{secrets.token_hex(4)}", index_bytes + 2**26)


def _remove_scratch(cache: KVCache) -> None:
    cache.close()
    shutil.rmtree(cache.folder, ignore_errors=True)


def _release(manager, ids: list[list[int | None]]) -> None:
    tables = [BlockTable(list(group_ids)) for group_ids in ids]
    for group_ids in ids:
        group_ids[:] = [None] * len(group_ids)
    manager.release(tables)


def _quietly(work, *args) -> None:
    try:
        work(*args)
    except (OSError, sqlite3.Error):
        pass
