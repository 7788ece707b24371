"""Paging loses nothing: small pools, forks, block accounting, and the errors a user can hit."""

from __future__ import annotations

import json

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig
from kvpage_cli.errors import ContextTooLongError, ModelError, UsageError

from .conftest import random_prompt, tiny_model


def slot_bytes(model) -> int:
    cfg = model.config
    return 2 * cfg.num_key_value_heads * BLOCK_TOKENS * cfg.head_dim * 4


def engine_with_slots(model, kv_home, slots: int, **config) -> Engine:
    pool_mib = slots * model.config.num_hidden_layers * slot_bytes(model) / 2**20
    engine = Engine.load(model, EngineConfig(home=str(kv_home), pool_mib=pool_mib, **config))
    assert engine.pool.num_slots == slots
    return engine


def run(engine: Engine, ids: list[int], new_tokens: int = 8) -> tuple[list[torch.Tensor], list[int]]:
    """Logits after the prompt and after each greedy step, and the tokens."""
    ctx = engine.prefill(ids)
    logits = [engine.logits(ctx).clone()]
    tokens = []
    for token in engine.generate(ctx, max_new_tokens=new_tokens, stop=()):
        tokens.append(token)
        if len(tokens) < new_tokens:
            continue
    # Re-run step by step to collect the logits of each decode step as well.
    ctx = engine.prefill(ids)
    for token in tokens:
        list(engine.generate(ctx, [token], max_new_tokens=0))
        logits.append(engine.logits(ctx).clone())
    return logits, tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_small_pool_is_bit_identical_to_a_pool_holding_everything(arch, backend, kv_home):
    model = tiny_model(arch)
    ids = random_prompt(22 * BLOCK_TOKENS + 17, seed=21)  # 23 blocks
    small = engine_with_slots(model, kv_home, 4, backend=backend, kv_path="pool")
    large = engine_with_slots(model, kv_home, 32, backend=backend, kv_path="pool")
    in_place = Engine.load(model, EngineConfig(home=str(kv_home), backend=backend, kv_path="store"))
    small_logits, small_tokens = run(small, ids)
    large_logits, large_tokens = run(large, ids)
    store_logits, store_tokens = run(in_place, ids)
    assert small_tokens == large_tokens == store_tokens
    for a, b, c in zip(small_logits, large_logits, store_logits):
        assert torch.equal(a, b)
        # Reading the store in place takes a different (faster) kernel split: exact, not the same bits.
        assert (a - c).abs().max().item() < 1e-5
    assert small.stats().blocks_moved > large.stats().blocks_moved  # the small pool really streamed
    assert small.stats().pool_bytes < large.stats().pool_bytes


def test_the_stats_are_the_events_the_caller_was_given(kv_home):
    """One stats object, fed by the events the engine emits: a caller's callback sees every pool
    copy and step, and the stats are their sum."""
    from kvpage_cli.engine.events import BlocksMoved, StepDone

    model = tiny_model("llama")
    engine = engine_with_slots(model, kv_home, 3, backend="native", kv_path="pool")
    seen = []
    ctx = engine.prefill(random_prompt(9 * BLOCK_TOKENS + 5, seed=4), on_event=seen.append)
    list(engine.generate(ctx, max_new_tokens=4, stop=(), on_event=seen.append))
    stats = engine.stats()
    moved = [e for e in seen if isinstance(e, BlocksMoved)]
    steps = [e for e in seen if isinstance(e, StepDone)]
    assert stats.blocks_moved == sum(e.blocks for e in moved) > 0
    assert stats.bytes_moved == sum(e.bytes for e in moved)
    assert stats.pool_hit_rate == sum(e.hits for e in moved) / sum(e.lookups for e in moved)
    assert stats.kv_read_bytes == sum(e.kv_read_bytes for e in steps) > 0
    assert stats.prefill_tokens + stats.decode_tokens == sum(e.prefill_tokens + e.decode_tokens for e in steps)
    engine.reset_stats()
    assert engine.stats().blocks_moved == engine.stats().kv_read_bytes == 0


def test_pool_size_does_not_depend_on_context_length(kv_home):
    model = tiny_model("llama")
    engine = engine_with_slots(model, kv_home, 4, kv_path="pool")
    engine.prefill(random_prompt(100))
    first = engine.stats().pool_bytes
    engine.prefill(random_prompt(3000))
    assert engine.stats().pool_bytes == first == 4 * model.config.num_hidden_layers * slot_bytes(model)


def test_fork_shares_blocks_and_answers_like_separate_runs(kv_home):
    model = tiny_model("llama")
    engine = Engine.load(model, EngineConfig(home=str(kv_home)))
    document = random_prompt(10 * BLOCK_TOKENS + 5, seed=31)
    question_a, question_b = random_prompt(20, seed=32), random_prompt(30, seed=33)

    separate_a = list(engine.generate(engine.prefill(document + question_a), max_new_tokens=16, stop=()))
    separate_b = list(engine.generate(engine.prefill(document + question_b), max_new_tokens=16, stop=()))
    import gc

    gc.collect()
    assert engine.stats().store_bytes == 0  # contexts that are gone gave their blocks back

    doc = engine.prefill(document)
    doc_bytes = engine.stats().store_bytes
    group = engine.store.groups[0]
    assert doc_bytes == 11 * group.block_bytes

    fork_a, fork_b = engine.fork(doc), engine.fork(doc)
    assert engine.stats().store_bytes == doc_bytes  # forking copies nothing
    assert list(engine.generate(fork_a, question_a, max_new_tokens=16, stop=())) == separate_a
    assert list(engine.generate(fork_b, question_b, max_new_tokens=16, stop=())) == separate_b
    # Each fork owns only its own tail: the shared partial block (copied on write) and new blocks.
    tail_a = -(-(len(document) + 20 + 16) // BLOCK_TOKENS) - 10
    tail_b = -(-(len(document) + 30 + 16) // BLOCK_TOKENS) - 10
    assert engine.stats().store_bytes == doc_bytes + (tail_a + tail_b) * group.block_bytes
    # The document itself is untouched by its forks.
    assert list(engine.generate(engine.fork(doc), question_a, max_new_tokens=16, stop=())) == separate_a


def test_shared_blocks_are_freed_only_when_no_context_uses_them(kv_home):
    import gc

    model = tiny_model("gemma3_text")  # sliding-window layers drop blocks too: their counts must hold as well
    engine = Engine.load(model, EngineConfig(home=str(kv_home)))
    document, question = random_prompt(5 * BLOCK_TOKENS + 10, seed=51), random_prompt(70, seed=52)
    expected = list(engine.generate(engine.prefill(document + question), max_new_tokens=6, stop=()))
    gc.collect()
    doc = engine.prefill(document)
    used = engine.stats().store_bytes
    child = engine.fork(doc)
    grandchild = engine.fork(child)
    engine.release(doc)  # the forks still hold the document's blocks
    assert engine.stats().store_bytes == used
    assert list(engine.generate(grandchild, question, max_new_tokens=6, stop=())) == expected
    del child
    gc.collect()
    engine.release(grandchild)
    gc.collect()
    assert engine.stats().store_bytes == 0
    for group in engine.store.groups:
        assert all(count == 0 for count in group.allocator.refcount)
        assert group.allocator.num_free == group.allocator.capacity


def test_sliding_window_layers_keep_only_their_window(kv_home):
    model = tiny_model("gemma3_text")  # layers: sliding(100), full, sliding(100)
    engine = Engine.load(model, EngineConfig(home=str(kv_home)))
    ctx = engine.prefill(random_prompt(40 * BLOCK_TOKENS))
    full, sliding = engine.store.groups
    assert full.window == 0 and sliding.window == 100
    assert full.allocator.num_used == 40
    assert sliding.allocator.num_used <= 100 // BLOCK_TOKENS + 2
    list(engine.generate(ctx, max_new_tokens=200, stop=()))
    assert sliding.allocator.num_used <= 100 // BLOCK_TOKENS + 2


def test_empty_prompt_is_refused(tiny_models, kv_home):
    engine = Engine.load(tiny_models["llama"], EngineConfig(home=str(kv_home)))
    with pytest.raises(ValueError, match="at least one token"):
        engine.prefill([])


def test_context_longer_than_the_limit_names_the_limit(tiny_models, kv_home):
    engine = Engine.load(tiny_models["llama"], EngineConfig(home=str(kv_home), max_context=500))
    with pytest.raises(ContextTooLongError, match="500"):
        engine.prefill(random_prompt(501))
    ctx = engine.prefill(random_prompt(495))
    with pytest.raises(ContextTooLongError, match="500"):
        list(engine.generate(ctx, max_new_tokens=20, stop=()))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, kv_home):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelError) as info:
        Engine.load(str(tmp_path), EngineConfig(home=str(kv_home)))
    message = str(info.value)
    assert "gpt2" in message
    for arch in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text"):
        assert arch in message


def test_unknown_model_and_tiny_pool_are_clear_errors(tiny_models, kv_home, tmp_path):
    with pytest.raises(ModelError, match="unknown model"):
        Engine.load("no-such-model", EngineConfig(home=str(kv_home)))
    with pytest.raises(ModelError, match="does not exist"):
        Engine.load(str(tmp_path / "missing.gguf"), EngineConfig(home=str(kv_home)))
    with pytest.raises(UsageError, match="too small"):
        Engine.load(tiny_models["llama"], EngineConfig(home=str(kv_home), pool_mib=0.001))


def test_saved_hf_folder_loads_like_the_model(tiny_models, kv_home, tmp_path):
    model = tiny_models["qwen3"]
    model.save_pretrained(tmp_path)
    from_folder = Engine.load(str(tmp_path), EngineConfig(home=str(kv_home)))
    from_memory = Engine.load(model, EngineConfig(home=str(kv_home)))
    ids = random_prompt(90)
    assert torch.equal(from_folder.logits(from_folder.prefill(ids)), from_memory.logits(from_memory.prefill(ids)))


def test_sampling_is_reproducible_with_a_seed(tiny_models, kv_home):
    engine = Engine.load(tiny_models["llama"], EngineConfig(home=str(kv_home)))
    ids = random_prompt(50)
    first = list(engine.generate(engine.prefill(ids), max_new_tokens=20, temperature=0.8, top_p=0.9, seed=5, stop=()))
    second = list(engine.generate(engine.prefill(ids), max_new_tokens=20, temperature=0.8, top_p=0.9, seed=5, stop=()))
    greedy = list(engine.generate(engine.prefill(ids), max_new_tokens=20, stop=()))
    assert first == second
    assert first != greedy


def test_score_gives_the_log_probabilities_transformers_gives(tiny_models, kv_home):
    model = tiny_models["qwen3"]
    engine = Engine.load(model, EngineConfig(home=str(kv_home)))
    prompt, continuation = random_prompt(70, seed=41), random_prompt(6, seed=42)
    ctx = engine.prefill(prompt)
    ours = engine.score(engine.fork(ctx), continuation)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    theirs = [float(log_probs[len(prompt) - 1 + i, t]) for i, t in enumerate(continuation)]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    assert len(ctx.tokens) == 70  # the fork took the continuation, the document did not


def test_a_short_prompt_holds_memory_for_its_own_blocks_not_for_a_thousand_tokens(kv_home):
    """A store's arenas are zeroed, so resident, when made: a 100-token prompt and 20 new tokens
    (two blocks) hold at most a few blocks' worth, and a context that grows on keeps few arenas."""
    engine = engine_with_slots(tiny_model("llama"), kv_home, 6, backend="native", kv_path="store")
    ctx = engine.prefill(random_prompt(100, seed=5))
    list(engine.generate(ctx, max_new_tokens=20, stop=()))
    (group,) = engine.store.groups
    assert engine.store.source.ram_bytes <= 4 * group.block_bytes
    list(engine.generate(ctx, max_new_tokens=40 * BLOCK_TOKENS, stop=()))  # 42 blocks in all
    assert len(group.k_arenas[0]) <= 8
    assert engine.store.source.ram_bytes <= 2 * 43 * group.block_bytes


@pytest.mark.parametrize("arch,backend,kv_path", [
    ("llama", "torch", "store"), ("llama", "torch", "pool"), ("llama", "native", "store"), ("llama", "native", "pool"),
    ("gemma3_text", "native", "store"), ("gemma3_text", "torch", "pool"),
])
def test_a_host_budget_far_below_the_kv_gives_the_same_bits(arch, backend, kv_path, kv_home):
    model = tiny_model(arch)
    ids = random_prompt(14 * BLOCK_TOKENS + 17, seed=23)
    in_ram = engine_with_slots(model, kv_home, 6, backend=backend, kv_path=kv_path)
    budget_mib = 0.05  # about two blocks of every layer; the context needs 16
    spilled = engine_with_slots(model, kv_home, 6, backend=backend, kv_path=kv_path, host_mib=budget_mib)
    ram_logits, ram_tokens = run(in_ram, ids, new_tokens=4)
    disk_logits, disk_tokens = run(spilled, ids, new_tokens=4)
    assert disk_tokens == ram_tokens
    assert all(torch.equal(a, b) for a, b in zip(ram_logits, disk_logits))

    ctx = spilled.prefill(ids)
    stats = spilled.stats()
    assert stats.store_disk_bytes > 0.8 * stats.store_bytes
    assert stats.store_ram_bytes <= budget_mib * 2**20
    assert spilled.store.source.ram_bytes <= budget_mib * 2**20  # arenas reserved, not only blocks used
    assert in_ram.stats().store_disk_bytes == 0
    half = Engine.load(model, EngineConfig(home=str(kv_home), backend=backend, kv_path=kv_path,
                                           host_mib=stats.store_bytes / 2 / 2**20))
    half_ctx = half.prefill(ids)
    assert 0.4 < half.stats().store_disk_bytes / half.stats().store_bytes < 0.6  # RAM is filled first
    del half_ctx
    spill_folder = spilled.store.source.folder()
    assert oct(spill_folder.stat().st_mode & 0o777) == oct(0o700)
    assert list(spill_folder.iterdir()) == []  # the files are unlinked once mapped: nothing outlives the process
    del ctx


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_bfloat16_kv_rounds_the_blocks_as_they_are_written_and_halves_their_bytes(backend, kv_home):
    """--kv-dtype bfloat16 with fp32 weights and activations: the first layer's blocks are the fp32
    engine's rounded to bfloat16 (later layers read rounded K/V, so theirs differ by more), the
    store takes half the bytes, the answers stay close, and saved KV of one is never read by the
    other."""
    model, prompt = tiny_model("llama"), random_prompt(3 * BLOCK_TOKENS + 5, seed=3)
    engines = [Engine.load(model, EngineConfig(home=str(kv_home), backend=backend, kv_dtype=kv)) for kv in ("auto", "bfloat16")]
    full, half = engines
    contexts = [engine.prefill(prompt) for engine in engines]
    assert half.store.groups[0].dtype == torch.bfloat16 and full.store.groups[0].dtype == torch.float32
    group = [engine.store.group_of(0) for engine in engines]
    for block_id, half_id in zip(contexts[0].tables[0].ids, contexts[1].tables[0].ids):
        assert torch.equal(group[1].k_block(0, half_id), group[0].k_block(0, block_id).to(torch.bfloat16))
        assert torch.equal(group[1].v_block(0, half_id), group[0].v_block(0, block_id).to(torch.bfloat16))
    assert half.stats().store_bytes * 2 == full.stats().store_bytes
    assert half.kv_bytes_per_token() * 2 == full.kv_bytes_per_token()
    a, b = (engine.logits(ctx) for engine, ctx in zip(engines, contexts))
    assert not torch.equal(a, b) and (a - b).abs().max() <= 0.02 * a.abs().max()
    tokens = [list(engine.generate(ctx, max_new_tokens=6, stop=())) for engine, ctx in zip(engines, contexts)]
    assert tokens[0] == tokens[1]
    assert full.fingerprint != half.fingerprint
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int4")


@pytest.mark.parametrize("backend,kv_path", [("torch", "store"), ("native", "store"), ("native", "pool")])
def test_int8_kv_keeps_each_row_with_its_scale(backend, kv_path, kv_home):
    """--kv-dtype int8: layer 0's blocks are the fp32 engine's rows rounded to int8 with one scale
    each (largest magnitude / 127), kept in the block; the store takes the bytes that says, and the
    answers stay close to fp32's (a small pool: blocks and their scales go through the slots)."""
    from kvpage_cli.engine.kv.store import decode_rows, encode_rows, row_scales

    model, prompt = tiny_model("llama"), random_prompt(3 * BLOCK_TOKENS + 5, seed=3)
    engines = [Engine.load(model, EngineConfig(home=str(kv_home), backend=backend, kv_path=kv_path, pool_mib=0.05,
                                               kv_dtype=kv)) for kv in ("auto", "int8")]
    full, small = engines
    contexts = [engine.prefill(prompt) for engine in engines]
    group = [engine.store.group_of(0) for engine in engines]
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    assert group[1].stored_shape == (heads, BLOCK_TOKENS + BLOCK_TOKENS * 4 // dim, dim)
    for block_id, small_id in zip(contexts[0].tables[0].ids, contexts[1].tables[0].ids):
        for exact, kept in ((group[0].k_block(0, block_id), group[1].k_block(0, small_id)),
                            (group[0].v_block(0, block_id), group[1].v_block(0, small_id))):
            rows, scales = encode_rows(exact)
            filled = exact.abs().amax(dim=(0, 2)) > 0  # the last block's unwritten rows hold nothing
            assert torch.equal(kept[:, :BLOCK_TOKENS][:, filled], rows[:, filled])
            assert torch.equal(row_scales(kept)[:, filled], scales[:, filled])
            assert torch.equal(scales, exact.abs().amax(dim=-1) / 127)
            error = (decode_rows(kept) - exact).abs()[:, filled]
            assert bool((error <= scales[:, filled, None] / 2 * 1.001).all())
    per_token = 2 * model.config.num_hidden_layers * heads * (dim + 4)  # int8 numbers and a float32 scale a row
    assert small.kv_bytes_per_token() == per_token
    assert small.stats().store_bytes * BLOCK_TOKENS * dim * 4 == full.stats().store_bytes * (BLOCK_TOKENS + BLOCK_TOKENS * 4 // dim) * dim
    a, b = (engine.logits(ctx) for engine, ctx in zip(engines, contexts))
    assert not torch.equal(a, b) and (a - b).abs().max() <= 0.03 * a.abs().max()
    tokens = [list(engine.generate(ctx, max_new_tokens=6, stop=())) for engine, ctx in zip(engines, contexts)]
    assert tokens[0] == tokens[1]
    assert full.fingerprint != small.fingerprint


def _native_lib(kv_home):
    """The native kernels; a skip only where there is no C compiler: a compiler whose build fails
    (or a library that does not load) fails the test."""
    from kvpage_cli.engine import native

    if native._compiler() is None:
        pytest.skip("no C compiler here (cc, gcc or clang)")
    try:
        return native.load(kv_home)
    except native.NativeUnavailable as exc:
        pytest.fail(f"the native kernels must build where there is a compiler: {exc}")


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_native_row_writer_stores_the_bits_torch_stores(kind, kv_home):
    """Decode steps and prompt chunks on the native backend write each layer's K/V rows into their
    blocks in one call: every row at its block and offset, and the bits torch's conversion gives
    (bfloat16: to nearest, ties to even, NaN kept; int8: store.encode_rows with its scales)."""
    from kvpage_cli.engine import native
    from kvpage_cli.engine.kv.store import encode_rows, head_addresses, row_scales, stored_block_shape

    lib = _native_lib(kv_home)
    heads, dim, blocks = 2, 64, 5
    dtype = getattr(torch, kind)
    arena = torch.zeros(heads, blocks, *stored_block_shape(heads, dim, dtype)[1:], dtype=dtype)
    rows = torch.randn(7, heads, dim, generator=torch.Generator().manual_seed(5)) * 40
    rows[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3e38])  # bfloat16 ties, near overflow
    if kind != "int8":
        rows[1, 1, 5] = float("nan")
    rows[2, 1] = 0.0  # an int8 row of zeros keeps scale 0
    ids = torch.tensor([4, 4, 0, 2, 2, 1, 3], dtype=torch.int64)
    offsets = torch.tensor([0, 63, 17, 5, 6, 40, 1], dtype=torch.int32)
    native.write_rows(lib, kind, rows, head_addresses(arena, 1), ids, offsets)
    for r in range(rows.shape[0]):
        kept = arena[:, ids[r], offsets[r]]  # [Hkv, D]
        if kind == "int8":
            values, scales = encode_rows(rows[r])
            assert torch.equal(kept, values) and torch.equal(row_scales(arena)[:, ids[r], offsets[r]], scales)
        else:  # NaN stays NaN (torch's own NaN bits differ between its scalar and vector paths)
            nan = rows[r].isnan()
            assert bool(kept[nan].float().isnan().all()) and bool(nan.any()) == (r == 1)
            bits = torch.int16 if kind == "bfloat16" else torch.int32
            assert torch.equal(kept[~nan].view(bits), rows[r][~nan].to(dtype).view(bits))
    written = torch.zeros(heads, blocks, BLOCK_TOKENS, dtype=torch.bool)
    written[:, ids, offsets.long()] = True
    assert not arena[:, :, :BLOCK_TOKENS][~written].any()  # nothing else was touched


def _int8_kv(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V values [2, n, Hkv, 64, D] as int8 blocks with their rows' scales, and those blocks' values."""
    from kvpage_cli.engine.kv.store import decode_rows, encode_rows, row_scales, stored_block_shape

    stored = torch.zeros(*values.shape[:2], *stored_block_shape(values.shape[2], values.shape[-1], torch.int8),
                         dtype=torch.int8)
    rows, scales = encode_rows(values)
    stored[:, :, :, :BLOCK_TOKENS] = rows
    row_scales(stored)[:] = scales
    return stored, decode_rows(stored).contiguous()


@pytest.mark.parametrize("head_dim,group,window", [(64, 3, 0), (64, 3, 70), (16, 2, 0), (128, 1, 0)])
def test_native_kernel_reads_int8_blocks_as_their_decoded_values(head_dim, group, window, kv_home):
    """The native decode kernel over int8 blocks computes what it computes over fp32 blocks holding
    the rows times their scales: the same bits (AVX-512 paths for head sizes 64 and 128, the
    portable path for 16), and what the torch reference computes from those values."""
    from kvpage_cli.engine.attention.backend import DecodePlan, LayerBlocks, NativeBackend, TorchBackend
    from kvpage_cli.engine.kv.store import head_addresses

    lib = _native_lib(kv_home)
    gen = torch.Generator().manual_seed(21)
    num_kv_heads, blocks = 2, 5
    values = torch.randn(2, blocks, num_kv_heads, BLOCK_TOKENS, head_dim, generator=gen)
    values[:, :, :, 7] *= 40  # an outlier row: its own scale, the others unaffected
    stored, decoded = _int8_kv(values)
    lists = [[(0, 0), (1, 1), (2, 2)], [(0, 0), (3, 1), (4, 2), (1, 3)], [(2, 0)]]
    q_pos = [2 * BLOCK_TOKENS + 9, 4 * BLOCK_TOKENS - 1, 30]
    plan = DecodePlan.build([(torch.tensor([b for b, _ in blocks_of], dtype=torch.int32),
                              torch.tensor([p for _, p in blocks_of], dtype=torch.int32)) for blocks_of in lists], q_pos)
    q = torch.randn(len(lists), num_kv_heads * group, head_dim, generator=gen)
    results = []
    for kind, (k, v) in (("int8", stored), ("float32", decoded)):
        backend = NativeBackend(lib, num_kv_heads * group, num_kv_heads, head_dim, head_dim ** -0.5, kind)
        states, lse = backend.states(plan.num_pairs, q.device)
        backend.decode_states(q, plan, LayerBlocks(head_addresses(k, 0), head_addresses(v, 0), None), window, states, lse)
        results.append(backend.merge(states, lse, plan))
    assert torch.equal(results[0], results[1])
    reference = TorchBackend(num_kv_heads * group, num_kv_heads, head_dim, head_dim ** -0.5)
    states, lse = reference.states(plan.num_pairs, q.device)
    reference.decode_states(q, plan, LayerBlocks(None, None, lambda ids: (decoded[0][ids], decoded[1][ids])), window,
                            states, lse)
    # fp32 both ways, summed in different orders; the outlier rows make values up to ~40x larger
    torch.testing.assert_close(results[0], reference.merge(states, lse, plan), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim,group,kind,tiles", [(64, 3, "float32", 0), (64, 3, "int8", 0),
                                                        (128, 8, "bfloat16", 0), (256, 4, "float32", 0),
                                                        (16, 2, "float32", 0), (128, 8, "bfloat16", 1),
                                                        (64, 3, "bfloat16", 1), (64, 3, "bfloat16", 8)])
def test_native_kernel_gives_a_query_the_bits_it_gets_alone_when_others_share_its_blocks(head_dim, group, kind, tiles,
                                                                                        kv_home, request):
    """Queries reading the same blocks are computed in one call (an item: a block and every query
    that reads it, read once for all; where several see the same tokens of it, their rows go through
    it together in the SIMD paths); each query's output is what it gets alone, bit for bit,
    whatever the others see of the block (one inside a block, one past it; with and without a
    window), and what the torch reference computes. On AMX tiles (bfloat16 blocks read by four
    queries or more; the CPU's, or emulated: conftest's tile_library), within 1e-5 of their scale
    of what it gets alone (fp32 products): a block at a time (tiles 1), or up to 8 consecutive
    blocks that the same queries read whole in one pass."""
    from kvpage_cli.engine import native

    lib = request.getfixturevalue("on_tiles") if tiles else _native_lib(kv_home)
    native.prefill_amx(lib, tiles > 0)
    assert native.prefill_amx(lib) == (tiles > 0)
    try:
        _shared_blocks_case(lib, head_dim, group, kind, tiles)
    finally:
        native.prefill_amx(lib, True)


def _shared_blocks_case(lib, head_dim: int, group: int, kind: str, tiles: int) -> None:
    from kvpage_cli.engine.attention.backend import DecodePlan, LayerBlocks, NativeBackend, TorchBackend
    from kvpage_cli.engine.kv.store import head_addresses

    gen = torch.Generator().manual_seed(22)
    num_kv_heads, blocks = 2, 7
    values = torch.randn(2, blocks, num_kv_heads, BLOCK_TOKENS, head_dim, generator=gen)
    if kind == "int8":
        stored, decoded = _int8_kv(values)
    else:
        stored = values.to(getattr(torch, kind)).contiguous()
        decoded = stored.float()
    shared = [(0, 0), (1, 1), (2, 2)]
    # blocks 3 and 4 (at positions 4 and 5) follow each other, read whole by the same four queries
    after = [(3, 4), (4, 5)]
    lists = [shared, shared, shared + [(5, 3)], shared[:2], shared + after, shared + after, shared + after,
             shared + after + [(6, 6)]]
    q_pos = [2 * BLOCK_TOKENS + 9, 2 * BLOCK_TOKENS + 50, 3 * BLOCK_TOKENS + 5, BLOCK_TOKENS + 3,
             6 * BLOCK_TOKENS - 1, 6 * BLOCK_TOKENS + 7, 6 * BLOCK_TOKENS + 30, 6 * BLOCK_TOKENS + 12]
    q = torch.randn(len(lists), num_kv_heads * group, head_dim, generator=gen)
    backend = NativeBackend(lib, num_kv_heads * group, num_kv_heads, head_dim, head_dim ** -0.5, kind)
    blocks_of = LayerBlocks(head_addresses(stored[0], 0), head_addresses(stored[1], 0), None)

    def run(chosen: list[int], window: int) -> torch.Tensor:
        plan = DecodePlan.build([(torch.tensor([b for b, _ in lists[i]], dtype=torch.int32),
                                  torch.tensor([p for _, p in lists[i]], dtype=torch.int32)) for i in chosen],
                                [q_pos[i] for i in chosen])
        states, lse = backend.states(plan.num_pairs, q.device)
        backend.decode_states(q[chosen].contiguous(), plan, blocks_of, window, states, lse, tiles)
        return backend.merge(states, lse, plan), plan

    for window in (0, 70):
        together, plan = run(list(range(len(lists))), window)
        assert plan.num_pairs > len({b for blocks_ in lists for b, _ in blocks_})  # blocks are shared
        differs = []
        for i in range(len(lists)):
            alone = run([i], window)[0][0]
            differs.append(not torch.equal(alone, together[i]))
            if tiles:
                assert (alone - together[i]).abs().max() <= 1e-5 * alone.abs().max(), (window, i)
            else:
                assert torch.equal(alone, together[i]), (window, i)
        assert any(differs) == (tiles > 0)  # on tiles, the blocks four or more read went to them
        reference = TorchBackend(num_kv_heads * group, num_kv_heads, head_dim, head_dim ** -0.5)
        states, lse = reference.states(plan.num_pairs, q.device)
        reference.decode_states(q, plan, LayerBlocks(None, None, lambda ids: (decoded[0][ids], decoded[1][ids])), window,
                                states, lse)
        torch.testing.assert_close(together, reference.merge(states, lse, plan), atol=1e-4, rtol=1e-4)


def _bf16_prefill_or_skip(lib):
    """prefill.c's kernel, where this CPU has AVX512-BF16 (the machines CI and the benchmarks run on
    do; elsewhere the native backend keeps torch's fp32 flash attention, which other tests cover)."""
    from kvpage_cli.engine import native

    if not native.has_bf16_prefill(lib):
        pytest.skip("this CPU has no AVX512-BF16")
    return native.attend_all_bf16


@pytest.fixture(params=["amx", "dot products"])
def prefill_products(request, kv_home):
    """prefill.c's two ways to multiply, and the library that runs them: AMX tiles (the CPU's where
    it has them, the default there; emulated elsewhere: conftest's tile_library) and the
    AVX512-BF16 dot products."""
    from kvpage_cli.engine import native

    amx = request.param == "amx"
    lib = request.getfixturevalue("on_tiles") if amx else _native_lib(kv_home)
    _bf16_prefill_or_skip(lib)
    native.prefill_amx(lib, amx)
    assert native.prefill_amx(lib) == amx
    yield lib
    native.prefill_amx(lib, True)


@pytest.mark.parametrize("head_dim,group,keys,tokens", [(64, 3, 1000, 7), (64, 3, 64, 13), (64, 1, 1, 1),
                                                         (128, 2, 130, 6), (256, 4, 200, 5), (64, 3, 300, 40)])
def test_native_bf16_prefill_agrees_with_fp32_attention_and_gives_each_row_its_own_bits(head_dim, group, keys, tokens,
                                                                                         kv_home, prefill_products):
    """prefill.c's attention of query rows over bfloat16 keys and values (Q written as three
    bfloat16 terms, the probabilities as two), on AMX tiles of 16 rows and with dot products of 6,
    is fp32 attention to 1e-5 of the outputs' scale: every key visible, causal (the last `tokens`
    keys are the rows' own tokens), and causal within a window; on keys that are not a
    whole number of 64-key chunks, read in place from a wider buffer (the store's layout). Each
    row's output is the one it gets alone, and keys split into several runs give the same bits."""
    lib = prefill_products
    attend = _bf16_prefill_or_skip(lib)
    gen = torch.Generator().manual_seed(31)
    num_kv_heads = 2
    buffer = (torch.randn(2, num_kv_heads, keys + 40, head_dim, generator=gen) * 3).bfloat16()
    buffer[:, :, 5] *= 8  # a key and a value far larger than the others (an attention sink's)
    k, v = buffer[0, :, 10:10 + keys], buffer[1, :, 10:10 + keys]
    rows = tokens * group
    qh = torch.randn(num_kv_heads, rows, head_dim, generator=gen) * 2
    scale = head_dim ** -0.5
    logits = (qh.double() @ k.double().transpose(1, 2)) * scale
    start = max(keys - tokens, 0)  # causal: row r (token r // group) at position start + r // group
    own = start + torch.arange(rows)[:, None] // group
    window = max(keys // 3, 2)
    hidden = torch.arange(keys)[None, :] > own
    outside = hidden | (torch.arange(keys)[None, :] <= own - window)
    for causal, win, masked in ((None, 0, logits), (start, 0, logits.masked_fill(hidden, float("-inf"))),
                                (start, window, logits.masked_fill(outside, float("-inf")))):
        out, lse = attend(lib, qh, [(k, v)], scale, causal, group, win)
        truth = torch.softmax(masked, -1) @ v.double()
        assert (out.double() - truth).abs().max() <= 1e-5 * truth.abs().max(), (causal, win)  # 3.9e-6 measured
        assert (lse.double() - torch.logsumexp(masked, -1)).abs().max() <= 5e-6 * logits.abs().max(), (causal, win)
        cut = keys // 3
        split = attend(lib, qh, [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])], scale, causal, group, win)
        assert torch.equal(split[0], out) and torch.equal(split[1], lse)
        for r in (0, rows // 2, rows - 1):
            token = r // group  # alone: the token's rows, at its own position
            alone, alone_lse = attend(lib, qh[:, token * group:(token + 1) * group], [(k, v)], scale,
                                      None if causal is None else causal + token, group, win)
            assert torch.equal(alone[:, r % group], out[:, r]) and torch.equal(alone_lse[:, r % group], lse[:, r])


def test_native_store_prefill_over_bf16_kv_agrees_with_the_torch_backend(kv_home):
    """A chunk's prefill over bfloat16 KV read in place from two runs of blocks (a fork's: the
    document's blocks, then its own), through prefill.c in one causal call, with and without a
    window, is the torch backend's fp32 result to 1e-4, and the fp32-KV native backend still runs
    torch's kernel."""
    from kvpage_cli.engine.attention.backend import NativeBackend, TorchBackend

    lib = _native_lib(kv_home)
    _bf16_prefill_or_skip(lib)
    gen = torch.Generator().manual_seed(32)
    num_kv_heads, group, head_dim, blocks, q_start, tokens = 3, 3, 64, 6, 300, 40
    kv = torch.randn(2, num_kv_heads, blocks * BLOCK_TOKENS, head_dim, generator=gen).bfloat16()
    runs = [(kv[0, :, :4 * BLOCK_TOKENS], kv[1, :, :4 * BLOCK_TOKENS], 0),
            (kv[0, :, 4 * BLOCK_TOKENS:], kv[1, :, 4 * BLOCK_TOKENS:], 4)]
    q = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen) * 2
    args = (num_kv_heads * group, num_kv_heads, head_dim, head_dim ** -0.5)
    native_bf16 = NativeBackend(lib, *args, "bfloat16")
    calls = []
    native_bf16.attend_all = lambda *a: calls.append(a[2:]) or NativeBackend.attend_all(native_bf16, *a)
    torch_backend = TorchBackend(*args)
    for window in (0, 200):
        calls.clear()
        got = native_bf16.store_prefill(q, q_start, runs, window)
        assert calls == [(q_start, group, window)], "prefill.c was not used"
        torch.testing.assert_close(got, torch_backend.store_prefill(q, q_start, runs, window), atol=1e-4, rtol=1e-4)
    later = [(k[:, BLOCK_TOKENS:], v[:, BLOCK_TOKENS:], 1) for k, v, _ in runs[:1]] + runs[1:]  # a window layer's runs
    calls.clear()
    got = native_bf16.store_prefill(q, q_start, later, 200)
    assert calls == [(q_start - BLOCK_TOKENS, group, 200)]
    torch.testing.assert_close(got, torch_backend.store_prefill(q, q_start, later, 200), atol=1e-4, rtol=1e-4)
    assert NativeBackend(lib, *args, "float32").attend_all(q[None, :, 0].contiguous(), [(kv[0], kv[1])], None, 1) is None


@pytest.mark.parametrize("double_buffered", [False, True])
def test_streaming_forks_copy_only_the_blocks_past_the_schedules_prefix(double_buffered, kv_home):
    """A document longer than the pool, read by 6 forks at once: with the pass schedule each
    decode step copies only the 14 blocks a layer streams past its resident prefix of 12, where the
    least-recently-used pool copies 20 of the 26 (a cyclic scan evicts what the next step reads first);
    the tokens are the same, and the same as reading the store in place. The ring read in halves
    (a GPU's copy stream fills one while the other is read) copies the same blocks."""
    from kvpage_cli.engine.events import BlocksMoved, StepDone
    from kvpage_cli.engine.scheduler import Request

    model = tiny_model("llama")
    document = random_prompt(20 * BLOCK_TOKENS, seed=61)  # 20 full blocks
    questions = [random_prompt(3, seed=70 + i) for i in range(6)]

    def decode(engine):
        doc = engine.prefill(document)
        asked = [engine.append(engine.fork(doc), q) for q in questions]  # each a tail block of its own
        requests = [Request(ctx, [], max_new_tokens=6, stop=()) for ctx in asked]
        copies = [0]  # blocks copied into the pool, per step

        def count(event):
            if isinstance(event, BlocksMoved):
                copies[-1] += event.blocks
            elif isinstance(event, StepDone):
                copies.append(0)

        tokens = {i: [] for i in range(len(requests))}
        for request, token in engine.run(requests, on_event=count):
            tokens[requests.index(request)].append(token)
        return tokens, copies[:-1]

    scheduled = engine_with_slots(model, kv_home, 16, backend="native", kv_path="pool")
    scheduled.dispatch.double_buffered = double_buffered
    lru = engine_with_slots(model, kv_home, 16, backend="native", kv_path="pool")
    lru.dispatch.stream_schedule = False
    in_place = Engine.load(model, EngineConfig(home=str(kv_home), backend="native", kv_path="store"))
    ours, our_copies = decode(scheduled)
    theirs, their_copies = decode(lru)
    assert ours == theirs == decode(in_place)[0]
    layers = model.config.num_hidden_layers
    # 26 blocks a step (20 shared, 6 tails) through 16 slots, a prefix of 12: 14 stream, per layer
    assert len(our_copies) == len(their_copies) == 5  # the first token came with the question's logits
    assert all(n == 14 * layers for n in our_copies), our_copies  # the prefix stayed from the questions' pass
    assert all(n >= 20 * layers for n in their_copies[1:]), their_copies


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_double_buffered_ring_copies_the_next_pass_before_this_one_is_read(backend, kv_home):
    """Streaming with the ring in halves: each pass's blocks are copied together, and the next
    pass's copies start before this pass is read (on a GPU they then run while it is read), never
    into a slot a pass still to be read holds; the logits are the bits of a pool holding every block."""
    model = tiny_model("llama")
    ids = random_prompt(22 * BLOCK_TOKENS + 17, seed=21)
    engine = engine_with_slots(model, kv_home, 8, backend=backend, kv_path="pool")
    engine.dispatch.double_buffered = True
    log = []
    pool, dispatch_backend = engine.pool, engine.dispatch.backend
    load_batch, decode_states, pool_prefill = pool.load_batch, dispatch_backend.decode_states, dispatch_backend.pool_prefill

    def logged_load(layer, blocks, slots, stacked):
        log.append(("load", layer, tuple(slots)))
        return load_batch(layer, blocks, slots, stacked)

    def logged_decode(q, part, blocks, *args, **kwargs):
        log.append(("read", None, tuple(part.item_ids.tolist())))
        return decode_states(q, part, blocks, *args, **kwargs)

    def logged_prefill(q, q_start, blocks, passes, window):
        def each():
            for slots, positions in passes:
                log.append(("read", None, tuple(slots)))
                yield slots, positions
        return pool_prefill(q, q_start, blocks, each(), window)

    pool.load_batch, dispatch_backend.decode_states, dispatch_backend.pool_prefill = logged_load, logged_decode, logged_prefill
    logits, tokens = run(engine, ids)
    full = engine_with_slots(model, kv_home, 32, backend=backend, kv_path="pool")
    full_logits, full_tokens = run(full, ids)
    assert tokens == full_tokens and all(torch.equal(a, b) for a, b in zip(logits, full_logits))
    unread: set[int] = set()  # slots loaded and not read since
    for index, (kind, _, slots) in enumerate(log):
        if kind == "load":
            assert unread.isdisjoint(slots), f"entry {index}: a load over slots a pass still has to read"
            unread.update(slots)
        else:
            unread.difference_update(slots)
    loads = sum(1 for kind, _, _ in log if kind == "load")
    started_ahead = sum(1 for a, b in zip(log, log[1:]) if a[0] == b[0] == "load")  # the next pass's, before this read
    assert loads > 2 * engine.spec.num_layers  # streamed: several passes a layer
    assert started_ahead > engine.spec.num_layers


def test_the_default_pool_is_a_cpus_64_mib_and_a_quarter_of_a_gpus_free_memory(monkeypatch, kv_home):
    """A GPU's pool holds what a long document's steps read (they stay on the device), no more than
    a full batch of the longest context; a CPU's attention reads blocks where they lie. Asked for no
    pool size, the engine sizes it by device."""
    from kvpage_cli.engine.engine import default_pool_mib

    most = 2**40  # the KV the engine's steps could read at once: here more than any card holds
    assert default_pool_mib(torch.device("cpu"), most) == 64.0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    assert default_pool_mib(torch.device("cuda"), most) == 10 * 1024.0
    assert default_pool_mib(torch.device("cuda"), 3 * 2**30) == 3 * 1024.0  # no more than the steps can read
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**20, 80 * 2**30))
    assert default_pool_mib(torch.device("cuda"), most) == 64.0  # never less than a CPU's
    engine = Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home)))
    assert engine.pool.num_slots == int(64 * 2**20) // (engine.spec.num_layers * engine.pool.slot_bytes)
