"""A prefill's use of the saved-KV cache: the saved prefix restored into a fresh context, and
the prompt's new segments captured from the store and saved as the prefill goes."""

from __future__ import annotations

import sqlite3
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import torch

from ...config import BLOCK_TOKENS
from ...events import EngineWarning, EventCallback, emit
from ..block_manager import BlockManager
from ..context import Context
from .disk import _DTYPES, BadSegment, CacheBusy, KVCache, Segment
from .keys import chain_keys, end_key


class CachedPrefill:
    """One prefill's use of the cache: the prefix it restores into a fresh context and the
    segments it saves as the prefill goes.

        cached = CachedPrefill(cache, blocks, seed, model, token_ids, segment_tokens, label, on_event)
        restored = cached.restore(ctx)        # ctx.num_cached == ctx.cached_prefix == restored
        ... prefill the rest, calling cached.after_chunk(ctx) after every chunk ...
        cached.finish()                       # waits for the writes

    Only a prefix that ends strictly before the prompt's end is restored (the last token's logits
    are always computed), and only at a segment boundary (then every chunk after it starts where
    a fresh prefill's chunk starts, and the logits are the same bits). Unless `whole`: the caller
    reads no logits of the prompt (a retrieval index's head), so all of a prompt of whole blocks may
    be restored: its end (the blocks after its last whole segment, the very bits a prefill of this
    prompt computes) is saved too, under `end_key`.
    """

    def __init__(self, cache: KVCache, blocks: BlockManager, seed: str, model: str, token_ids: list[int],
                 segment_tokens: int, label: str | None = None, on_event: EventCallback | None = None,
                 agree: Callable[[int], int] | None = None, whole: bool = False) -> None:
        """agree: with tensor parallelism, the least of a count over the ranks: a prefix is restored
        only as far as every rank has it (each rank's segments hold its own KV heads). whole: see
        the class (not with `agree`)."""
        self.cache = cache
        self.agree = agree
        self.blocks = blocks
        self.store = store = blocks.store
        self.seed = seed
        self.model = model
        self.token_ids = token_ids
        self.segment_tokens = segment_tokens
        self.label = label or ""
        self.on_event = on_event
        self.keys = chain_keys(seed, token_ids, segment_tokens)
        self.whole = whole and agree is None and len(token_ids) % BLOCK_TOKENS == 0
        # where the prompt's end starts (its blocks after the last whole segment); none without `whole`
        self.end_start = len(token_ids) // segment_tokens * segment_tokens if self.whole else len(token_ids)
        self.end_key = end_key(seed, token_ids) if self.end_start < len(token_ids) else None
        self.present: set[str] = set()
        self.restored = 0
        self.stopped = False
        self.pending: list[Future] = []
        self._write_failed = threading.Event()  # set by the writer: save nothing more of this prompt
        self._lock_slow = threading.Event()  # set by the writer: it is waiting for the lock
        self._said_waiting = False
        self._dtype = next(name for name, dtype in _DTYPES.items() if dtype == store.groups[0].dtype)
        self._block_shape = list(store.groups[0].stored_shape)

    @property
    def segment_bytes(self) -> int:
        """Upper bound of one segment's payload (sliding-window groups may hold fewer blocks)."""
        return sum(g.block_bytes for g in self.store.groups) * (self.segment_tokens // BLOCK_TOKENS)

    def restore(self, ctx: Context) -> int:
        """Loads the longest saved prefix into `ctx` (fresh, empty) and returns its length in tokens."""
        assert ctx.num_cached == 0 and not ctx.tokens
        usable = (len(self.token_ids) - (0 if self.whole else 1)) // self.segment_tokens
        try:
            self.present = self.cache.present(self.keys + [self.end_key] * (self.end_key is not None))
        except (OSError, sqlite3.Error) as exc:
            self._warn(f"the saved-KV index is unreadable ({exc}); prefilling without it")
            self.stopped = True
            if self.agree is not None:
                self.agree(0)  # the other ranks wait for this rank's count
            return 0
        count = 0
        while count < usable and self.keys[count] in self.present:
            count += 1
        if self.agree is not None:
            count = self.agree(count)
        if count == 0 and self.end_key not in self.present:
            return 0
        self.blocks.reserve(ctx.tables, len(self.token_ids))
        done = 0
        read = []  # with `agree`: every segment read before any is placed (the ranks agree on how many)
        for index in range(count):
            key = self.keys[index]
            try:
                segment = self.cache.read(key, self.seed)
                self._check(segment, index * self.segment_tokens)
            except FileNotFoundError:
                self.present.discard(key)  # evicted by another process meanwhile
                break
            except BadSegment as exc:
                self._warn(f"saved KV of {self.label or 'the document'} (tokens {index * self.segment_tokens}-"
                           f"{(index + 1) * self.segment_tokens}) was {exc}; discarded it, recomputing")
                self._quietly(self.cache.discard, key, self._waiting_once)
                self.present.discard(key)
                break
            except OSError as exc:
                self._warn(f"could not read saved KV from {self.cache.folder} ({exc}); recomputing")
                self.stopped = True
                break
            if self.agree is None:
                self._place(ctx, segment, index * self.segment_tokens)
            else:
                read.append(segment)
            done = index + 1
        if self.agree is not None:
            done = self.agree(done)
            for index, segment in enumerate(read[:done]):
                self._place(ctx, segment, index * self.segment_tokens)
        self.restored = done * self.segment_tokens
        if done == usable and self.end_key in self.present and not self.stopped:
            self.restored = self._restore_end(ctx)
        if self.restored == 0:
            return 0
        ctx.tokens = list(self.token_ids[:self.restored])
        ctx.num_cached = ctx.cached_prefix = self.restored
        used = self.keys[:done] + [self.end_key] * (self.restored == len(self.token_ids) and self.end_key is not None)
        try:
            self.cache.touch(used, self.label, self._waiting_once)
        except CacheBusy as exc:
            self._warn(f"{exc}; running without the saved-KV cache")
            self.stopped = True  # its writes would wait as long again
        except (OSError, sqlite3.Error):
            pass  # bookkeeping the next run redoes
        return self.restored

    def _restore_end(self, ctx: Context) -> int:
        """Places the saved end of the prompt after its restored segments; returns the tokens
        restored in all (the prompt's length, or where its segments end if the end is unusable)."""
        start, end = self.end_start, len(self.token_ids)
        try:
            segment = self.cache.read(self.end_key, self.seed)
            self._check(segment, start, end)
        except FileNotFoundError:
            self.present.discard(self.end_key)
            return start
        except BadSegment as exc:
            self._warn(f"saved KV of {self.label or 'the document'} (tokens {start}-{end}) was {exc}; discarded it, "
                       "recomputing")
            self._quietly(self.cache.discard, self.end_key, self._waiting_once)
            self.present.discard(self.end_key)
            return start
        except OSError as exc:
            self._warn(f"could not read saved KV from {self.cache.folder} ({exc}); recomputing")
            self.stopped = True
            return start
        self._place(ctx, segment, start)
        return end

    @staticmethod
    def _quietly(work, *args) -> None:
        """Index bookkeeping that may fail without harm (the next run redoes it)."""
        try:
            work(*args)
        except (OSError, sqlite3.Error):
            pass

    def after_chunk(self, ctx: Context) -> None:
        """Saves the segment that ends where the context now ends, if one does and it is new."""
        self._say_if_waiting()
        end = ctx.num_cached
        if self.stopped or self._write_failed.is_set() or end <= self.restored or end > len(self.token_ids):
            return
        if end % self.segment_tokens == 0:
            start, key = end - self.segment_tokens, self.keys[end // self.segment_tokens - 1]
        elif end == len(self.token_ids) and self.end_key is not None:
            start, key = self.end_start, self.end_key
        else:
            return
        if key in self.present:
            return
        if self.segment_bytes * end / self.segment_tokens > self.cache.limit_bytes:
            self.stopped = True  # the prefix would not fit under the limit: save no more of it
            return
        header, groups = self._capture(ctx, key, start, end)
        self.pending.append(self.cache.submit(lambda: self._write(header, groups)))
        self.present.add(key)

    def _write(self, header: dict, groups: list[torch.Tensor]) -> None:
        """On the writer thread: one segment, unless an earlier one of this prompt failed (a full
        disk or a stuck lock would fail, or wait, for every later segment again)."""
        if self._write_failed.is_set():
            return
        try:
            self.cache.write(header, groups, self.label, self.model, on_wait=self._lock_slow.set)
        except BaseException:
            self._write_failed.set()
            raise

    def finish(self) -> None:
        """Waits for this prefill's writes; a failed write is one warning (the answer is unaffected)."""
        failure = None
        for future in self.pending:
            while True:
                try:
                    future.result(timeout=0.1)
                except FutureTimeout:
                    self._say_if_waiting()
                    continue
                except (OSError, sqlite3.Error) as exc:
                    failure = failure or exc
                break
        self.pending = []
        if failure is not None:
            self._warn(f"could not save KV to {self.cache.folder}: {failure}; the answer does not depend on it")

    def _say_if_waiting(self) -> None:
        """Reports, from this thread, that the writer is waiting for the lock (once)."""
        if self._lock_slow.is_set():
            self._waiting_once(EngineWarning(self.cache.waiting_message()))

    def _waiting_once(self, event) -> None:
        if not self._said_waiting:
            self._said_waiting = True
            emit(self.on_event, event)

    def _capture(self, ctx: Context, key: str, start: int, end: int) -> tuple[dict, list[torch.Tensor]]:
        """The header and K/V of the context's tokens start..end (a segment, or the prompt's end),
        copied out of the store."""
        index = start // self.segment_tokens  # the segments before it
        groups, described = [], []
        for group, table in zip(self.store.groups, ctx.tables):
            blocks = [b for b in range(start // BLOCK_TOKENS, end // BLOCK_TOKENS) if table.ids[b] is not None]
            data = torch.empty((len(group.layers), 2, len(blocks), *group.stored_shape), dtype=group.dtype)
            for i, block in enumerate(blocks):
                block_id = table.ids[block]
                for pos in range(len(group.layers)):
                    data[pos, 0, i].copy_(group.k_block(pos, block_id))
                    data[pos, 1, i].copy_(group.v_block(pos, block_id))
            groups.append(data)
            described.append({"window": group.window, "layers": len(group.layers), "blocks": blocks})
        header = {
            "key": key, "parent": self.keys[index - 1] if index else "", "root": self.keys[0] if self.keys else key,
            "seed": self.seed, "start": start, "end": end,
            "dtype": self._dtype, "block_shape": self._block_shape, "groups": described,
        }
        return header, groups

    def _check(self, segment: Segment, start: int, end: int | None = None) -> None:
        """Raises BadSegment unless the segment (tokens start..end; default a whole segment) fits
        this store and holds every block a prefill resumed at its end needs."""
        try:
            self._check_layout(segment.header, start, start + self.segment_tokens if end is None else end)
        except (KeyError, TypeError, ValueError) as exc:
            raise BadSegment(f"unreadable ({exc!r})") from None

    def _check_layout(self, header: dict, start: int, end: int) -> None:
        first = start // BLOCK_TOKENS
        if header.get("dtype") != self._dtype or list(header.get("block_shape", [])) != self._block_shape:
            raise BadSegment("of another KV shape or dtype")
        if header.get("start") != start or header.get("end") != end:
            raise BadSegment("of another segment length")
        described = header.get("groups", [])
        if len(described) != len(self.store.groups):
            raise BadSegment("of another layer layout")
        for group, desc in zip(self.store.groups, described):
            if desc["window"] != group.window or desc["layers"] != len(group.layers):
                raise BadSegment("of another layer layout")
            blocks = desc["blocks"]
            first_needed = max(first, _first_visible_block(end, group.window))
            if blocks != sorted(set(blocks)) or any(not first <= b < end // BLOCK_TOKENS for b in blocks):
                raise BadSegment("inconsistent (block list)")
            if not set(range(first_needed, end // BLOCK_TOKENS)) <= set(blocks):
                raise BadSegment("incomplete (blocks missing)")

    def _place(self, ctx: Context, segment: Segment, start: int) -> None:
        """Appends a checked segment's blocks (its tokens from `start` on) to the context (through
        the block manager)."""
        saved = [(desc["blocks"], data) for desc, data in zip(segment.header["groups"], segment.groups)]
        self.blocks.restore(ctx.tables, start // BLOCK_TOKENS, (segment.header["end"] - start) // BLOCK_TOKENS, saved)

    def _warn(self, message: str) -> None:
        emit(self.on_event, EngineWarning(message))


def _first_visible_block(end: int, window: int) -> int:
    """First block a query at position `end` can see in a layer of this window (0: full attention)."""
    return max(0, end - window + 1) // BLOCK_TOKENS if window else 0
