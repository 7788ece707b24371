"""The step loop: requests advance together, each step one forward pass over the rows of several
sequences (`dispatch.Step`): prefill chunks of some, one decode token of others.

`Engine.generate`, `append` and `score` are one-sequence views of `Scheduler.run`, so there is
one decode loop and one forward path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from .attention.dispatch import Segment, Step
from .config import SMALL_ROWS
from .events import DecodeProgress, EventCallback, PrefillProgress, StepDone, emit
from .kv.block_manager import Write
from .kv.context import Context
from .model.runner import Rows
from .sampler import sample


@dataclass(eq=False)
class Request:
    """One sequence to advance with `Engine.run`: `token_ids` appended to `ctx`, then up to
    `max_new_tokens` decoded (stopping after a token in `stop`; None: the model's end tokens).

    all_logits: keep the logits after every appended token (for `score`). pool_values: keep the sum
    of the appended tokens' value vectors per layer (for `pooled_values`). The context grows as it
    runs (fork first to keep the original). `generated` and `done` say how far it got."""

    ctx: Context
    token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    stop: Iterable[int] | None = None
    seed: int | None = None
    all_logits: bool = False
    tag: object = None  # the caller's: e.g. which question this is
    pool_values: bool = False  # sum the value vectors of the appended tokens, per layer (`pooled_values`)
    generated: list[int] = field(default_factory=list)
    value_sums: torch.Tensor | None = None  # pool_values: [layers, Hkv * D] fp32, over the appended tokens
    logits: list[torch.Tensor] = field(default_factory=list)  # all_logits: [t, V] per chunk
    done: bool = False
    _todo: list[int] = field(default_factory=list)
    _stop: set[int] = field(default_factory=set)
    _generator: torch.Generator | None = None


class Scheduler:
    """Continuous batching over an engine's parts (its runner, block manager and dispatch); the
    engine's public calls go through `run`."""

    def __init__(self, engine) -> None:
        self.engine = engine  # its clock, events, length limit, end tokens, selection and draft
        self.config = engine.config
        self.spec = engine.spec
        self.device = engine.device
        self.runner = engine.runner
        self.blocks = engine.blocks
        self.dispatch = engine.dispatch
        self.device_decode = engine.device_decode  # the device path for decode steps, where it runs
        self.listener: EventCallback | None = None  # the callback of the step running now (pool events)

    def run(self, requests: Iterable[Request], max_batch: int | None = None, on_event: EventCallback | None = None,
            restored: int = 0, after_chunk=None) -> Iterator[tuple[Request, int]]:
        """Engine.run (its docstring says what a run does); afterwards the store holds every row
        the device path wrote."""
        try:
            yield from self._run(requests, max_batch, on_event, restored, after_chunk)
        finally:
            if self.device_decode is not None:
                self.device_decode.sync()  # the store holds what the device wrote, for whoever reads it next

    def _run(self, requests, max_batch, on_event, restored, after_chunk) -> Iterator[tuple[Request, int]]:
        limit = max_batch or self.config.max_batch
        waiting = deque(requests)
        active: list[Request] = []
        progress = _Progress(restored, self.engine._clock())
        while waiting or active:
            while waiting and len(active) < limit:
                request = waiting.popleft()
                progress.total += self._start(request)
                if not request._todo:  # nothing to append: decode from the context's last logits
                    token = self._sample(request)
                    if token is not None:
                        progress.decoded += 1
                        emit(on_event, DecodeProgress(progress.decoded, progress.decode_seconds, token, len(active) + 1))
                        yield request, token
                if not request.done:
                    active.append(request)
            if not active:
                break
            work = [(request, self._next_rows(request)) for request in active]
            prompt = [bool(request._todo) or not request.generated for request, _ in work]
            if self.device_decode is not None and not any(prompt) and self._device_takes(active, on_event):
                yield from self._device_step(active, on_event, progress)
                active = [r for r in active if not r.done]
                continue
            self.listener = on_event
            try:
                # a step whose one-row segments are all generated tokens may give them other bits
                # batched than alone (AMX tiles, model.Rows); appended and scored tokens never
                tiles = all(not p for (_, rows), p in zip(work, prompt) if len(rows) == 1)
                seconds = self.step([(r.ctx, rows, _keep(r, p), r) for (r, rows), p in zip(work, prompt)], tiles)
            finally:
                self.listener = None
            prefill_rows = sum(len(rows) for (_, rows), p in zip(work, prompt) if p)
            decode_rows = sum(len(rows) for (_, rows), p in zip(work, prompt) if not p)
            self.engine._emit(on_event, StepDone(prefill_rows, decode_rows, seconds, *self.dispatch.take_step_counts()))
            progress.decode_seconds += seconds * decode_rows / (prefill_rows + decode_rows)
            progress.done += prefill_rows
            if prefill_rows:
                emit(on_event, PrefillProgress(progress.done, progress.total, self.engine._clock() - progress.started,
                                               active[0].ctx.cached_prefix if len(active) == 1 else 0))
            for (request, rows), in_prompt in zip(work, prompt):
                if in_prompt and after_chunk is not None:
                    if self.device_decode is not None:
                        self.device_decode.sync()  # the saved-KV cache reads the chunk's rows from the store
                    after_chunk(request.ctx)
                if request._todo:
                    continue
                if in_prompt:
                    self.engine._take_scores(request.ctx)
                token = self._sample(request)
                if token is not None:
                    progress.decoded += 1
                    emit(on_event, DecodeProgress(progress.decoded, progress.decode_seconds, token, len(active)))
                    yield request, token
            active = [r for r in active if not r.done]

    def _device_takes(self, active: list[Request], on_event) -> bool:
        """Whether the device path takes this decode step (what it says goes to the run's callback)."""
        self.listener = on_event
        try:
            return self.device_decode.takes(active)
        finally:
            self.listener = None

    def _device_step(self, active: list[Request], on_event, progress) -> Iterator[tuple[Request, int]]:
        """One decode step of every active request on the device (device_step.py)."""
        self.listener = on_event
        try:
            tokens, seconds = self.device_decode.decode(active)
        finally:
            self.listener = None
        self.engine._emit(on_event, StepDone(0, len(active), seconds, self.device_decode.kv_read_bytes,
                                                      *self.device_decode.step_counts))
        progress.decode_seconds += seconds
        for request, token in zip(active, tokens):
            token = self._sample(request, token)
            if token is not None:
                progress.decoded += 1
                emit(on_event, DecodeProgress(progress.decoded, progress.decode_seconds, token, len(active)))
                yield request, token

    def _start(self, request: Request) -> int:
        """Gets a request ready to run; returns the prompt rows it will run."""
        ctx = request.ctx
        if ctx.released:
            raise ValueError("the context was released")
        request._todo = ctx.tokens[ctx.num_cached:] + list(request.token_ids)
        ctx.tokens.extend(request.token_ids)
        self.engine._check_length(len(ctx.tokens))
        self.blocks.reserve(ctx.tables, len(ctx.tokens))
        request._stop = set(self.engine.stop_ids if request.stop is None else request.stop)
        if request.temperature > 0:
            seed = self.config.seed if request.seed is None else request.seed
            request._generator = torch.Generator().manual_seed(seed)
        if not request._todo and request.max_new_tokens and ctx.last_logits is None:
            raise ValueError("generate needs a context with at least one token")
        return len(request._todo)

    def _next_rows(self, request: Request) -> list[int]:
        """The tokens a request runs in the next step: its next prompt chunk, or its last token."""
        if request._todo:
            chunk = request._todo[:self.config.prefill_chunk]
            request._todo = request._todo[len(chunk):]
            return chunk
        ctx = request.ctx
        return ctx.tokens[ctx.num_cached:]

    def _sample(self, request: Request, token: int | None = None) -> int | None:
        """After the prompt: the next token (appended to the context), or None when done. token:
        the one the device chose already (greedy), else sampled here from the context's logits."""
        if request.done or len(request.generated) >= request.max_new_tokens:
            request.done = True
            return None
        ctx = request.ctx
        if token is None:
            token = sample(ctx.last_logits, request.temperature, request.top_p, request._generator)
        ctx.tokens.append(token)
        request.generated.append(token)
        if token in request._stop or len(request.generated) >= request.max_new_tokens:
            request.done = True
        else:
            self.engine._check_length(len(ctx.tokens))
        return token

    def step(self, work: list[tuple[Context, list[int], str, object]], tiles: bool = False) -> float:
        """One forward pass over the rows of several contexts: (context, its tokens, the logits
        kept: "none", "last" or "all", the request collecting "all" logits). tiles: one-row
        segments may take AMX tiles (a batch's generated tokens). Returns the seconds it took."""
        on_device = self.device_decode is not None and self.device_decode.takes_prefill(work)
        if on_device:  # rows copied back land in the store before make_room copies a shared block on write
            self.device_decode.resident.settle()
        elif self.device_decode is not None:
            self.device_decode.release()  # the host path reads the store and streams blocks through the pool
        # short segments first, so that their rows share one linear call (model.Rows)
        work = sorted(work, key=lambda item: len(item[1]) > SMALL_ROWS)
        segments, writes, token_ids, positions, counts, logit_rows, logit_counts = [], [], [], [], [], [], []
        row = 0
        for ctx, rows, keep, _ in work:
            start = ctx.num_cached
            self.blocks.make_room(ctx.tables, start, len(rows))
            segment = Segment(ctx, start, slice(row, row + len(rows)))
            segments.append(segment)
            writes.append(Write(ctx.tables, start, segment.rows))
            token_ids += rows
            positions.append(torch.arange(start, start + len(rows)))
            counts.append(len(rows))
            kept = {"none": 0, "last": 1, "all": len(rows)}[keep]
            logit_rows.append(torch.arange(row + len(rows) - kept, row + len(rows)))
            if kept:
                logit_counts.append(kept)
            row += len(rows)
        if on_device:  # prompt chunks on the device's resident slots (device_step.py)
            logits, seconds = self.device_decode.prefill(segments, token_ids, torch.cat(logit_rows), logit_counts, tiles)
        else:
            logits, seconds = self._forward(work, segments, writes, token_ids, positions, counts, logit_rows,
                                            logit_counts, tiles)
        first = 0
        for ctx, rows, keep, request in work:
            ctx.num_cached += len(rows)
            self.blocks.drop_outside_windows(ctx.tables, ctx.num_cached)
            kept = {"none": 0, "last": 1, "all": len(rows)}[keep]
            ctx.last_logits = logits[first + kept - 1] if kept else None
            if keep == "all":
                request.logits.append(logits[first:first + kept])
            first += kept
        if on_device:
            self.device_decode.after_prefill()
        return seconds

    def _forward(self, work, segments, writes, token_ids, positions, counts, logit_rows, logit_counts,
                 tiles: bool) -> tuple[torch.Tensor, float]:
        """The per-layer path's forward pass of a step: rows written to the store, attention by the
        dispatch. Returns the logits kept and the seconds it took."""
        if self.engine.draft is not None:  # the draft reads the same tokens first; its attention ranks our blocks
            for ctx, rows, _, _ in work:
                ctx.draft.tokens.extend(rows)
            self.engine.draft.scheduler.step([(ctx.draft, rows, "last", None) for ctx, rows, _, _ in work])
        step = Step(segments, tiles)
        plans = self.blocks.plan_writes(writes)
        started = self.engine._clock()
        logits = self.runner.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=self.device), torch.cat(positions).to(self.device),
            Rows.of(counts, tiles), self._writer(plans, work, segments),
            lambda layer, q: self.dispatch.attend(layer, q, step), torch.cat(logit_rows).to(self.device),
            Rows.of(logit_counts, tiles))
        return logits, self.engine._clock() - started

    def _writer(self, plans, work, segments):
        """The step's KV write callback; it also sums the value rows of requests that pool them."""
        pooling = [(request, segment.rows) for (_, _, _, request), segment in zip(work, segments)
                   if request is not None and request.pool_values]
        if not pooling:
            return lambda layer, k, v, rope: self.blocks.write(layer, k, v, rope, plans)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor, rope) -> None:
            self.blocks.write(layer, k, v, rope, plans)
            for request, rows in pooling:
                if request.value_sums is None:
                    request.value_sums = torch.zeros(self.spec.num_layers, v.shape[1] * v.shape[2])
                request.value_sums[layer] += v[rows].float().sum(0).flatten().cpu()

        return write


def _keep(request: Request, in_prompt: bool) -> str:
    """Which logits a request's rows need this step: every row's (scoring a prompt), the last
    row's (a prompt's last chunk, a decode step), or none (a prompt chunk before its last)."""
    if in_prompt and request.all_logits:
        return "all"
    return "none" if in_prompt and request._todo else "last"


@dataclass
class _Progress:
    """What one `run` has done so far, for its progress events."""

    done: int
    started: float
    total: int = 0
    decoded: int = 0
    decode_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.total = self.done
