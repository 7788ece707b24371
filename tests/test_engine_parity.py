"""kvpage's paged engine against transformers itself, on tiny random models of every architecture."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import Engine, EngineConfig

from .conftest import TINY_ARCHS, random_prompt, tiny_model

TOLERANCE = 1e-4  # fp32, max abs, on logits of order 1-10


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        batch = torch.tensor([ids])
        return model(batch, attention_mask=torch.ones_like(batch)).logits[0].float()


def hf_greedy(model, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        batch = torch.tensor([ids])
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=count, min_new_tokens=count,
                             do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def load(model, kv_home, **config) -> Engine:
    config.setdefault("pool_mib", 1.0)
    return Engine.load(model, EngineConfig(home=str(kv_home), **config))


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_logits_match_transformers(arch, backend, tiny_models, kv_home):
    model = tiny_models[arch]
    engine = load(model, kv_home, backend=backend, prefill_chunk=128)
    for length in (1, 63, 64, 65, 700):
        ids = random_prompt(length, seed=length)
        ctx = engine.prefill(ids)
        ours = engine.logits(ctx)
        theirs = hf_logits(model, ids)[-1]
        assert theirs.abs().max() > 1.0, "the test model's logits are too small to mean anything"
        assert (ours - theirs).abs().max().item() < TOLERANCE, (arch, length)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_every_position_matches_when_fed_token_by_token(arch, tiny_models, kv_home):
    """Decode steps (one token each) give the logits transformers gives at every position."""
    model = tiny_models[arch]
    engine = load(model, kv_home, prefill_chunk=64)
    ids = random_prompt(150, seed=7)
    reference = hf_logits(model, ids)
    ctx = engine.prefill(ids[:100])
    assert (engine.logits(ctx) - reference[99]).abs().max().item() < TOLERANCE
    for i in range(100, 150):
        list(engine.generate(ctx, [ids[i]], max_new_tokens=0))
        assert (engine.logits(ctx) - reference[i]).abs().max().item() < TOLERANCE, (arch, i)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
@pytest.mark.parametrize("chunk", [128, 256])
def test_greedy_tokens_match_transformers(arch, chunk, tiny_models, kv_home):
    model = tiny_models[arch]
    engine = load(model, kv_home, prefill_chunk=chunk)
    ids = random_prompt(700, seed=3)  # past the sliding window (100) of mistral and gemma3
    ctx = engine.prefill(ids)
    ours = list(engine.generate(ctx, max_new_tokens=32, stop=()))
    assert ours == hf_greedy(model, ids, 32)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_variants(rope, kv_home):
    model = tiny_model("llama", rope_parameters={"rope_theta": 10000.0, **rope})
    engine = load(model, kv_home)
    ids = random_prompt(300, seed=5)
    assert (engine.logits(engine.prefill(ids)) - hf_logits(model, ids)[-1]).abs().max().item() < TOLERANCE


def test_qwen2_with_sliding_window_layers(kv_home):
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=80, max_window_layers=1,
                       layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    engine = load(model, kv_home)
    ids = random_prompt(400, seed=9)
    assert (engine.logits(engine.prefill(ids)) - hf_logits(model, ids)[-1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_bfloat16_is_close_to_transformers(arch, kv_home):
    model = tiny_model(arch).to(torch.bfloat16)
    engine = load(model, kv_home, dtype="bfloat16")
    ids = random_prompt(200, seed=11)
    ours = engine.logits(engine.prefill(ids))
    theirs = hf_logits(model, ids)[-1]
    # bf16 keeps 8 bits of mantissa; kvpage accumulates attention in fp32, transformers does not.
    assert (ours - theirs).abs().max().item() < 0.15
    assert torch.argmax(ours) == torch.argmax(theirs)
