"""A library: a document longer than the model's context, indexed once into blocks kept in the store.

Indexing (DESIGN.md section 2, retrieval): the prompt's head (the instructions and the document's
first tokens, up to a block boundary) is prefilled once. The rest of the document is cut into
windows of `window` tokens (but its last tokens, less than a block, which every question reads
again); each window is prefilled on a fork of the head, after the `overlap`
tokens before it (read again for context, not kept), so every token is computed inside the
model's trained positions, with the head as its attention sink. The full-attention layers' blocks
of each window's own tokens are kept; sliding-window layers keep nothing (a question's sliding
layers see only the question's own recent window).

Assembly: a question's selected blocks are put, in document order, right after the head, each
moved to its new place by one rotation of its K rows (`rope.rotate`); nothing is recomputed. The
result is a context like any other: the question is appended and the answer decoded from it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .config import BLOCK_TOKENS
from .context import BlockTable, Context
from .events import EventCallback, IndexProgress, emit
from .rope import rotate


@dataclass(frozen=True)
class IndexedBlock:
    """One kept block: the 64 document tokens it holds (Library.tokens[first:first+64]) and the
    logical block index its K was baked at."""

    first: int
    position: int


class Library:
    """A document indexed window by window (see the module docstring). Build with `Library.build`."""

    def __init__(self, engine, head: Context, tokens: list[int], rest: list[int], blocks: list[IndexedBlock],
                 ids: list[list[int | None]]) -> None:
        self.engine = engine
        self.head = head  # the prompt's head: instructions and the document's first tokens
        self.tokens = tokens  # the document's tokens after the head, whole blocks of them
        self.rest = rest  # the document's last tokens (less than a block): read with every question
        self.blocks = blocks
        self.ids = ids  # per store group: the kept block of each IndexedBlock (None in sliding-window groups)
        weakref.finalize(self, _release, engine.blocks, engine.store, ids)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @classmethod
    def build(cls, engine, head_ids: list[int], doc_ids: list[int], window: int, overlap: int,
              on_event: EventCallback | None = None, label: str | None = None,
              max_batch: int | None = None) -> "Library":
        """Indexes `doc_ids` after the prompt head `head_ids`. window, overlap: tokens (multiples of 64)."""
        assert window % BLOCK_TOKENS == 0 and overlap % BLOCK_TOKENS == 0 and window > 0
        align = min(-len(head_ids) % BLOCK_TOKENS, len(doc_ids))
        head_tokens = head_ids + doc_ids[:align]
        head = engine.prefill(head_tokens, on_event, label=label)
        whole = (len(doc_ids) - align) // BLOCK_TOKENS * BLOCK_TOKENS
        rest, last = doc_ids[align:align + whole], doc_ids[align + whole:]
        base = len(head_tokens) // BLOCK_TOKENS
        starts = list(range(0, len(rest), window))
        blocks: list[IndexedBlock] = []
        kept: list[list[int | None]] = [[] for _ in engine.store.groups]
        total, done = len(rest), 0
        limit = max_batch or engine.config.max_batch
        started = engine._clock()
        for first in range(0, len(starts), limit):
            batch = starts[first:first + limit]
            forks = [engine.fork(head) for _ in batch]
            lists = [rest[max(0, s - overlap):s + window] for s in batch]
            engine.append_many(forks, lists, max_batch=limit)
            for ctx, s in zip(forks, batch):
                context = s - max(0, s - overlap)  # overlap tokens before the window's own
                position = base + context // BLOCK_TOKENS
                count = min(window, len(rest) - s)
                for j in range(count // BLOCK_TOKENS):
                    blocks.append(IndexedBlock(s + j * BLOCK_TOKENS, position + j))
                    for group, table, keep in zip(engine.store.groups, ctx.tables, kept):
                        if group.window:
                            keep.append(None)
                            continue
                        block_id = table.ids[position + j]
                        group.allocator.incref([block_id])
                        keep.append(block_id)
                engine.release(ctx)
                done += count
            emit(on_event, IndexProgress(done, total, engine._clock() - started))
        return cls(engine, head, rest, last, blocks, kept)

    def assemble(self, chosen: list[int]) -> Context:
        """A context holding the head and the chosen blocks (indices into `blocks`), in document
        order, at the positions right after the head; each block's K moved there by rotation."""
        engine = self.engine
        order = sorted(set(chosen))
        ctx = engine.fork(self.head)
        base = ctx.num_cached // BLOCK_TOKENS
        assert ctx.num_cached % BLOCK_TOKENS == 0
        tokens: list[int] = []
        for index in order:
            tokens += self.tokens[self.blocks[index].first:self.blocks[index].first + BLOCK_TOKENS]
        for group, table, keep in zip(engine.store.groups, ctx.tables, self.ids):
            if group.window:  # sliding-window layers: nothing from the document
                table.ids.extend([None] * len(order))
                table.changed()
                continue
            source = [keep[i] for i in order]
            moved = group.allocate(len(order))
            deltas = [(base + n - self.blocks[i].position) * BLOCK_TOKENS for n, i in enumerate(order)]
            engine.blocks.copy_moved(group, source, moved, deltas, engine.runner.rope, engine.spec.layers)
            table.ids.extend(moved)
            table.changed()
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
        spec = engine.spec
        total = torch.zeros(len(chosen))
        if not chosen:
            return total
        positions = torch.tensor([self.blocks[i].position for i in chosen], dtype=torch.int64)
        for layer in layers if layers is not None else range(spec.num_layers):
            group = engine.store.group_of(layer)
            if group.window:
                continue
            q, start = queries[layer]
            rope = engine.runner.rope[spec.layers[layer].rope_key]
            # every row moved so that the question's first row sits right after the block
            delta = (positions + 1) * BLOCK_TOKENS - start  # [C]
            qs = q.float().permute(1, 0, 2)  # [Hq, t, D]
            moved = torch.stack([rotate(qs, torch.full((qs.shape[1],), int(d)), rope) for d in delta])  # [C, Hq, t, D]
            k, _ = group.gather(engine.store.layer_pos[layer], [self.ids[group.index][i] for i in chosen])  # [C, Hkv, 64, D]
            num_kv_heads = k.shape[1]
            moved = moved.reshape(len(chosen), num_kv_heads, -1, moved.shape[-1])  # [C, Hkv, G*t, D]
            logits = torch.matmul(moved, k.float().transpose(-1, -2)) * spec.attn_scale  # [C, Hkv, G*t, 64]
            block_lse = torch.logsumexp(logits, dim=-1)  # [C, Hkv, G*t]
            total += torch.softmax(block_lse, dim=0).sum(dim=(1, 2))
        return total

    def release(self) -> None:
        _release(self.engine.blocks, self.engine.store, self.ids)
        self.engine.release(self.head)


def _release(manager, store, ids: list[list[int | None]]) -> None:
    tables = [BlockTable(list(group_ids)) for group_ids in ids]
    for group_ids in ids:
        group_ids.clear()
    manager.release(tables)
