"""A baked block moves from position p to q by a rotation of its K rows: the same as baking it at q,
within the rounding of fp32 angles (3e-7 x position x |k|)."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine.model.rope import apply_rope, rope_cos_sin, rope_params_from_config, rotate

from .conftest import tiny_config

VARIANTS = {
    "default": ("llama", {}),
    "linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}),
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),
    "gemma3 per layer type": ("gemma3_text", {"rope_local_base_freq": 10000.0, "rope_theta": 1000000.0}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_block_moved_from_p_to_q_equals_the_block_baked_at_q(variant):
    arch, overrides = VARIANTS[variant]
    config = tiny_config(arch, head_dim=64, **overrides)
    keys = {"sliding_attention", "full_attention"} if arch == "gemma3_text" else {"default"}
    params = rope_params_from_config(config, arch, keys)
    torch.manual_seed(0)
    k = torch.randn(64, 2, 64)  # one block: [T, Hkv, D], not rotated
    for key, rope in params.items():
        for p, q in ((0, 3000), (5120, 64), (128, 128), (700, 4000)):
            at_p = apply_rope(k, *rope_cos_sin(rope, torch.arange(p, p + 64), torch.float32))
            at_q = apply_rope(k, *rope_cos_sin(rope, torch.arange(q, q + 64), torch.float32))
            moved = rotate(at_p.transpose(0, 1), torch.full((64,), q - p), rope).transpose(0, 1)  # [Hkv, T, D] rows
            # fp32 angles: cos/sin of an angle near q carry ~1e-7 * q of rounding, in the bake at p, in the
            # move and in the bake at q alike (transformers' own RoPE has it too)
            tolerance = 3e-7 * (p + q + 64) * at_q.abs().max() + 1e-6
            assert (moved - at_q).abs().max() <= tolerance, (variant, key, p, q)


def test_a_move_in_bfloat16_is_within_its_rounding():
    config = tiny_config("llama", head_dim=64)
    rope = rope_params_from_config(config, "llama", {"default"})["default"]
    k = torch.randn(64, 2, 64)
    at_p = apply_rope(k, *rope_cos_sin(rope, torch.arange(100, 164), torch.float32))
    at_q = apply_rope(k, *rope_cos_sin(rope, torch.arange(2100, 2164), torch.float32))
    moved = rotate(at_p.to(torch.bfloat16).transpose(0, 1), torch.full((64,), 2000), rope).transpose(0, 1)
    assert moved.dtype == torch.bfloat16
    torch.testing.assert_close(moved.float(), at_q, rtol=2e-2, atol=2e-2)


def test_rope_tables_kept_in_the_home_are_read_back_bit_for_bit(tmp_path):
    """The first load computes the tables with the model's own rotary module and keeps them; later
    loads read the same bits, a damaged file is computed again, another config gets its own."""
    config = tiny_config("gemma3_text", head_dim=64, rope_local_base_freq=10000.0, rope_theta=1000000.0)
    keys = {"sliding_attention", "full_attention"}
    computed = rope_params_from_config(config, "gemma3_text", keys)
    first = rope_params_from_config(config, "gemma3_text", keys, tmp_path)
    [kept] = list((tmp_path / "rope").iterdir())
    again = rope_params_from_config(config, "gemma3_text", keys, tmp_path)
    for params in (first, again):
        assert params.keys() == computed.keys()
        for key, rope in params.items():
            assert torch.equal(rope.inv_freq, computed[key].inv_freq) and rope.inv_freq.dtype == torch.float32
            assert rope.attention_scaling == computed[key].attention_scaling
    assert not torch.equal(again["full_attention"].inv_freq, again["sliding_attention"].inv_freq)
    kept.write_text('{"full_attention": {"inv_freq": [1.0')  # cut short
    repaired = rope_params_from_config(config, "gemma3_text", keys, tmp_path)
    assert torch.equal(repaired["full_attention"].inv_freq, computed["full_attention"].inv_freq)
    other = tiny_config("gemma3_text", head_dim=64, rope_local_base_freq=10000.0, rope_theta=500000.0)
    moved = rope_params_from_config(other, "gemma3_text", keys, tmp_path)
    assert not torch.equal(moved["full_attention"].inv_freq, computed["full_attention"].inv_freq)
    assert len(list((tmp_path / "rope").iterdir())) == 2
