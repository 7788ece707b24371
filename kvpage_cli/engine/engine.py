"""Engine: load a model, prefill contexts, fork them, and advance many of them at once.

Every forward pass is a step over the rows of one or several sequences (`batch.Step`): prefill
chunks of some, one decode token of others. `generate`, `append` and `score` are one-sequence
views of `run`, the batched loop, so there is one decode loop and one forward path.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

import torch

from kvpage_kernels.constants import HEAD_DIMS as TRITON_HEAD_DIMS

from ..errors import ContextTooLongError, ModelError, UsageError
from . import native
from .backend import NativeBackend, TorchBackend, TritonBackend
from .block_manager import BlockManager, Write
from .config import SMALL_ROWS, EngineConfig, kv_dtype_of
from .context import Context
from .dispatch import SCORE_QUERY_TOKENS, AttentionDispatch, Segment, Step
from .events import DecodeProgress, EngineWarning, EventCallback, KVRestored, PrefillProgress, StepDone, emit
from .home import default_home
from .kvcache import CachedPrefill, KVCache, chain_seed, model_fingerprint, segment_tokens_for
from .metrics import EngineStats, Metrics
from .model import ModelRunner, Rows
from .mover import Mover
from .parallel import Shard
from .policy import DraftPolicy, QuestPolicy, make_policy
from .pool import SlotPool
from .quant import UnsupportedFormat
from .sampler import sample
from .selector import Selector
from .spec import ModelSpec
from .store import BlockStore, block_bytes_per_layer
from .weights import DEFAULT_MODEL, gguf_file, load_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


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
        self.dtype = _DTYPES[config.dtype]
        self.kv_dtype_name = kv_dtype  # the blocks' element type, as load resolved "auto"
        self.kv_dtype = _DTYPES[kv_dtype]
        self.max_context = config.max_context or spec.max_position
        host_bytes = int(config.host_mib * 2**20) if config.host_mib is not None else None
        self.store = BlockStore([layer.window for layer in spec.layers], spec.num_kv_heads, spec.head_dim, self.kv_dtype,
                                torch.device("cpu"), host_bytes, home / "tmp")
        # the slots a pool of pool_mib holds for the whole model: with tensor parallelism every rank
        # has as many (its pool is its heads' share of the bytes), so that selective budgets agree
        slot_bytes = block_bytes_per_layer(runner.full_spec.num_kv_heads, spec.head_dim, self.kv_dtype)
        slots = int(config.pool_mib * 2**20) // (spec.num_layers * slot_bytes)
        if slots < 1:
            need = spec.num_layers * slot_bytes / 2**20
            raise UsageError(f"pool_mib={config.pool_mib} is too small for {name}: one slot per layer needs {need:.3f} MiB")
        selective = config.mode == "selective"
        mover = Mover(device) if selective and kv_path == "pool" else None
        self.metrics = Metrics()
        self._listener: EventCallback | None = None  # the callback of the step running now
        self.pool = SlotPool(spec.num_layers, slots, spec.num_kv_heads, spec.head_dim, self.kv_dtype, device, mover,
                             self._relay)
        # selective mode keeps each block's key min/max (the quest policy, and retrieval's first stage)
        self.key_bounds = QuestPolicy(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.group_size) if selective else None
        bake = backend.ops.rope_bake_store if backend.name == "triton" else None
        self.blocks = BlockManager(self.store, self.pool.forget, [self.key_bounds] if self.key_bounds else [], bake,
                                   backend.lib if backend.name == "native" else None)
        self.dispatch = AttentionDispatch(spec, self.store, self.pool, backend, kv_path,
                                          SCORE_QUERY_TOKENS if selective else 0, observer)
        self.draft = draft
        self.policy = None
        if selective:
            self.set_selection(config.policy, slots)
        self.segment_tokens = segment_tokens_for(config.prefill_chunk)
        # Restored KV must be the bits this engine computes: the seed names how it computes them.
        self.cache_seed = chain_seed(fingerprint, f"{backend.name}|{kv_path}|{device.type}|{config.mode}|{config.policy}|"
                                                  f"chunk{config.prefill_chunk}")
        self._kv_cache: KVCache | None = None

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, source=DEFAULT_MODEL, config: EngineConfig | None = None, *, tokenizer=None,
             on_event: EventCallback | None = None, observer=None) -> "Engine":
        """Loads a model: an alias ("smollm2", "gemma3-270m"), a Hugging Face folder, a .gguf file,
        or an in-memory transformers PreTrainedModel (then pass its tokenizer, if any)."""
        config = config or EngineConfig()
        home = Path(config.home).expanduser() if config.home else default_home()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = _resolve_device(config)
        backend_name, native_lib, triton_ops = _resolve_backend(config.backend, device, home, on_event)
        if backend_name == "triton" and config.kv_dtype not in ("auto", config.dtype):
            raise UsageError(f"--kv-dtype {config.kv_dtype} with --dtype {config.dtype} runs on the native and torch "
                             "backends; the Triton kernels read KV of the compute dtype")
        if backend_name == "triton" and config.weights not in ("auto", "float32") and native_lib is None:
            try:  # quantized weights for the Triton kernels are decoded once at load, by the native decoder
                native_lib = native.load(home)
            except native.NativeUnavailable as exc:
                raise UsageError(f"{config.weights} weights on the Triton kernels are decoded at load by the native "
                                 f"kernels, which are unavailable: {exc}") from exc
        weights_format = _resolve_weights(config.weights, source, home, native_lib, device, on_event)
        try:
            weights = load_weights(source, home, on_event, tokenizer, blocks=weights_format == "gguf")
        except UnsupportedFormat as exc:
            if config.weights != "auto":
                raise
            emit(on_event, EngineWarning(f"{exc}; using float32 weights (dequantized once)"))
            weights_format = "float32"
            weights = load_weights(source, home, on_event, tokenizer)
        spec = weights.spec
        if backend_name == "triton" and spec.head_dim not in TRITON_HEAD_DIMS:
            if config.backend == "triton" or weights_format != "float32":
                raise UsageError(f"the Triton kernels take head dims {', '.join(map(str, TRITON_HEAD_DIMS))}; this "
                                 f"model's is {spec.head_dim}: use backend 'torch' with float32 weights")
            emit(on_event, EngineWarning(f"the Triton kernels take head dims {', '.join(map(str, TRITON_HEAD_DIMS))}, "
                                         f"not this model's {spec.head_dim}: using the slower torch backend"))
            backend_name, triton_ops = "torch", None
        dtype = _DTYPES[config.dtype]
        rope = weights.rope
        # the split path also runs for a process group of one rank (torchrun --nproc-per-node 1:
        # bench/gpu_check.sh tries NCCL so); a caller's own larger group with tp 1 is left alone
        shard = Shard.current(config.tp) if config.tp > 1 or _process_group_size() == 1 else None
        runner = ModelRunner(spec, weights.tensors, rope, dtype, device, native_lib, weights_format, shard,
                             config.activations, kernels=triton_ops if backend_name == "triton" else None)
        del weights.tensors
        spec = runner.spec  # a rank's own heads: its store, pool and kernels hold and read only those
        kv_dtype = kv_dtype_of(config, weights_format, backend_name)
        if backend_name == "native":
            backend = NativeBackend(native_lib, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale,
                                    kv_dtype)
        elif backend_name == "triton":
            backend = TritonBackend(triton_ops, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale)
        else:
            backend = TorchBackend(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale)
        kv_path = config.kv_path
        if kv_path == "auto":
            kv_path = "store" if device.type == "cpu" else "pool"
        if kv_path == "store" and device.type != "cpu":
            raise UsageError("kv_path='store' reads blocks in place and needs the store on the compute device (cpu)")
        if backend_name == "triton" and kv_path == "store":
            kv_path = "pool"  # the Triton kernels read pool slots
        if config.max_context and config.max_context > spec.max_position:
            emit(on_event, EngineWarning(f"max_context {config.max_context} is beyond the {spec.max_position} "
                                         "positions the model was trained on; expect worse answers past that"))
        # the weights' format changes the KV they compute: it is part of the saved KV's key
        computed = config.dtype if weights_format == "float32" else f"{config.dtype}|{weights_format} weights"
        if config.activations != "float32":
            computed += f"|{config.activations} activations"
        if kv_dtype != config.dtype:
            computed += f"|{kv_dtype} KV"
        if runner.native_layers is not None:  # decode rows' norms and SiLU are rounded as layer.c rounds them
            computed += "|native layers"
        if shard is not None:  # the all-reduce's order changes the bits; each rank saves its own heads' share
            computed += f"|tensor-parallel over {shard.world} ranks"
        fingerprint = model_fingerprint(weights.fingerprint, computed, rope)
        engine_ref: list[Engine] = []
        draft = None
        if config.draft_model and config.mode == "selective":
            draft = cls.load(config.draft_model, replace(config, mode="exact", draft_model=None, kv_cache=False,
                                                         host_mib=None), on_event=on_event,
                             observer=lambda *args: engine_ref[0]._draft_observed(*args))
            if draft.spec.vocab_size != spec.vocab_size:
                raise ModelError(f"the draft model {config.draft_model} must share the model's tokenizer "
                                 f"(vocabularies of {draft.spec.vocab_size} and {spec.vocab_size} tokens)")
        engine = cls(weights.name, spec, runner, weights.tokenizer, config, device, backend, kv_path, home,
                     fingerprint, kv_dtype, draft, observer)
        engine_ref.append(engine)
        return engine

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
                use_cache: bool = True) -> Context:
        """A new context holding `token_ids` (their K/V in blocks, logits of the last one ready).

        With the saved-KV cache on (`EngineConfig.kv_cache`, and `use_cache`), the longest saved
        prefix of `token_ids` is loaded instead of computed (`ctx.cached_prefix` tokens; the
        PrefillProgress events carry it as `cached`), and the prompt's new whole segments are
        saved for later runs under `label` (e.g. the document's path, shown by `kvpage cache ls`).
        The logits are the same bits either way."""
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
                               on_event, agree)
        restored = cached.restore(ctx)
        if ctx.draft is not None and restored:
            self.draft.append(ctx.draft, token_ids[:restored])
        elapsed = self._clock() - started
        self._emit(on_event, KVRestored(restored, elapsed))
        if restored:
            emit(on_event, PrefillProgress(restored, len(token_ids), elapsed, restored))
        try:
            self._append_one(ctx, token_ids[restored:], on_event, restored, cached.after_chunk)
        finally:
            cached.finish()
        return ctx

    def queries_after(self, ctx: Context, token_ids: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        """The queries of the last tokens of `token_ids` read after `ctx` (on a fork, released):
        layer -> (q [t, Hq, D] rotated, position of its first row)."""
        fork = self.fork(ctx)
        self.dispatch.capture_ids.add(fork.id)
        try:
            self._append_one(fork, list(token_ids), None)
            return fork.score_queries
        finally:
            self.dispatch.capture_ids.discard(fork.id)
            self.release(fork)

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
        limit = max_batch or self.config.max_batch
        waiting = deque(requests)
        active: list[Request] = []
        progress = _Progress(restored, self._clock())
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
            self._listener = on_event
            try:
                # a step whose one-row segments are all generated tokens may give them other bits
                # batched than alone (AMX tiles, model.Rows); appended and scored tokens never
                tiles = all(not p for (_, rows), p in zip(work, prompt) if len(rows) == 1)
                seconds = self._step([(r.ctx, rows, _keep(r, p), r) for (r, rows), p in zip(work, prompt)], tiles)
            finally:
                self._listener = None
            prefill_rows = sum(len(rows) for (_, rows), p in zip(work, prompt) if p)
            decode_rows = sum(len(rows) for (_, rows), p in zip(work, prompt) if not p)
            self._emit(on_event, StepDone(prefill_rows, decode_rows, seconds, *self.dispatch.take_step_counts()))
            progress.decode_seconds += seconds * decode_rows / (prefill_rows + decode_rows)
            progress.done += prefill_rows
            if prefill_rows:
                emit(on_event, PrefillProgress(progress.done, progress.total, self._clock() - progress.started,
                                               active[0].ctx.cached_prefix if len(active) == 1 else 0))
            for (request, rows), in_prompt in zip(work, prompt):
                if in_prompt and after_chunk is not None:
                    after_chunk(request.ctx)
                if request._todo:
                    continue
                if in_prompt:
                    self._take_scores(request.ctx)
                token = self._sample(request)
                if token is not None:
                    progress.decoded += 1
                    emit(on_event, DecodeProgress(progress.decoded, progress.decode_seconds, token, len(active)))
                    yield request, token
            active = [r for r in active if not r.done]

    def _start(self, request: Request) -> int:
        """Gets a request ready to run; returns the prompt rows it will run."""
        ctx = request.ctx
        if ctx.released:
            raise ValueError("the context was released")
        request._todo = ctx.tokens[ctx.num_cached:] + list(request.token_ids)
        ctx.tokens.extend(request.token_ids)
        self._check_length(len(ctx.tokens))
        self.blocks.reserve(ctx.tables, len(ctx.tokens))
        request._stop = set(self.stop_ids if request.stop is None else request.stop)
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

    def _sample(self, request: Request) -> int | None:
        """After the prompt: the next token (appended to the context), or None when done."""
        if request.done or len(request.generated) >= request.max_new_tokens:
            request.done = True
            return None
        ctx = request.ctx
        token = sample(ctx.last_logits, request.temperature, request.top_p, request._generator)
        ctx.tokens.append(token)
        request.generated.append(token)
        if token in request._stop or len(request.generated) >= request.max_new_tokens:
            request.done = True
        else:
            self._check_length(len(ctx.tokens))
        return token

    def _step(self, work: list[tuple[Context, list[int], str, object]], tiles: bool = False) -> float:
        """One forward pass over the rows of several contexts: (context, its tokens, the logits
        kept: "none", "last" or "all", the request collecting "all" logits). tiles: one-row
        segments may take AMX tiles (a batch's generated tokens). Returns the seconds it took."""
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
        if self.draft is not None:  # the draft reads the same tokens first; its attention ranks our blocks
            for ctx, rows, _, _ in work:
                ctx.draft.tokens.extend(rows)
            self.draft._step([(ctx.draft, rows, "last", None) for ctx, rows, _, _ in work])
        step = Step(segments, tiles)
        plans = self.blocks.plan_writes(writes)
        started = self._clock()
        logits = self.runner.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=self.device), torch.cat(positions).to(self.device),
            Rows.of(counts, tiles), self._writer(plans, work, segments),
            lambda layer, q: self.dispatch.attend(layer, q, step), torch.cat(logit_rows).to(self.device),
            Rows.of(logit_counts, tiles))
        seconds = self._clock() - started
        first = 0
        for ctx, rows, keep, request in work:
            ctx.num_cached += len(rows)
            self.blocks.drop_outside_windows(ctx.tables, ctx.num_cached)
            kept = {"none": 0, "last": 1, "all": len(rows)}[keep]
            ctx.last_logits = logits[first + kept - 1] if kept else None
            if keep == "all":
                request.logits.append(logits[first:first + kept])
            first += kept
        return seconds

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

    def _relay(self, event) -> None:
        """The pool's events (BlocksMoved), emitted during the step that runs now."""
        self._emit(self._listener, event)

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


def _process_group_size() -> int:
    """Ranks of the running torch.distributed process group (0: none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0


def _resolve_device(config: EngineConfig) -> torch.device:
    """auto: CUDA when torch sees a GPU, unless the backend or KV path asked for runs on the CPU
    alone (native kernels; blocks read in place in the store), which then picks the CPU."""
    name = config.device
    if name == "auto":
        cpu_only = config.backend == "native" or config.kv_path == "store"
        return torch.device("cuda" if torch.cuda.is_available() and not cpu_only else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _resolve_backend(name: str, device: torch.device, home: Path, on_event: EventCallback | None):
    if name == "auto":
        if device.type == "cuda":
            try:
                return "triton", None, _triton_ops()
            except ModelError:
                return "torch", None, None
        try:
            return "native", native.load(home), None
        except native.NativeUnavailable as exc:
            emit(on_event, EngineWarning(f"native CPU kernels unavailable ({exc}); using the slower torch backend"))
            return "torch", None, None
    if name == "native":
        if device.type != "cpu":
            raise UsageError("the native backend runs on the CPU; use backend 'triton' or 'torch' on CUDA")
        try:
            return "native", native.load(home), None
        except native.NativeUnavailable as exc:
            raise UsageError(f"the native backend is unavailable: {exc}") from exc
    if name == "triton":
        return "triton", None, _triton_ops()
    return "torch", None, None


def _resolve_weights(name: str, source, home: Path, native_lib, device: torch.device,
                     on_event: EventCallback | None) -> str:
    """The weights' format: "auto" keeps a GGUF file's own blocks where the native kernels run
    (faster and smaller than fp32: see bench/engine.py --weights), float32 otherwise (on a GPU the
    Triton kernels read quantized weights too, when asked for: not yet measured against fp32)."""
    if name == "auto":
        if native_lib is None or device.type != "cpu":
            return "float32"
        try:
            return "gguf" if gguf_file(source, home, on_event) is not None else "float32"
        except ModelError:
            return "float32"  # loading the source raises the error that says what is wrong with it
    if name != "float32" and native_lib is None:
        raise UsageError(f"{name} weights run on the native CPU kernels or the Triton kernels, and this engine "
                         f"runs on neither (device {device.type}); use float32 weights here")
    return name


def _triton_ops():
    try:
        import kvpage_kernels
    except ImportError as exc:  # pragma: no cover - kvpage_kernels ships with kvpage
        raise ModelError(f"the Triton kernels cannot be imported: {exc}") from exc
    if not getattr(kvpage_kernels, "HAS_TRITON", False):
        raise ModelError("the triton backend needs the triton package: pip install triton")
    return kvpage_kernels
