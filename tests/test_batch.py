"""Batched steps: many contexts in one forward pass give each the results it gets alone."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig
from kvpage_cli.engine.engine import Request

from .conftest import random_prompt, tiny_model

QUESTIONS = [random_prompt(n, seed=70 + n) for n in (1, 5, 30, 64, 65, 140)]  # lengths around block edges


def load(model, kv_home, **config) -> Engine:
    return Engine.load(model, EngineConfig(home=str(kv_home), **config))


def one_at_a_time(engine: Engine, doc, questions, new_tokens, **request) -> tuple[list[list[int]], list[torch.Tensor]]:
    tokens, logits = [], []
    for question, count in zip(questions, new_tokens):
        ctx = engine.fork(doc)
        tokens.append(list(engine.generate(ctx, question, max_new_tokens=count, stop=(), **request)))
        logits.append(engine.logits(ctx).clone())  # after the last token: one more step, alone
    return tokens, logits


def batched(engine: Engine, doc, questions, new_tokens, max_batch: int, **request):
    requests = [Request(engine.fork(doc), list(q), count, stop=(), **request) for q, count in zip(questions, new_tokens)]
    order = []
    for r, token in engine.run(requests, max_batch=max_batch):
        order.append(requests.index(r))
    ctxs = [r.ctx for r in requests]
    engine.append_many(ctxs, [[] for _ in ctxs], max_batch=max_batch)  # the last tokens, together
    return [r.generated for r in requests], [c.last_logits.clone() for c in ctxs], order


@pytest.fixture(params=[None, 16], ids=["default-threads", "16-threads"])
def threads(request):
    """torch's thread count for a test: its default, or 16 (a many-core host's, whatever this one has)."""
    before = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mistral"])
@pytest.mark.parametrize("kv_path", ["store", "pool"])
def test_a_batch_gives_every_sequence_the_bits_it_gets_alone(arch, kv_path, threads, kv_home):
    model = tiny_model(arch)  # gemma3_text and mistral have sliding-window layers (window 100)
    engine = load(model, kv_home, backend="native", kv_path=kv_path, pool_mib=0.2)
    doc = engine.prefill(random_prompt(5 * BLOCK_TOKENS + 21, seed=3))
    new_tokens = [9, 1, 4, 12, 2, 7]
    alone_tokens, alone_logits = one_at_a_time(engine, doc, QUESTIONS, new_tokens)
    tokens, logits, order = batched(engine, doc, QUESTIONS, new_tokens, max_batch=4)
    assert tokens == alone_tokens
    for a, b in zip(alone_logits, logits):
        assert torch.equal(a, b)
    # continuous: with 4 at a time the short ones finish and the last two join before the long ones end
    assert order.index(5) < max(i for i, q in enumerate(order) if q == 3)


@pytest.fixture(params=[False, True], ids=["dot-products", "amx-tiles"])
def attention_tiles(request, kv_home):
    """The native attention's two ways over bfloat16 KV: AVX512-BF16 dot products (prefill) and fp32
    products (decode) everywhere, or AMX tiles (the CPU's, or emulated: conftest's tile_library)."""
    from kvpage_cli.engine import native

    lib = request.getfixturevalue("on_tiles") if request.param else native.load(kv_home)
    native.prefill_amx(lib, request.param)
    assert native.prefill_amx(lib) == request.param
    yield request.param
    native.prefill_amx(lib, True)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_batch_over_bfloat16_kv_gives_every_sequence_the_bits_it_gets_alone(arch, attention_tiles, kv_home,
                                                                             monkeypatch):
    """The prompt attention of prefill.c (bfloat16 KV, head dim 64; gemma3_text's window layers
    too) keeps the batch's bit-identity: the same tokens and the same logits, bit for bit. On AMX
    tiles, a block that four sequences of the batch read is attended on tiles and alone it is
    not: the same tokens, logits within 1e-4 of their scale."""
    from kvpage_cli.engine import native

    real, used = native.attend_all_bf16, []

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        used.append(result is not None)
        return result

    monkeypatch.setattr(native, "attend_all_bf16", counted)
    engine = load(tiny_model(arch, head_dim=64), kv_home, backend="native", kv_path="store", kv_dtype="bfloat16")
    doc = engine.prefill(random_prompt(5 * BLOCK_TOKENS + 21, seed=3))
    if not any(used):
        pytest.skip("this CPU has no AVX512-BF16: prefill.c does not run")
    new_tokens = [9, 1, 4, 12, 2, 7]
    alone_tokens, alone_logits = one_at_a_time(engine, doc, QUESTIONS, new_tokens)
    used.clear()
    tokens, logits, _ = batched(engine, doc, QUESTIONS, new_tokens, max_batch=4)
    assert all(used) and len(used) >= (len(QUESTIONS) - 1) * engine.spec.num_layers  # a 1-token prompt is a decode step
    assert tokens == alone_tokens
    for a, b in zip(alone_logits, logits):
        if attention_tiles:
            assert (a - b).abs().max() <= 1e-4 * a.abs().max()
        else:
            assert torch.equal(a, b)
    if attention_tiles:  # blocks four sequences shared did go to tiles
        assert any(not torch.equal(a, b) for a, b in zip(alone_logits, logits))


def test_sequences_that_end_at_once_or_only_append_leave_the_batch(kv_home):
    engine = load(tiny_model("llama"), kv_home, backend="native")
    doc = engine.prefill(random_prompt(200, seed=4))
    alone = engine.fork(doc)
    first = list(engine.generate(alone, [7, 8], max_new_tokens=1, stop=()))
    requests = [
        Request(engine.fork(doc), [7, 8], 1, stop=()),  # one token: done right after its prompt
        Request(engine.fork(doc), [9], 0),  # append only
        Request(engine.fork(doc), [], 3, stop=()),  # nothing to append: decodes from the document's logits
        Request(engine.fork(doc), [7, 8], 5, stop=first),  # stops at its first token
    ]
    results = list(engine.run(requests, max_batch=8))
    assert [r.generated for r in requests] == [first, [], requests[2].generated, first]
    assert len(requests[2].generated) == 3 and all(r.done for r in requests)
    assert requests[1].ctx.num_cached == 201 and len(results) == 1 + 3 + 1


def test_score_many_equals_score_one_by_one(kv_home):
    engine = load(tiny_model("qwen3"), kv_home, backend="native")
    doc = engine.prefill(random_prompt(300, seed=5))
    options = [random_prompt(n, seed=80 + n) for n in (1, 2, 3, 70)]
    alone = [engine.score(engine.fork(doc), option) for option in options]
    together = engine.score_many([(engine.fork(doc), option) for option in options])
    assert together == alone


def test_forks_in_a_batch_hold_the_document_once(kv_home):
    model = tiny_model("llama")
    engine = load(model, kv_home, backend="native")
    doc = engine.prefill(random_prompt(20 * BLOCK_TOKENS, seed=6))
    before = engine.store.bytes_used
    requests = [Request(engine.fork(doc), random_prompt(10, seed=90 + i), 20, stop=()) for i in range(16)]
    list(engine.run(requests, max_batch=16))
    grown = engine.store.bytes_used - before
    per_block = sum(g.block_bytes for g in engine.store.groups)
    assert grown == 16 * per_block  # each fork's own 30 tokens fit in one new block; the document's 20 are shared


@pytest.mark.parametrize("policy,kv_dtype", [("quest", "float32"), ("scores", "float32"), ("draft", "float32"),
                                             ("draft", "bfloat16")])
def test_selective_mode_in_a_batch_chooses_per_sequence(policy, kv_dtype, kv_home, request):
    """Each sequence of a batch selects its own blocks, as it does alone: the same tokens. With
    bfloat16 KV (head dim 64) on AMX tiles (the CPU's, or emulated), blocks four sequences share go
    to tiles, each block's own state still (the draft policy reads each block's attention)."""
    if kv_dtype == "bfloat16":
        request.getfixturevalue("tiles_if_any")
    model = tiny_model("llama", head_dim=64) if kv_dtype == "bfloat16" else tiny_model("llama")
    cfg = model.config
    slot_bytes = 2 * cfg.num_key_value_heads * BLOCK_TOKENS * cfg.head_dim * 4
    engine = load(model, kv_home, backend="native", mode="selective", policy=policy, draft_layers=1,
                  kv_dtype=kv_dtype, pool_mib=6 * cfg.num_hidden_layers * slot_bytes / 2**20)
    doc = engine.prefill(random_prompt(24 * BLOCK_TOKENS, seed=7))
    questions = QUESTIONS[:4]
    new_tokens = [6, 3, 8, 5]
    alone_tokens, _ = one_at_a_time(engine, doc, questions, new_tokens)
    tokens, _, _ = batched(engine, doc, questions, new_tokens, max_batch=4)
    assert tokens == alone_tokens
    assert engine.stats().blocks_attended < engine.stats().blocks_candidate  # it did select


def test_the_torch_backend_batches_within_tolerance(kv_home):
    engine = load(tiny_model("llama"), kv_home, backend="torch")
    doc = engine.prefill(random_prompt(3 * BLOCK_TOKENS, seed=8))
    new_tokens = [5, 5, 5]
    alone_tokens, alone_logits = one_at_a_time(engine, doc, QUESTIONS[:3], new_tokens)
    tokens, logits, _ = batched(engine, doc, QUESTIONS[:3], new_tokens, max_batch=3)
    assert tokens == alone_tokens
    for a, b in zip(alone_logits, logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_pooled_values_are_the_layers_value_vectors_of_the_appended_tokens(kv_home):
    """Engine.pooled_values: per layer, the mean of v_proj(input_layernorm(h)) over the tokens
    appended, as transformers computes them, batched or one at a time (the same bits: the native
    CPU kernels; on a GPU, where a 16-wide head runs the torch backend, BLAS's blocking by rows
    changes them)."""
    model = tiny_model("llama")
    engine = load(model, kv_home, backend="native")
    prompt, texts = random_prompt(70, seed=3), [random_prompt(n, seed=90 + n) for n in (1, 33, 80)]
    doc = engine.prefill(prompt)
    together = engine.pooled_values([(engine.fork(doc), t) for t in texts])
    alone = [engine.pooled_values([(engine.fork(doc), t)], max_batch=1)[0] for t in texts]
    for text, pooled, single in zip(texts, together, alone):
        assert torch.equal(pooled, single)
        with torch.no_grad():
            out = model(torch.tensor([prompt + text]), output_hidden_states=True)
            expected = torch.stack([
                layer.self_attn.v_proj(layer.input_layernorm(out.hidden_states[i]))[0, len(prompt):].mean(0)
                for i, layer in enumerate(model.model.layers)])
        assert pooled.shape == expected.shape
        assert torch.allclose(pooled, expected, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_mlp_activation_gives_each_row_its_bits_alone_at_any_thread_count(activation, threads):
    """Forty rows of a 2,048-wide gate at 16 threads: torch's own SiLU splits them at element
    counts, and a row cut there rounds its last elements otherwise; the runner's does not."""
    from types import SimpleNamespace

    from kvpage_cli.engine.model.runner import ModelRunner, Rows

    runner = SimpleNamespace(spec=SimpleNamespace(activation=activation))
    gate = torch.randn(40, 2 * 2048, generator=torch.Generator().manual_seed(4))[:, :2048]  # a view, as in mlp
    together = ModelRunner.activation(runner, gate, Rows.of([1] * 40))
    alone = torch.cat([ModelRunner.activation(runner, gate[i:i + 1], Rows.of([1])) for i in range(40)])
    assert torch.equal(together, alone)
