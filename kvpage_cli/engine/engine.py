"""Engine: load a model, prefill contexts, fork them, and advance many of them at once.

The public API over the engine's parts: loading is load.py, the step loop scheduler.py.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..errors import ContextTooLongError, UsageError
from .attention.dispatch import SCORE_QUERY_TOKENS, AttentionDispatch
from .attention.policy import DraftPolicy, QuestPolicy, make_policy
from .attention.selector import Selector
from .config import DEFAULT_POOL_MIB, GPU_POOL_SHARE, EngineConfig
from .device_step import DeviceDecode
from .events import EngineWarning, EventCallback, KVRestored, PrefillProgress, emit
from .kv.block_manager import BlockManager
from .kv.context import Context
from .kv.mover import Mover
from .kv.pool import SlotPool
from .kv.saved.capture import CachedPrefill
from .kv.saved.disk import KVCache
from .kv.saved.keys import chain_seed, segment_tokens_for
from .kv.store import BlockStore, block_bytes_per_layer
from .load import DTYPES, load
from .metrics import EngineStats, Metrics
from .model.runner import ModelRunner
from .model.spec import ModelSpec
from .model.weights import DEFAULT_MODEL
from .scheduler import Request, Scheduler

__all__ = ["Engine", "Request"]


def default_pool_mib(device: torch.device, most_bytes: int) -> float:
    """The pool where EngineConfig.pool_mib is None: DEFAULT_POOL_MIB on a CPU; on a GPU,
    GPU_POOL_SHARE of its memory free now (the weights loaded), at least DEFAULT_POOL_MIB and at
    most `most_bytes` (the most KV the engine's steps can read at once: more would stay empty)."""
    if device.type != "cuda":
        return DEFAULT_POOL_MIB
    free, _ = torch.cuda.mem_get_info(device)
    return max(DEFAULT_POOL_MIB, min(GPU_POOL_SHARE * free, most_bytes) / 2**20)


class Engine:
    """A model on a paged KV cache. Build one with `Engine.load`."""

    def __init__(self, name: str, spec: ModelSpec, runner: ModelRunner, tokenizer, config: EngineConfig,
                 device: torch.device, backend, kv_path: str, home: Path, fingerprint: str, kv_dtype: str,
                 draft: "Engine | None" = None, observer=None) -> None:
        """Built by `load`. backend: the attention backend (backend.py); draft: a separate draft
        model decoding alongside ("draft" policy); observer: receives this engine's decode attention
        (set when this engine is itself the draft of another)."""
        self.name = name
        self.spec = spec
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.backend = backend
        self.kv_path = kv_path
        self.home = home
        self.fingerprint = fingerprint
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype_name = kv_dtype  # the blocks' element type, as load resolved "auto"
        self.kv_dtype = DTYPES[kv_dtype]
        self.max_context = config.max_context or spec.max_position
        host_bytes = int(config.host_mib * 2**20) if config.host_mib is not None else None
        self.store = BlockStore([layer.window for layer in spec.layers], spec.num_kv_heads, spec.head_dim, self.kv_dtype,
                                torch.device("cpu"), host_bytes, home / "tmp", pin=device.type == "cuda")
        # the slots a pool of pool_mib holds for the whole model: with tensor parallelism every rank
        # has as many (its pool is its heads' share of the bytes), so that selective budgets agree
        slot_bytes = block_bytes_per_layer(runner.full_spec.num_kv_heads, spec.head_dim, self.kv_dtype)
        # at most: max_batch sequences of the longest context, every layer's KV
        most = config.max_batch * self.max_context * runner.full_spec.kv_bytes_per_token(kv_dtype)
        pool_mib = config.pool_mib if config.pool_mib is not None else default_pool_mib(device, most)
        slots = int(pool_mib * 2**20) // (spec.num_layers * slot_bytes)
        if config.pool_mib is None and runner.shard is not None and device.type == "cuda":
            slots = int(runner.shard.least(torch.tensor([slots]))[0])  # sized by each GPU's free memory: the least
        if slots < 1:
            need = spec.num_layers * slot_bytes / 2**20
            raise UsageError(f"pool_mib={pool_mib} is too small for {name}: one slot per layer needs {need:.3f} MiB")
        selective = config.mode == "selective"
        mover = Mover(device) if selective and kv_path == "pool" else None
        self.metrics = Metrics()
        step = config.decode_step if config.decode_step != "auto" else "graph" if device.type == "cuda" else "host"
        on_device = step != "host" and kv_path == "pool" and backend.name in ("torch", "triton") \
            and kv_dtype != "int8" and runner.shard is None
        self.pool = SlotPool(spec.num_layers, slots, spec.num_kv_heads, spec.head_dim, self.kv_dtype, device, mover,
                             self._relay, sink=on_device)
        # selective mode keeps each block's key min/max (the quest policy, and retrieval's first stage)
        self.key_bounds = QuestPolicy(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.group_size) if selective else None
        self.blocks = BlockManager(self.store, self._freed, [self.key_bounds] if self.key_bounds else [],
                                   backend.lib if backend.name == "native" else None)
        self.dispatch = AttentionDispatch(spec, self.store, self.pool, backend, kv_path,
                                          SCORE_QUERY_TOKENS if selective else 0, observer)
        self.device_decode = DeviceDecode(self, graphs=step == "graph") if on_device else None
        if self.device_decode is not None:
            self.blocks.on_copy = self.device_decode.resident.copied_on_write
            self.device_decode.resident.on_landed = self.blocks.landed  # selective mode's key bounds see them
        self.draft = draft
        self.policy = None
        if selective:
            self.set_selection(config.policy, slots)
        self.segment_tokens = segment_tokens_for(config.prefill_chunk)
        # Restored KV must be the bits this engine computes: the seed names how it computes them.
        self.cache_seed = chain_seed(fingerprint, f"{backend.name}|{kv_path}|{device.type}|{config.mode}|{config.policy}|"
                                                  f"chunk{config.prefill_chunk}")
        self._kv_cache: KVCache | None = None
        self.scheduler = Scheduler(self)

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, source=DEFAULT_MODEL, config: EngineConfig | None = None, *, tokenizer=None,
             on_event: EventCallback | None = None, observer=None) -> "Engine":
        """Loads a model: an alias ("smollm2", "gemma3-270m"), a Hugging Face folder, a .gguf file,
        or an in-memory transformers PreTrainedModel (then pass its tokenizer, if any)."""
        return load(cls, source, config, tokenizer=tokenizer, on_event=on_event, observer=observer)

    # -- contexts ------------------------------------------------------------------------------

    def new_context(self) -> Context:
        ctx = Context(self.blocks.new_tables())
        if self.draft is not None:
            ctx.draft = self.draft.new_context()
        weakref.finalize(ctx, self.blocks.release, ctx.tables)
        return ctx

    def fork(self, ctx: Context) -> Context:
        """A copy of `ctx` that shares its blocks (copy-on-write: nothing is copied now)."""
        child = Context(self.blocks.fork(ctx.tables), list(ctx.tokens), ctx.num_cached)
        child.last_logits = ctx.last_logits
        child.cached_prefix = ctx.cached_prefix
        child.score_queries, child.block_scores = ctx.score_queries, ctx.block_scores
        if ctx.draft is not None:
            child.draft = self.draft.fork(ctx.draft)
        weakref.finalize(child, self.blocks.release, child.tables)
        return child

    def release(self, ctx: Context) -> None:
        """Frees the context's blocks now (otherwise they are freed when it is garbage collected)."""
        if not ctx.released:
            if ctx.draft is not None:
                self.draft.release(ctx.draft)
            self.blocks.release(ctx.tables)
            ctx.released = True

    def _draft_observed(self, layer: int, draft_ctx: Context, step: int, positions: torch.Tensor,
                        lse: torch.Tensor) -> None:
        """The draft engine attended to its blocks at `step`: its attention mass ranks ours."""
        if isinstance(self.policy, DraftPolicy):
            self.policy.observe(draft_ctx, step, positions, lse)

    def prefill(self, token_ids: Iterable[int], on_event: EventCallback | None = None, *, label: str | None = None,
                use_cache: bool = True, logits: bool = True) -> Context:
        """A new context holding `token_ids` (their K/V in blocks, logits of the last one ready).

        With the saved-KV cache on (`EngineConfig.kv_cache`, and `use_cache`), the longest saved
        prefix of `token_ids` is loaded instead of computed (`ctx.cached_prefix` tokens; the
        PrefillProgress events carry it as `cached`), and the prompt's new whole segments are
        saved for later runs under `label` (e.g. the document's path, shown by `kvpage cache ls`).
        The logits are the same bits either way.

        logits=False: the caller reads neither the last token's logits nor the prompt's kept
        queries (a retrieval index's head, which only ever has tokens appended): then a prompt of
        whole blocks is saved whole and, once saved, restored whole, with neither
        (`ctx.last_logits` and `ctx.score_queries` None; the K/V the same bits). Not with tensor
        parallelism."""
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        ctx = self.new_context()
        cache = self._open_cache(on_event) if use_cache else None
        if cache is None:
            self._append_one(ctx, token_ids, on_event)
            return ctx
        self._check_length(len(token_ids))
        started = self._clock()
        shard = self.runner.shard
        agree = None if shard is None else (lambda count: int(shard.least(torch.tensor([count]))[0]))
        cached = CachedPrefill(cache, self.blocks, self.cache_seed, self.name, token_ids, self.segment_tokens, label,
                               on_event, agree, whole=not logits)
        restored = cached.restore(ctx)
        if ctx.draft is not None and restored:
            self.draft.append(ctx.draft, token_ids[:restored])
        elapsed = self._clock() - started
        self._emit(on_event, KVRestored(restored, elapsed))
        if restored:
            emit(on_event, PrefillProgress(restored, len(token_ids), elapsed, restored))
        try:
            if restored < len(token_ids):
                self._append_one(ctx, token_ids[restored:], on_event, restored, cached.after_chunk)
        finally:
            cached.finish()
        return ctx

    def queries_after(self, ctx: Context, token_ids: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        """The queries of the last tokens of `token_ids` read after `ctx` (on a fork, released):
        layer -> (q [t, Hq, D] rotated, position of its first row)."""
        fork = self.fork(ctx)
        self.dispatch.capture_ids[fork.id] = SCORE_QUERY_TOKENS
        try:
            self._append_one(fork, list(token_ids), None)
            return fork.score_queries
        finally:
            self.dispatch.capture_ids.pop(fork.id, None)
            self.release(fork)

    def append_with_queries(self, ctx: Context, token_ids: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        """Appends `token_ids` to `ctx` (as `append`; fork first to keep it) and returns the
        queries of every one of them: layer -> (q [T, Hq, D] rotated, position of its first row).

        The tokens go in pieces of at most a prefill chunk (one pass each, every row's queries
        kept by the dispatch) and none of one row (a one-row piece runs as a decode query, whose
        queries are not kept); a single token is run with a copy of itself after it, whose row is
        dropped (a row never sees the rows after it) and which stays in `ctx`. Off the decode
        path: evidence (attention/evidence.py) scores an answer after it was decoded (an answer
        of 100 tokens is one pass, not seven of 16 rows)."""
        token_ids = list(token_ids)
        if not token_ids:
            return {}
        run = token_ids * 2 if len(token_ids) == 1 else token_ids
        size = self.config.prefill_chunk
        pieces = [run[i:i + size] for i in range(0, len(run), size)]
        if len(pieces[-1]) == 1:  # the piece before gives it its last token
            pieces[-2:] = [pieces[-2][:-1], pieces[-2][-1:] + pieces[-1]]
        rows: dict[int, list[torch.Tensor]] = {}
        first: dict[int, int] = {}
        for piece in pieces:
            self.dispatch.capture_ids[ctx.id] = len(piece)
            try:
                self._append_one(ctx, piece, None)
            finally:
                self.dispatch.capture_ids.pop(ctx.id, None)
            for layer, (q, start) in (ctx.score_queries or {}).items():
                rows.setdefault(layer, []).append(q)
                first.setdefault(layer, start)
            ctx.score_queries = ctx.block_scores = None
        return {layer: (torch.cat(qs)[:len(token_ids)], first[layer]) for layer, qs in rows.items()}

    def block_scores(self, ctx: Context) -> list[torch.Tensor] | None:
        """Per layer, each block's share of the attention the newest prompt's final tokens pay
        (blocks written after that prompt have no entry); None outside selective mode."""
        if ctx.block_scores is None and ctx.score_queries is not None:
            tables = self.dispatch.block_relevance(ctx, ctx.score_queries)
            if self.runner.shard is not None:  # sums over heads: over every rank's, so that the ranks agree
                tables = [self.runner.shard.all_reduce(t) for t in tables]
            ctx.block_scores = tables
        return ctx.block_scores

    def set_selection(self, policy: str | None, budget: int | None = None, recent_blocks: int | None = None) -> None:
        """Chooses how decode steps pick blocks: None for exact (every block), or a policy name
        ("lru", "quest", "draft", "scores") with a budget of blocks per layer (default: the pool's
        slots). Only an engine loaded in selective mode keeps what the policies need."""
        if policy is None:
            self.policy = None
            self.dispatch.use_selector(None)
            return
        if self.key_bounds is None:
            raise UsageError("selection needs an engine loaded with mode='selective'")
        draft_layers = 0 if self.draft is not None else self.config.draft_layers  # a separate draft replaces own layers
        self.policy = self.key_bounds if policy == "quest" else make_policy(policy, self.spec, draft_layers,
                                                                             relevance=self.block_scores)
        self.blocks.watchers = [w for w in {self.key_bounds, self.policy} if w is not None]
        recent = self.config.recent_blocks if recent_blocks is None else recent_blocks
        self.dispatch.use_selector(Selector(self.spec, self.store, self.policy, budget or self.pool.num_slots, recent,
                                            self.runner.shard))

    @property
    def kv_cache(self) -> KVCache | None:
        """The saved-KV cache under `home/kv` when `EngineConfig.kv_cache` is on, else None.
        Raises OSError when the folder cannot be used."""
        if self._kv_cache is None and self.config.kv_cache:
            shard = self.runner.shard  # each rank's files hold its own heads (one entry in `kvpage cache ls`)
            part = f"r{shard.rank}of{shard.world}" if shard is not None else ""
            self._kv_cache = KVCache(self.home / "kv", int(self.config.cache_mib * 2**20), part)
        return self._kv_cache

    def _open_cache(self, on_event: EventCallback | None) -> KVCache | None:
        try:
            return self.kv_cache
        except OSError as exc:  # a read-only or full home: run without the cache
            emit(on_event, EngineWarning(f"the saved-KV cache is unavailable ({exc}); prefilling without it"))
            return None

    # -- one sequence ----------------------------------------------------------------------------

    def logits(self, ctx: Context) -> torch.Tensor:
        """fp32 logits [vocab] after the context's last token."""
        if ctx.num_cached < len(ctx.tokens):
            self._append_one(ctx, [], None)
        if ctx.last_logits is None:
            raise ValueError("the context is empty")
        return ctx.last_logits

    def generate(self, ctx: Context, token_ids: Iterable[int] = (), max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, stop: Iterable[int] | None = None,
                 on_event: EventCallback | None = None, seed: int | None = None) -> Iterator[int]:
        """Appends `token_ids` to the context, then decodes up to `max_new_tokens`, yielding each new
        token id. Stops after a token in `stop` (default: the model's end-of-sequence tokens), which
        is yielded. The context grows with every token (fork first to keep the original)."""
        request = Request(ctx, list(token_ids), max_new_tokens, temperature, top_p, stop, seed)
        for _, token in self.run([request], on_event=on_event):
            yield token

    def append(self, ctx: Context, token_ids: Iterable[int], on_event: EventCallback | None = None) -> Context:
        """Appends tokens to the context (their K/V into blocks, logits of the last one ready)."""
        self._append_one(ctx, list(token_ids), on_event)
        return ctx

    def score(self, ctx: Context, token_ids: Iterable[int]) -> list[float]:
        """Log-probabilities of `token_ids` as a continuation of the context, one per token.

        The tokens are appended to the context (fork first to keep the original)."""
        return self.score_many([(ctx, list(token_ids))])[0]

    def _append_one(self, ctx: Context, token_ids: list[int], on_event, restored: int = 0, after_chunk=None) -> None:
        if ctx.released:
            raise ValueError("the context was released")
        request = Request(ctx, token_ids)
        for _ in self.run([request], on_event=on_event, restored=restored, after_chunk=after_chunk):
            pass

    # -- many sequences ----------------------------------------------------------------------------

    def append_many(self, ctxs: list[Context], token_lists: list[list[int]], on_event: EventCallback | None = None,
                    max_batch: int | None = None) -> None:
        """Appends each token list to its context, the contexts advancing together."""
        requests = [Request(ctx, list(ids)) for ctx, ids in zip(ctxs, token_lists)]
        for _ in self.run(requests, max_batch=max_batch, on_event=on_event):
            pass

    def score_many(self, pairs: list[tuple[Context, list[int]]], max_batch: int | None = None,
                   on_event: EventCallback | None = None) -> list[list[float]]:
        """`score` of many (context, continuation) pairs, run together. Each context grows by its
        continuation (fork first to keep it)."""
        requests, results = [], []
        for ctx, ids in pairs:
            ids = list(ids)
            if not ids:
                results.append([])
                continue
            first = float(torch.log_softmax(self.logits(ctx), dim=-1)[ids[0]])
            requests.append(Request(ctx, ids, all_logits=True, tag=len(results)))
            results.append([first])
        for _ in self.run(requests, max_batch=max_batch, on_event=on_event):
            pass
        for request in requests:
            every = torch.cat(request.logits)  # [T, V]
            log_probs = torch.log_softmax(every[:-1], dim=-1)
            results[request.tag] += [float(log_probs[i, t]) for i, t in enumerate(request.token_ids[1:])]
        return results

    def pooled_values(self, pairs: list[tuple[Context, list[int]]], max_batch: int | None = None) -> list[torch.Tensor]:
        """Appends each token list to its context (together, as `append_many`) and returns, per
        pair, the mean of those tokens' value vectors in every layer: [layers, Hkv * D] fp32.

        V is a linear map of each layer's normalised hidden state, so the result is a summary of
        the text's hidden states across the model's depth, computed by the pass that stores its KV
        (a trained head reads it; tasks/classifier.py)."""
        requests = [Request(ctx, list(ids), pool_values=True) for ctx, ids in pairs]
        for _ in self.run(requests, max_batch=max_batch):
            pass
        return [r.value_sums / max(1, len(r.token_ids)) for r in requests]

    def run(self, requests: Iterable[Request], max_batch: int | None = None, on_event: EventCallback | None = None,
            restored: int = 0, after_chunk=None) -> Iterator[tuple[Request, int]]:
        """Advances the requests together, yielding (request, token) for every decoded token.

        Continuous batching: up to `max_batch` requests (default `EngineConfig.max_batch`) run at
        once; each step runs the next prefill chunk of those still appending and one token of
        those decoding; a finished request leaves and a waiting one joins at the next step.
        restored, after_chunk: the single-request prefill's saved-KV bookkeeping (tokens already
        restored, counted in the progress; a callback after every chunk)."""
        return self.scheduler.run(requests, max_batch, on_event, restored, after_chunk)

    def _take_scores(self, ctx: Context) -> None:
        """In selective mode, keeps the final queries of the prompt just run (a prefill, or tokens
        appended: a question after a shared document) with the context, so the newest prompt ranks
        the blocks. The ranking is computed now if the policy in use ranks by prompt, else only if
        such a policy asks for it later."""
        captured = self.dispatch.take_captured(ctx)
        if captured:
            ctx.score_queries, ctx.block_scores = captured, None
            if self.policy is not None and self.policy.ranks_by_prompt:
                self.block_scores(ctx)

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.spec.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if eos is not None:
            ids.add(eos)
        return ids

    def _check_length(self, total: int) -> None:
        if total > self.max_context:
            raise ContextTooLongError(total, self.max_context)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- reporting -----------------------------------------------------------------------------

    def _emit(self, on_event: EventCallback | None, event) -> None:
        """An event of the engine's: folded into its stats, then passed to the caller's callback."""
        self.metrics.on_event(event)
        emit(on_event, event)

    def _freed(self, group_layers: list[int], block_ids: list[int]) -> None:
        """Blocks became free: the pool and the device path's resident slots forget them."""
        self.pool.forget(group_layers, block_ids)
        if self.device_decode is not None:
            self.device_decode.resident.forget(group_layers, block_ids)

    def _relay(self, event) -> None:
        """The pool's events (BlocksMoved), emitted during the step that runs now."""
        self._emit(self.scheduler.listener, event)

    def stats(self) -> EngineStats:
        """What was measured since the engine was loaded (or since `reset_stats`)."""
        pool = self.pool
        m = self.metrics
        return EngineStats(
            backend=self.backend.name,
            kv_path=self.kv_path,
            mode=self.config.mode,
            pool_bytes=pool.bytes,
            pool_slots_per_layer=pool.num_slots,
            store_bytes=self.store.bytes_used,
            store_reserved_bytes=self.store.bytes_reserved,
            weight_bytes=self.runner.weight_bytes,
            blocks_moved=m.blocks_moved,
            bytes_moved=m.bytes_moved,
            pool_hit_rate=m.pool_hit_rate,
            copy_seconds=m.copy_seconds,
            copy_wait_seconds=m.copy_wait_seconds,
            blocks_attended=m.blocks_attended,
            blocks_candidate=m.blocks_candidate,
            prefill_tokens=m.prefill_tokens,
            prefill_seconds=m.prefill_seconds,
            decode_tokens=m.decode_tokens,
            decode_seconds=m.decode_seconds,
            store_disk_bytes=self.store.bytes_on_disk,
            cached_tokens=m.cached_tokens,
            cache_load_seconds=m.cache_load_seconds,
            kv_read_bytes=m.kv_read_bytes,
        )

    def reset_stats(self) -> None:
        self.metrics.reset()

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, as kept (int8 blocks: with their rows' scales)."""
        return self.spec.kv_bytes_per_token(self.kv_dtype_name)

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, {self.spec.arch}, {self.config.dtype}, backend={self.backend.name}, kv_path={self.kv_path})"
