"""Engine: load a model, prefill contexts, fork them, generate, and report what it measured."""

from __future__ import annotations

import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..errors import ContextTooLongError, ModelError, UsageError
from . import native
from .config import BLOCK_TOKENS, EngineConfig
from .context import BlockTable, Context
from .dispatch import AttentionDispatch
from .events import DecodeProgress, EngineWarning, EventCallback, PrefillProgress, emit
from .home import default_home
from .kvcache import CachedPrefill, KVCache, chain_seed, model_fingerprint, segment_tokens_for
from .metrics import EngineStats, Metrics
from .model import ModelRunner, RopeAt
from .mover import Mover
from .policy import DraftPolicy, QuestPolicy, make_policy
from .pool import SlotPool
from .selector import Selector
from .rope import rope_params_from_config
from .sampler import sample
from .spec import ModelSpec
from .store import BlockStore
from .weights import DEFAULT_MODEL, load_weights

SCORE_QUERY_TOKENS = 16  # final prompt tokens whose attention scores the blocks ("scores" policy)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Engine:
    """A model on a paged KV cache. Build one with `Engine.load`."""

    def __init__(self, name: str, spec: ModelSpec, runner: ModelRunner, tokenizer, config: EngineConfig,
                 device: torch.device, backend: str, kv_path: str, home: Path, fingerprint: str,
                 native_lib=None, triton_ops=None, draft: "Engine | None" = None) -> None:
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
        self.max_context = config.max_context or spec.max_position
        store_device = torch.device("cpu")
        host_bytes = int(config.host_mib * 2**20) if config.host_mib is not None else None
        self.store = BlockStore([layer.window for layer in spec.layers], spec.num_kv_heads, spec.head_dim, self.dtype,
                                store_device, host_bytes, home / "tmp")
        element = torch.empty(0, dtype=self.dtype).element_size()
        slot_bytes = 2 * spec.num_kv_heads * BLOCK_TOKENS * spec.head_dim * element
        slots = int(config.pool_mib * 2**20) // (spec.num_layers * slot_bytes)
        if slots < 1:
            need = spec.num_layers * slot_bytes / 2**20
            raise UsageError(f"pool_mib={config.pool_mib} is too small for {name}: one slot per layer needs {need:.3f} MiB")
        self.pool = SlotPool(spec.num_layers, slots, spec.num_kv_heads, spec.head_dim, self.dtype, device)
        self.dispatch = AttentionDispatch(spec, self.store, self.pool, backend, kv_path, native_lib, triton_ops)
        if native_lib is not None:
            runner.matvec = native.MatVec(native_lib, max(runner.lm_head_t.shape[1], 2 * spec.intermediate_size))
        self.metrics = Metrics()
        self.draft = draft  # a separate draft model decoding alongside (the "draft" policy)
        if draft is not None:
            draft.dispatch.observer = self._draft_observed
        self.policy = None
        self.key_bounds: QuestPolicy | None = None  # per-block key min/max, kept in selective mode
        if config.mode == "selective":
            self.key_bounds = QuestPolicy(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.group_size)
            self.dispatch.capture_rows = SCORE_QUERY_TOKENS
            self.set_selection(config.policy, slots)
            if kv_path == "pool":
                self.pool.mover = Mover(device)
        self.segment_tokens = segment_tokens_for(config.prefill_chunk)
        # Restored KV must be the bits this engine computes: the seed names how it computes them.
        self.cache_seed = chain_seed(fingerprint, f"{backend}|{kv_path}|{device.type}|{config.mode}|{config.policy}|"
                                                  f"chunk{config.prefill_chunk}")
        self._kv_cache: KVCache | None = None

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, source=DEFAULT_MODEL, config: EngineConfig | None = None, *, tokenizer=None,
             on_event: EventCallback | None = None) -> "Engine":
        """Loads a model: an alias ("smollm2", "gemma3-270m"), a Hugging Face folder, a .gguf file,
        or an in-memory transformers PreTrainedModel (then pass its tokenizer, if any)."""
        config = config or EngineConfig()
        home = Path(config.home).expanduser() if config.home else default_home()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = _resolve_device(config.device)
        weights = load_weights(source, home, on_event, tokenizer)
        dtype = _DTYPES[config.dtype]
        rope_keys = {layer.rope_key for layer in weights.spec.layers}
        rope = rope_params_from_config(weights.config, weights.spec.arch, rope_keys)
        runner = ModelRunner(weights.spec, weights.tensors, rope, dtype, device)
        del weights.tensors
        backend, native_lib, triton_ops = _resolve_backend(config.backend, device, home, on_event)
        kv_path = config.kv_path
        if kv_path == "auto":
            kv_path = "store" if device.type == "cpu" else "pool"
        if kv_path == "store" and device.type != "cpu":
            raise UsageError("kv_path='store' reads blocks in place and needs the store on the compute device (cpu)")
        if backend == "triton" and kv_path == "store":
            kv_path = "pool"  # the Triton kernels read pool slots
        if config.max_context and config.max_context > weights.spec.max_position:
            emit(on_event, EngineWarning(f"max_context {config.max_context} is beyond the {weights.spec.max_position} "
                                         "positions the model was trained on; expect worse answers past that"))
        fingerprint = model_fingerprint(weights.fingerprint, config.dtype, rope)
        draft = None
        if config.draft_model and config.mode == "selective":
            draft = cls.load(config.draft_model, replace(config, mode="exact", draft_model=None, kv_cache=False,
                                                         host_mib=None), on_event=on_event)
            if draft.spec.vocab_size != weights.spec.vocab_size:
                raise ModelError(f"the draft model {config.draft_model} must share the model's tokenizer "
                                 f"(vocabularies of {draft.spec.vocab_size} and {weights.spec.vocab_size} tokens)")
        return cls(weights.name, weights.spec, runner, weights.tokenizer, config, device, backend, kv_path, home,
                   fingerprint, native_lib, triton_ops, draft)

    # -- contexts ------------------------------------------------------------------------------

    def new_context(self) -> Context:
        ctx = Context([BlockTable() for _ in self.store.groups])
        if self.draft is not None:
            ctx.draft = self.draft.new_context()
        weakref.finalize(ctx, self._release_tables, ctx.tables)
        return ctx

    def _draft_observed(self, layer: int, step: int, positions: torch.Tensor, lse: torch.Tensor) -> None:
        """The draft engine attended to its blocks at `step`: its attention mass ranks ours."""
        if isinstance(self.policy, DraftPolicy):
            self.policy.observe(step, positions, lse)

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
        self.dispatch.captured = {}  # only this prompt's queries score the blocks
        cache = self._open_cache(on_event) if use_cache else None
        if cache is None:
            self._extend(ctx, token_ids, on_event)
            self._score_blocks(ctx)
            return ctx
        self._check_length(len(token_ids))
        started = self._clock()
        cached = CachedPrefill(cache, self.store, self.cache_seed, self.name, token_ids, self.segment_tokens, label, on_event)
        restored = cached.restore(ctx)
        if ctx.draft is not None and restored:
            self.draft.append(ctx.draft, token_ids[:restored])
        elapsed = self._clock() - started
        self.metrics.add_cached(restored, elapsed)
        if restored:
            self._bound_restored_keys(ctx)
            emit(on_event, PrefillProgress(restored, len(token_ids), elapsed, restored))
        try:
            self._extend(ctx, token_ids[restored:], on_event, restored, cached.after_chunk)
        finally:
            cached.finish()
        self._score_blocks(ctx)
        return ctx

    def _score_blocks(self, ctx: Context) -> None:
        """In selective mode, keeps the final queries of the prompt just run (a prefill, or tokens
        appended: a question after a shared document) with the context, so the newest prompt ranks
        the blocks. The ranking is computed now if the policy in use ranks by prompt, else only if
        such a policy asks for it later."""
        if self.dispatch.captured:
            ctx.score_queries, ctx.block_scores = self.dispatch.captured, None
            self.dispatch.captured = {}
            if self.policy is not None and self.policy.ranks_by_prompt:
                self.block_scores(ctx)

    def block_scores(self, ctx: Context) -> list[torch.Tensor] | None:
        """Per layer, each block's share of the attention the newest prompt's final tokens pay
        (blocks written after that prompt have no entry); None outside selective mode."""
        if ctx.block_scores is None and ctx.score_queries is not None:
            ctx.block_scores = self.dispatch.block_relevance(ctx, ctx.score_queries)
        return ctx.block_scores

    def set_selection(self, policy: str | None, budget: int | None = None, recent_blocks: int | None = None) -> None:
        """Chooses how decode steps pick blocks: None for exact (every block), or a policy name
        ("lru", "quest", "draft", "scores") with a budget of blocks per layer (default: the pool's
        slots). Only an engine loaded in selective mode keeps what the policies need."""
        if policy is None:
            self.policy = None
            self.dispatch.selector = None
            return
        if self.key_bounds is None:
            raise UsageError("selection needs an engine loaded with mode='selective'")
        draft_layers = 0 if self.draft is not None else self.config.draft_layers  # a separate draft replaces own layers
        self.policy = self.key_bounds if policy == "quest" else make_policy(policy, self.spec, draft_layers,
                                                                             relevance=self.block_scores)
        recent = self.config.recent_blocks if recent_blocks is None else recent_blocks
        self.dispatch.selector = Selector(self.spec, self.store, self.policy, budget or self.pool.num_slots, recent)

    @property
    def kv_cache(self) -> KVCache | None:
        """The saved-KV cache under `home/kv` when `EngineConfig.kv_cache` is on, else None.
        Raises OSError when the folder cannot be used."""
        if self._kv_cache is None and self.config.kv_cache:
            self._kv_cache = KVCache(self.home / "kv", int(self.config.cache_mib * 2**20))
        return self._kv_cache

    def _bound_restored_keys(self, ctx: Context) -> None:
        """Selective mode keeps each block's key min/max as blocks are written; restored blocks
        were not written here, so they get theirs now."""
        if self.key_bounds is None:
            return
        for layer in range(self.spec.num_layers):
            group, pos = self.store.group_of(layer), self.store.layer_pos[layer]
            for block_id in ctx.tables[group.index].live()[0]:
                self.key_bounds.written(layer, block_id, group.k_block(pos, block_id), True)

    def _open_cache(self, on_event: EventCallback | None) -> KVCache | None:
        try:
            return self.kv_cache
        except OSError as exc:  # a read-only or full home: run without the cache
            emit(on_event, EngineWarning(f"the saved-KV cache is unavailable ({exc}); prefilling without it"))
            return None

    def fork(self, ctx: Context) -> Context:
        """A copy of `ctx` that shares its blocks (copy-on-write: nothing is copied now)."""
        child = Context([table.copy() for table in ctx.tables], list(ctx.tokens), ctx.num_cached)
        child.last_logits = ctx.last_logits
        child.cached_prefix = ctx.cached_prefix
        child.score_queries, child.block_scores = ctx.score_queries, ctx.block_scores
        if ctx.draft is not None:
            child.draft = self.draft.fork(ctx.draft)
        for group, table in zip(self.store.groups, child.tables):
            group.allocator.incref(table.live()[0])
        weakref.finalize(child, self._release_tables, child.tables)
        return child

    def release(self, ctx: Context) -> None:
        """Frees the context's blocks now (otherwise they are freed when it is garbage collected)."""
        if not ctx.released:
            if ctx.draft is not None:
                self.draft.release(ctx.draft)
            self._release_tables(ctx.tables)
            ctx.released = True

    def _release_tables(self, tables: list[BlockTable]) -> None:
        for group, table in zip(self.store.groups, tables):
            ids = [b for b in table.ids if b is not None]
            table.ids = []
            table.changed()
            freed = group.allocator.decref(ids)
            self.pool.forget(group.layers, freed)

    # -- running -------------------------------------------------------------------------------

    def logits(self, ctx: Context) -> torch.Tensor:
        """fp32 logits [vocab] after the context's last token."""
        if ctx.num_cached < len(ctx.tokens):
            self._extend(ctx, [], None)
        if ctx.last_logits is None:
            raise ValueError("the context is empty")
        return ctx.last_logits

    def generate(self, ctx: Context, token_ids: Iterable[int] = (), max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, stop: Iterable[int] | None = None,
                 on_event: EventCallback | None = None, seed: int | None = None) -> Iterator[int]:
        """Appends `token_ids` to the context, then decodes up to `max_new_tokens`, yielding each new
        token id. Stops after a token in `stop` (default: the model's end-of-sequence tokens), which
        is yielded. The context grows with every token (fork first to keep the original)."""
        if ctx.released:
            raise ValueError("the context was released")
        token_ids = list(token_ids)
        stop_ids = set(self.stop_ids if stop is None else stop)
        generator = None
        if temperature > 0:
            generator = torch.Generator().manual_seed(self.config.seed if seed is None else seed)
        if token_ids or ctx.num_cached < len(ctx.tokens):
            self.dispatch.captured = {}
            self._extend(ctx, token_ids, on_event)
            self._score_blocks(ctx)
        if ctx.last_logits is None:
            raise ValueError("generate needs a context with at least one token")
        logits = ctx.last_logits
        decode_seconds = 0.0
        for step in range(max_new_tokens):
            token = sample(logits, temperature, top_p, generator)
            ctx.tokens.append(token)
            emit(on_event, DecodeProgress(step + 1, decode_seconds, token))
            yield token
            if token in stop_ids or step + 1 == max_new_tokens:
                return
            self._check_length(len(ctx.tokens))
            started = self._clock()
            logits = self._forward(ctx, ctx.tokens[ctx.num_cached:])
            elapsed = self._clock() - started
            decode_seconds += elapsed
            self.metrics.add_decode(1, elapsed)

    def append(self, ctx: Context, token_ids: Iterable[int], on_event: EventCallback | None = None) -> Context:
        """Appends tokens to the context (their K/V into blocks, logits of the last one ready)."""
        if ctx.released:
            raise ValueError("the context was released")
        self.dispatch.captured = {}  # only this call's queries score the blocks
        self._extend(ctx, list(token_ids), on_event)
        self._score_blocks(ctx)
        return ctx

    def score(self, ctx: Context, token_ids: Iterable[int]) -> list[float]:
        """Log-probabilities of `token_ids` as a continuation of the context, one per token.

        The tokens are appended to the context (fork first to keep the original)."""
        token_ids = list(token_ids)
        if not token_ids:
            return []
        logits = self.logits(ctx)
        scores = [float(torch.log_softmax(logits, dim=-1)[token_ids[0]])]
        self._check_length(len(ctx.tokens) + len(token_ids))
        ctx.tokens.extend(token_ids)
        every = self._forward(ctx, token_ids, all_logits=True)  # [T, V]
        log_probs = torch.log_softmax(every[:-1], dim=-1)
        scores += [float(log_probs[i, t]) for i, t in enumerate(token_ids[1:])]
        return scores

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

    def _extend(self, ctx: Context, token_ids: list[int], on_event: EventCallback | None, restored: int = 0,
                after_chunk=None) -> None:
        """Runs the context's pending tokens and `token_ids` in chunks. `restored`: prompt tokens
        already loaded from the saved-KV cache (counted in the progress events); `after_chunk(ctx)`
        runs after every chunk."""
        pending = ctx.tokens[ctx.num_cached:]
        ctx.tokens.extend(token_ids)
        todo = pending + token_ids
        self._check_length(len(ctx.tokens))
        for group in self.store.groups:
            if not group.window:
                group.reserve(-(-len(ctx.tokens) // BLOCK_TOKENS) - len(ctx.tables[group.index].ids) + 1)
        chunk = self.config.prefill_chunk
        started = self._clock()
        done = 0
        total = len(todo)
        for first in range(0, total, chunk):
            part = todo[first:first + chunk]
            self._forward(ctx, part)
            done += len(part)
            if after_chunk is not None:
                after_chunk(ctx)
            emit(on_event, PrefillProgress(restored + done, restored + total, self._clock() - started, ctx.cached_prefix))
        self.metrics.add_prefill(total, self._clock() - started)

    def _forward(self, ctx: Context, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        if ctx.draft is not None:  # the draft reads the same tokens first; its attention ranks our blocks
            self.draft.append(ctx.draft, token_ids)
        start = ctx.num_cached
        self._make_room(ctx, start, len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)

        def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, rope: RopeAt) -> None:
            self._write_kv(ctx, layer, start, k, v, rope)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return self.dispatch.attend(layer, q, start, ctx)

        logits = self.runner.forward(ids, start, write_kv, attend, all_logits=all_logits)
        ctx.num_cached += len(token_ids)
        self._drop_outside_windows(ctx)
        ctx.last_logits = logits[-1] if all_logits else logits
        return logits

    def _make_room(self, ctx: Context, start: int, count: int) -> None:
        last_block = (start + count - 1) // BLOCK_TOKENS
        for group, table in zip(self.store.groups, ctx.tables):
            offset = start % BLOCK_TOKENS
            if offset and start // BLOCK_TOKENS < len(table.ids):
                index = start // BLOCK_TOKENS
                shared = table.ids[index]
                if shared is not None and group.allocator.refcount[shared] > 1:
                    fresh = group.allocate(1)[0]
                    group.copy_block(shared, fresh, offset)
                    for policy in {self.policy, self.key_bounds} - {None}:
                        policy.copied(group.layers, shared, fresh)
                    group.allocator.decref([shared])
                    table.ids[index] = fresh
                    table.changed()
            missing = last_block + 1 - len(table.ids)
            if missing > 0:
                table.ids.extend(group.allocate(missing))
                table.changed()

    def _write_kv(self, ctx: Context, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, rope: RopeAt) -> None:
        """k (not rotated), v: [T, Hkv, D] of positions start.. -> their blocks in the store, RoPE baked in."""
        group = self.store.group_of(layer)
        pos = self.store.layer_pos[layer]
        ids = ctx.tables[group.index].ids
        if self.backend == "triton" and group.device == k.device and self.key_bounds is None:
            self.dispatch.bake(layer, k, v, rope, [ids[p // BLOCK_TOKENS] for p in range(start, start + k.shape[0])],
                               [p % BLOCK_TOKENS for p in range(start, start + k.shape[0])])
            return
        k = rope.apply(k)
        k = k.to(self.store.groups[0].device)
        v = v.to(self.store.groups[0].device)
        done, total = 0, k.shape[0]
        while done < total:
            position = start + done
            block, offset = divmod(position, BLOCK_TOKENS)
            count = min(BLOCK_TOKENS - offset, total - done)
            block_id = ids[block]
            group.k_block(pos, block_id)[:, offset:offset + count] = k[done:done + count].transpose(0, 1)
            group.v_block(pos, block_id)[:, offset:offset + count] = v[done:done + count].transpose(0, 1)
            if self.key_bounds is not None:
                self.key_bounds.written(layer, block_id, k[done:done + count].transpose(0, 1), offset == 0)
            done += count

    def _drop_outside_windows(self, ctx: Context) -> None:
        for group, table in zip(self.store.groups, ctx.tables):
            if not group.window:
                continue
            first_visible = max(0, ctx.num_cached - group.window + 1)
            dropped = table.drop_before(first_visible // BLOCK_TOKENS)
            if dropped:
                freed = group.allocator.decref(dropped)
                self.pool.forget(group.layers, freed)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- reporting -----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.pool
        m = self.metrics
        return EngineStats(
            backend=self.backend,
            kv_path=self.kv_path,
            mode=self.config.mode,
            pool_bytes=pool.bytes,
            pool_slots_per_layer=pool.num_slots,
            store_bytes=self.store.bytes_used,
            store_reserved_bytes=self.store.bytes_reserved,
            weight_bytes=self.runner.weight_bytes,
            blocks_moved=pool.blocks_moved,
            bytes_moved=pool.bytes_moved,
            pool_hit_rate=pool.hits / pool.lookups if pool.lookups else None,
            copy_seconds=self.dispatch.copy_seconds,
            copy_wait_seconds=self.pool.mover.waited_seconds if self.pool.mover else 0.0,
            blocks_attended=self.dispatch.selector.selected if self.dispatch.selector else 0,
            blocks_candidate=self.dispatch.selector.candidates if self.dispatch.selector else 0,
            prefill_tokens=m.prefill_tokens,
            prefill_seconds=m.prefill_seconds,
            decode_tokens=m.decode_tokens,
            decode_seconds=m.decode_seconds,
            store_disk_bytes=self.store.bytes_on_disk,
            cached_tokens=m.cached_tokens,
            cache_load_seconds=m.cache_load_seconds,
        )

    def reset_stats(self) -> None:
        self.metrics.reset()
        self.pool.blocks_moved = self.pool.bytes_moved = self.pool.hits = self.pool.lookups = 0
        self.dispatch.copy_seconds = 0.0
        if self.pool.mover is not None:
            self.pool.mover.waited_seconds = 0.0
        if self.dispatch.selector is not None:
            self.dispatch.selector.selected = self.dispatch.selector.candidates = 0

    def kv_bytes_per_token(self) -> int:
        element = torch.empty(0, dtype=self.dtype).element_size()
        return self.spec.kv_bytes_per_token(element)

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, {self.spec.arch}, {self.config.dtype}, backend={self.backend}, kv_path={self.kv_path})"


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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


def _triton_ops():
    try:
        import kvpage_kernels
    except ImportError as exc:  # pragma: no cover - kvpage_kernels ships with kvpage
        raise ModelError(f"the Triton kernels cannot be imported: {exc}") from exc
    if not getattr(kvpage_kernels, "HAS_TRITON", False):
        raise ModelError("the triton backend needs the triton package: pip install triton")
    return kvpage_kernels
