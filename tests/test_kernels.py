"""Kernels against their fp32 torch references, and the references against torch SDPA / HF RoPE.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (small shapes). Tolerances:
fp32 1e-5 abs+rel on outputs of order 1 (the kernel and the reference differ only in summation
order and exp2 vs exp); bf16 2e-2 (on CUDA the kernel rounds the softmax probabilities to bf16
before the P @ V product, as FlashAttention does; the inputs themselves are exact in fp32).
"""

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import kvpage_kernels as kk  # noqa: E402
from kvpage_kernels import BLOCK_TOKENS  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
NAN = float("nan")


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def cdiv(a, b):
    return -(-a // b)


def build_context(lengths, num_kv_heads, head_dim, dtype, device, *, num_invalid=3, seed=0,
                  head_major=False):
    """Sequences of `lengths` tokens whose blocks are shuffled across a pool.

    `num_invalid` slots, scattered at random, are invalid and hold NaN; each sequence's block list
    also names one of them (at a random place, repeating a real block position) so a kernel that
    read it would return NaN. Lists are padded with slot -1.
    """
    g = torch.Generator().manual_seed(seed)
    num_blocks = [cdiv(n, BLOCK_TOKENS) for n in lengths]
    num_slots = sum(num_blocks) + num_invalid
    shape = (num_slots, num_kv_heads, BLOCK_TOKENS, head_dim)
    if head_major:
        # the engine's head-major buffer [Hkv, S*64, D] seen as [S, Hkv, 64, D]
        def make():
            buf = torch.randn(num_kv_heads, num_slots * BLOCK_TOKENS, head_dim, generator=g)
            return buf.view(num_kv_heads, num_slots, BLOCK_TOKENS, head_dim).permute(1, 0, 2, 3)
    else:
        def make():
            return torch.randn(shape, generator=g)
    k_pool, v_pool = make(), make()
    order = torch.randperm(num_slots, generator=g)
    invalid, data = order[:num_invalid], order[num_invalid:].tolist()
    k_pool[invalid] = NAN
    v_pool[invalid] = NAN
    valid = torch.ones(num_slots, dtype=torch.int8)
    valid[invalid] = 0

    num_entries = max(num_blocks) + (1 if num_invalid else 0)
    slot_ids = torch.full((len(lengths), num_entries), -1, dtype=torch.int32)
    block_pos = torch.zeros((len(lengths), num_entries), dtype=torch.int32)
    for b, n in enumerate(num_blocks):
        slots = [data.pop() for _ in range(n)]
        positions = list(range(n))
        if num_invalid:
            at = int(torch.randint(0, n + 1, (1,), generator=g))
            slots.insert(at, int(invalid[b % num_invalid]))
            positions.insert(at, min(at, n - 1))
        slot_ids[b, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        block_pos[b, : len(positions)] = torch.tensor(positions, dtype=torch.int32)
    to = dict(device=device)
    return dict(
        k_pool=k_pool.to(dtype=dtype, **to),
        v_pool=v_pool.to(dtype=dtype, **to),
        valid=valid.to(**to),
        slot_ids=slot_ids.to(**to),
        block_pos=block_pos.to(**to),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
    )


def contiguous_kv(ctx, b, length):
    """Logical K, V of sequence b read straight from its valid blocks: [Hkv, length, D] fp32."""
    ks, vs = [], []
    for slot, pos in zip(ctx["slot_ids"][b].tolist(), ctx["block_pos"][b].tolist()):
        if slot >= 0 and ctx["valid"][slot]:
            ks.append((pos, ctx["k_pool"][slot].float()))
            vs.append((pos, ctx["v_pool"][slot].float()))
    k = torch.cat([t for _, t in sorted(ks, key=lambda x: x[0])], dim=1)
    v = torch.cat([t for _, t in sorted(vs, key=lambda x: x[0])], dim=1)
    return k[:, :length], v[:, :length]


def sdpa(q, k, v, q_pos, scale, window):
    """torch SDPA with GQA and causal/window mask. q: [T, Hq, D], k, v: [Hkv, N, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    k_pos = torch.arange(k.shape[1], device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None].long()
    if window > 0:
        mask &= k_pos[None, :] > q_pos[:, None].long() - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )  # [Hq, T, D]
    return out.transpose(0, 1)


def decode_inputs(ctx, num_q_heads, head_dim, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(ctx["seq_lens"]), num_q_heads, head_dim, generator=g)
    return q.to(device=device, dtype=dtype)


def decode_args(ctx):
    return (ctx["k_pool"], ctx["v_pool"], ctx["valid"], ctx["slot_ids"], ctx["block_pos"], ctx["seq_lens"])


def prefill_args(ctx):
    return (ctx["k_pool"], ctx["v_pool"], ctx["valid"], ctx["slot_ids"][0], ctx["block_pos"][0])


LENGTHS = [1, 63, 64, 65, 449]  # 449 ends one token into its 8th block


# ---------------------------------------------------------------- references vs torch SDPA


@pytest.mark.parametrize("window", [0, 70])
def test_reference_decode_matches_sdpa(window):
    ctx = build_context(LENGTHS, 2, 64, torch.float32, "cpu")
    q = decode_inputs(ctx, 6, 64, torch.float32, "cpu")
    out, lse = kk.paged_decode_attention_ref(q, *decode_args(ctx), scale=0.125, window=window, num_splits=1)
    for b, length in enumerate(LENGTHS):
        k, v = contiguous_kv(ctx, b, length)
        expected = sdpa(q[b : b + 1], k, v, torch.tensor([length - 1]), 0.125, window)
        torch.testing.assert_close(out[b, 0], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 100])
def test_reference_prefill_matches_sdpa(window):
    ctx = build_context([300], 1, 64, torch.float32, "cpu")
    q_pos = torch.arange(300 - 129, 300, dtype=torch.int32)
    q = torch.randn(129, 3, 64, generator=torch.Generator().manual_seed(2))
    out, lse = kk.paged_prefill_attention_ref(q, q_pos, *prefill_args(ctx), scale=0.125, window=window)
    k, v = contiguous_kv(ctx, 0, 300)
    torch.testing.assert_close(out, sdpa(q, k, v, q_pos, 0.125, window), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lse).all()


def test_reference_rope_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    configs = [
        dict(),
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 2048}),
    ]
    for extra in configs:
        cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=64, max_position_embeddings=8192, **extra)
        rotary = LlamaRotaryEmbedding(cfg)
        for dtype in (torch.float32, torch.bfloat16):
            k = torch.randn(1, 40, 2, 64).to(dtype)  # [1, T, Hkv, D]
            positions = torch.randint(0, 8192, (1, 40))
            cos, sin = rotary(k, positions)
            _, expected = apply_rotary_pos_emb(k, k, cos, sin, unsqueeze_dim=2)
            got = kk.rope_k_ref(k[0], positions[0], rotary.inv_freq, rotary.attention_scaling)
            assert torch.equal(got, expected[0]), (extra, dtype)


# ---------------------------------------------------------------- decode


DECODE_CASES = [
    # (num_kv_heads, group, head_dim, dtype, window)
    (2, 1, 64, torch.float32, 0),
    (1, 3, 128, torch.float32, 0),
    (1, 4, 256, torch.bfloat16, 0),
    (1, 8, 64, torch.bfloat16, 0),
    (2, 3, 64, torch.bfloat16, 100),
    (2, 4, 128, torch.float32, 64),
    (1, 1, 256, torch.float32, 1),
]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,dtype,window", DECODE_CASES)
def test_decode_matches_reference(device, num_kv_heads, group, head_dim, dtype, window):
    ctx = build_context(LENGTHS, num_kv_heads, head_dim, dtype, device)
    q = decode_inputs(ctx, num_kv_heads * group, head_dim, dtype, device)
    scale = head_dim**-0.5
    out, lse = kk.paged_decode_attention(q, *decode_args(ctx), scale=scale, window=window, num_splits=3)
    ref_out, ref_lse = kk.paged_decode_attention_ref(q, *decode_args(ctx), scale=scale, window=window, num_splits=3)
    assert out.shape == (len(LENGTHS), 3, num_kv_heads * group, head_dim) and out.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])  # -inf where a split sees nothing
    assert (out[torch.isneginf(lse)] == 0).all()

    merged, merged_lse = kk.merge_attention_states(out, lse, dim=1)
    full, full_lse = kk.paged_decode_attention_ref(q, *decode_args(ctx), scale=scale, window=window, num_splits=1)
    torch.testing.assert_close(merged, full[:, 0], **TOL[dtype])
    torch.testing.assert_close(merged_lse, full_lse[:, 0], **TOL[dtype])


def test_decode_one_split_equals_several_merged(device):
    ctx = build_context(LENGTHS, 2, 128, torch.float32, device, seed=3)
    q = decode_inputs(ctx, 8, 128, torch.float32, device)
    one, one_lse = kk.paged_decode_attention(q, *decode_args(ctx), scale=0.1, num_splits=1)
    for num_splits in (2, 4, 12):  # 12 > entries: some splits are empty
        out, lse = kk.paged_decode_attention(q, *decode_args(ctx), scale=0.1, num_splits=num_splits)
        merged, merged_lse = kk.merge_attention_states(out, lse, dim=1)
        torch.testing.assert_close(merged, one[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged_lse, one_lse[:, 0], atol=1e-5, rtol=1e-5)
    out, _ = kk.paged_decode_attention(q, *decode_args(ctx), scale=0.1)
    assert out.shape[1] == kk.default_num_splits(ctx["slot_ids"].shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_does_not_depend_on_which_slot_holds_a_block(device, dtype):
    ctx = build_context(LENGTHS, 2, 128, dtype, device, seed=4)
    q = decode_inputs(ctx, 6, 128, dtype, device)
    out, lse = kk.paged_decode_attention(q, *decode_args(ctx), scale=0.09, num_splits=2)

    num_slots = ctx["valid"].shape[0]
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(9)).to(device)
    new_slot_of = torch.argsort(perm)  # old slot s now lives in slot new_slot_of[s]
    ids = ctx["slot_ids"].long()
    moved = dict(
        ctx,
        k_pool=ctx["k_pool"][perm],
        v_pool=ctx["v_pool"][perm],
        valid=ctx["valid"][perm],
        slot_ids=torch.where(ids >= 0, new_slot_of[ids.clamp(min=0)], -1).to(torch.int32),
    )
    out2, lse2 = kk.paged_decode_attention(q, *decode_args(moved), scale=0.09, num_splits=2)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_decode_head_major_pool_view_and_bool_mask(device):
    ctx = build_context(LENGTHS, 2, 64, torch.bfloat16, device, head_major=True, seed=5)
    assert not ctx["k_pool"].is_contiguous()
    q = decode_inputs(ctx, 8, 64, torch.bfloat16, device)
    out, lse = kk.paged_decode_attention(q, *decode_args(ctx), scale=0.125, num_splits=2)
    dense = dict(ctx, k_pool=ctx["k_pool"].contiguous(), v_pool=ctx["v_pool"].contiguous(),
                 valid=ctx["valid"].bool())
    out2, lse2 = kk.paged_decode_attention(q, *decode_args(dense), scale=0.125, num_splits=2)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # a q whose rows are strided (not contiguous, last-dim stride 1) is read through its strides
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device=device)
    wide[..., :64] = q
    out3, _ = kk.paged_decode_attention(wide[..., :64], *decode_args(ctx), scale=0.125, num_splits=2)
    assert torch.equal(out, out3)


def test_decode_all_slots_invalid(device):
    ctx = build_context(LENGTHS, 1, 64, torch.float32, device)
    ctx["valid"].zero_()
    ctx["k_pool"].fill_(NAN)
    q = decode_inputs(ctx, 3, 64, torch.float32, device)
    out, lse = kk.paged_decode_attention(q, *decode_args(ctx), scale=0.125, num_splits=2)
    assert torch.isneginf(lse).all() and (out == 0).all()
    merged, merged_lse = kk.merge_attention_states(out, lse, dim=1)
    assert torch.isneginf(merged_lse).all() and (merged == 0).all()


# ---------------------------------------------------------------- prefill


PREFILL_CASES = [
    # (chunk tokens T, tokens before the chunk, num_kv_heads, group, head_dim, dtype, window)
    (1, 0, 1, 4, 64, torch.float32, 0),
    (63, 1, 1, 3, 128, torch.float32, 0),
    (64, 64, 2, 1, 64, torch.bfloat16, 0),
    (65, 0, 1, 8, 64, torch.float32, 50),
    (129, 200, 1, 4, 256, torch.bfloat16, 0),
    (256, 193, 1, 3, 64, torch.float32, 100),
]


@pytest.mark.parametrize("num_tokens,prefix,num_kv_heads,group,head_dim,dtype,window", PREFILL_CASES)
def test_prefill_matches_reference(device, num_tokens, prefix, num_kv_heads, group, head_dim, dtype, window):
    end = prefix + num_tokens
    ctx = build_context([end], num_kv_heads, head_dim, dtype, device, seed=end)
    q_pos = torch.arange(prefix, end, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=g).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out, lse = kk.paged_prefill_attention(q, q_pos, *prefill_args(ctx), scale=scale, window=window)
    ref_out, ref_lse = kk.paged_prefill_attention_ref(q, q_pos, *prefill_args(ctx), scale=scale, window=window)
    assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])

    # the chunk's last token is the decode query of the same context
    dec, dec_lse = kk.paged_decode_attention(q[-1:], *decode_args(ctx), scale=scale, window=window, num_splits=2)
    merged, merged_lse = kk.merge_attention_states(dec, dec_lse, dim=1)
    torch.testing.assert_close(out[-1:], merged, **TOL[dtype])
    torch.testing.assert_close(lse[-1:], merged_lse, **TOL[dtype])


def test_prefill_head_major_view_and_all_invalid(device):
    ctx = build_context([200], 2, 64, torch.float32, device, head_major=True)
    q_pos = torch.arange(100, 200, dtype=torch.int32, device=device)
    q = torch.randn(100, 4, 64, device=device)
    out, lse = kk.paged_prefill_attention(q, q_pos, *prefill_args(ctx), scale=0.125)
    dense = dict(ctx, k_pool=ctx["k_pool"].contiguous(), v_pool=ctx["v_pool"].contiguous())
    out2, lse2 = kk.paged_prefill_attention(q, q_pos, *prefill_args(dense), scale=0.125)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)

    ctx["valid"].zero_()
    out, lse = kk.paged_prefill_attention(q, q_pos, *prefill_args(ctx), scale=0.125)
    assert torch.isneginf(lse).all() and (out == 0).all()


# ---------------------------------------------------------------- merge


def random_states(shape, head_dim, device, seed, empty_fraction=0.3):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(*shape, head_dim, generator=g)
    lse = torch.randn(*shape, generator=g) * 4
    empty = torch.rand(*shape, generator=g) < empty_fraction
    lse[empty] = -math.inf
    out[empty] = NAN  # an empty state's out is garbage and must not be read
    return out.to(device), lse.to(device)


@pytest.mark.parametrize("shape,dim", [((3, 5, 4), 1), ((20, 2, 3), 0), ((2, 3, 37), -1)])
def test_merge_attention_states_matches_reference(device, shape, dim):
    out, lse = random_states(shape, 64, device, seed=sum(shape))
    got, got_lse = kk.merge_attention_states(out, lse, dim=dim)
    ref, ref_lse = kk.merge_attention_states_ref(out, lse, dim=dim)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-6, rtol=1e-5)
    assert not got.isnan().any()


def test_merge_two_states_associative_and_empty(device):
    a, b, c = (random_states((4, 6), 128, device, seed=s) for s in (1, 2, 3))
    ab_c = kk.merge_two_states(*kk.merge_two_states(*a, *b), *c)
    a_bc = kk.merge_two_states(*a, *kk.merge_two_states(*b, *c))
    stacked = kk.merge_attention_states(torch.stack([a[0], b[0], c[0]]), torch.stack([a[1], b[1], c[1]]), dim=0)
    for x, y in ((ab_c, a_bc), (ab_c, stacked)):
        torch.testing.assert_close(x[0], y[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(x[1], y[1], atol=1e-6, rtol=1e-5)
    ref = kk.merge_two_states_ref(*a, *b)
    got = kk.merge_two_states(*a, *b)
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)

    empty_out = torch.full_like(a[0], NAN)
    empty_lse = torch.full_like(a[1], -math.inf)
    out, lse = kk.merge_two_states(a[0].nan_to_num(), a[1], empty_out, empty_lse)
    torch.testing.assert_close(out, a[0].nan_to_num().masked_fill(torch.isneginf(a[1])[..., None], 0.0))
    assert torch.equal(lse, a[1])
    out, lse = kk.merge_two_states(empty_out, empty_lse, empty_out, empty_lse)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_merged_key_subsets_equal_full_attention(device):
    ctx = build_context([449], 1, 64, torch.float32, device, num_invalid=0)
    q_pos = torch.arange(400, 449, dtype=torch.int32, device=device)
    q = torch.randn(49, 3, 64, device=device)
    k_pool, v_pool, valid, slot_ids, block_pos = prefill_args(ctx)
    full = kk.paged_prefill_attention(q, q_pos, k_pool, v_pool, valid, slot_ids, block_pos, scale=0.125)
    parts = [
        kk.paged_prefill_attention(q, q_pos, k_pool, v_pool, valid, slot_ids[s], block_pos[s], scale=0.125)
        for s in (slice(0, 3), slice(3, 6), slice(6, None))
    ]
    merged = kk.merge_two_states(*kk.merge_two_states(*parts[0], *parts[1]), *parts[2])
    torch.testing.assert_close(merged[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged[1], full[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- rope_bake_store


def bf16_ulps(got, expected):
    """Distance in bf16 units in the last place (same sign assumed near zero is fine for tests)."""
    a = got.view(torch.int16).int()
    b = expected.view(torch.int16).int()
    return (a - b).abs()


@pytest.mark.parametrize("num_kv_heads,head_dim,dtype", [
    (3, 64, torch.float32), (1, 256, torch.bfloat16), (2, 128, torch.bfloat16), (8, 64, torch.float32),
])
def test_rope_bake_store_matches_reference(device, num_kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(head_dim + num_kv_heads)
    num_tokens, num_slots = 150, 5
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    positions = torch.randint(0, 131072, (num_tokens,), generator=g).to(device)
    if num_kv_heads == 3:
        positions = positions.int()
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device)
    cells = torch.randperm(num_slots * BLOCK_TOKENS, generator=g)[:num_tokens].to(device)
    slot_ids = (cells // BLOCK_TOKENS).int()
    offsets = (cells % BLOCK_TOKENS).int()
    slot_ids[::10] = -1  # not stored
    # head-major pools, pre-filled with a sentinel that untouched cells must keep
    def pool():
        buf = torch.full((num_kv_heads, num_slots * BLOCK_TOKENS, head_dim), 7.0, dtype=dtype, device=device)
        return buf.view(num_kv_heads, num_slots, BLOCK_TOKENS, head_dim).permute(1, 0, 2, 3)
    k_pool, v_pool, k_ref, v_ref = pool(), pool(), pool(), pool()
    args = (positions, inv_freq)
    kk.rope_bake_store(k, v, *args, k_pool, v_pool, slot_ids, offsets, attention_scaling=1.2)
    kk.rope_bake_store_ref(k, v, *args, k_ref, v_ref, slot_ids, offsets, attention_scaling=1.2)
    assert torch.equal(v_pool, v_ref)
    assert (k_pool == 7.0).sum() == (k_ref == 7.0).sum() >= 15 * num_kv_heads * head_dim
    if dtype == torch.float32:
        # cos/sin of angles up to 1.3e5 may differ by an fp32 ulp between libraries
        torch.testing.assert_close(k_pool, k_ref, atol=1e-6, rtol=1e-6)
    else:
        # bf16: rounded after every op as torch does -> at most 1 bf16 ulp (cos/sin rounding)
        ulps = bf16_ulps(k_pool.contiguous(), k_ref.contiguous())
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01


# ---------------------------------------------------------------- input checks


def test_launchers_reject_bad_inputs(device):
    ctx = build_context([65, 130], 2, 64, torch.float32, device)
    q = decode_inputs(ctx, 4, 64, torch.float32, device)
    args = decode_args(ctx)
    k_pool, v_pool, valid, slot_ids, block_pos, seq_lens = args

    def decode(q=q, k_pool=k_pool, v_pool=v_pool, valid=valid, slot_ids=slot_ids, block_pos=block_pos,
               seq_lens=seq_lens, **kw):
        kw.setdefault("scale", 0.125)
        return kk.paged_decode_attention(q, k_pool, v_pool, valid, slot_ids, block_pos, seq_lens, **kw)

    strided_q = torch.randn(2, 4, 128, device=device)[..., ::2]
    cases = [
        (dict(q=strided_q), ValueError, "q must have stride 1 in its last dim"),
        (dict(q=q.bfloat16()), TypeError, "q must have dtype"),
        (dict(q=q[:, :3]), ValueError, "multiple of the pool's KV heads"),
        (dict(q=q[..., :32].contiguous()), ValueError, "head_dim"),
        (dict(k_pool=k_pool[:, :, :32], v_pool=v_pool[:, :, :32]), ValueError, "BLOCK_TOKENS"),
        (dict(v_pool=v_pool.bfloat16()), TypeError, "share a dtype"),
        (dict(k_pool=k_pool.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "k_pool must have stride 1"),
        (dict(valid=valid.float()), TypeError, "valid must have dtype"),
        (dict(valid=valid[:-1]), ValueError, "one entry per slot"),
        (dict(slot_ids=slot_ids.long()), TypeError, "slot_ids must have dtype"),
        (dict(block_pos=block_pos[:, :-1]), ValueError, "slot_ids and block_pos"),
        (dict(seq_lens=seq_lens[:1]), ValueError, "seq_lens must be"),
        (dict(window=-1), ValueError, "window"),
        (dict(num_splits=0), ValueError, "num_splits"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            decode(**kwargs)

    q_pos = torch.arange(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="q_pos must be"):
        kk.paged_prefill_attention(q, q_pos[:1], k_pool, v_pool, valid, slot_ids[0], block_pos[0], scale=0.1)
    with pytest.raises(ValueError, match="slot_ids must have 1 dims"):
        kk.paged_prefill_attention(q, q_pos, k_pool, v_pool, valid, slot_ids, block_pos[0], scale=0.1)
    with pytest.raises(ValueError, match="lse must be|lse's shape"):
        kk.merge_attention_states(torch.zeros(2, 3, 4, 8, device=device), torch.zeros(2, 3, 5, device=device))

    k = torch.randn(3, 2, 64, device=device)
    positions = torch.arange(3, device=device)
    inv_freq = torch.ones(32, device=device)
    ids = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="k_pool must have dtype"):
        kk.rope_bake_store(k, k, positions, inv_freq, k_pool.bfloat16(), v_pool, ids, ids)
    with pytest.raises(ValueError, match="inv_freq must be"):
        kk.rope_bake_store(k, k, positions, inv_freq[:16], k_pool, v_pool, ids, ids)
    with pytest.raises(TypeError, match="positions must have dtype"):
        kk.rope_bake_store(k, k, positions.float(), inv_freq, k_pool, v_pool, ids, ids)


def test_shared_and_ragged_launchers_reject_bad_inputs(device):
    k_pool, v_pool, valid = (t.to(device) for t in shared_pool(6, 2, 64, torch.float32, seed=0))
    plan = shared_plan(SHARED_LISTS, SHARED_POSITIONS)
    item_slots, item_pos, item_off, pair_query, q_pos, q_end = plan_args(plan, device)
    q = torch.randn(4, 4, 64, device=device)

    def shared(q=q, item_slots=item_slots, item_off=item_off, q_end=q_end, **kw):
        return kk.shared_decode_states(q, k_pool, v_pool, valid, item_slots, item_pos, item_off, pair_query,
                                       q_pos, q_end, scale=0.125, **kw)

    states = torch.zeros(plan.num_pairs, 4, 64, device=device)
    lse = torch.zeros(plan.num_pairs, 4, device=device)
    cases = [
        (dict(q=q[:, :3]), ValueError, "multiple of the pool's KV heads"),
        (dict(q=q.half()), TypeError, "q must have dtype"),
        (dict(item_slots=item_slots.long()), TypeError, "item_slots must have dtype"),
        (dict(item_off=item_off[:-1]), ValueError, "item_off"),
        (dict(q_end=q_end[:2]), ValueError, "q_end must be"),
        (dict(out=states), ValueError, "pass both out and lse"),
        (dict(out=states[:-1], lse=lse[:-1]), ValueError, "out and lse must be"),
        (dict(window=-1), ValueError, "window"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            shared(**kwargs)
    with pytest.raises(TypeError, match="offsets must have dtype"):
        kk.merge_ragged_states(states, lse, plan.q_off.long().to(device), plan.q_pairs.to(device))
    with pytest.raises(ValueError, match="indices must have stride 1"):
        kk.merge_ragged_states(states, lse, plan.q_off.to(device), plan.q_pairs.repeat(2).to(device)[::2])


# -- dequantize-in-register matmul (quantized weights on the GPU) -------------------------------

@pytest.mark.parametrize("M, N, K, group, offsets", [(1, 40, 256, 32, True), (37, 70, 192, 16, False),
                                                     (16, 32, 64, 32, True)])
def test_dequant_matmul_matches_reference(device, M, N, K, group, offsets):
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, K // group, generator=g) * 0.02
    offset = torch.randn(N, K // group, generator=g) * 0.05 if offsets else torch.zeros(N, K // group)
    args = [t.to(device) for t in (x, q, scale, offset)]
    got = kk.dequant_matmul(*args)
    torch.testing.assert_close(got, kk.dequant_matmul_ref(*args), atol=1e-5, rtol=1e-5)
    w = kk.dequantize_ref(q, scale, offset)
    assert torch.equal(w[3, group:2 * group], scale[3, 1] * q[3, group:2 * group].float() + offset[3, 1])


@pytest.mark.parametrize("shift", [8, 0])
def test_dequant_matmul_reads_4_bit_values_packed_two_a_byte(device, shift):
    g = torch.Generator().manual_seed(shift)
    M, N, K = 5, 48, 256
    x = torch.randn(M, K, generator=g)
    q = (torch.randint(0, 16, (N, K), generator=g) - shift).to(torch.int8)
    scale, offset = torch.rand(N, K // 32, generator=g) * 0.02, torch.randn(N, K // 32, generator=g) * 0.05
    packed = kk.pack4(q, shift)
    assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2) and torch.equal(kk.unpack4(packed, shift), q)
    args = [t.to(device) for t in (x, packed, scale, offset)]
    torch.testing.assert_close(kk.dequant_matmul(*args, shift=shift), kk.dequant_matmul_ref(x, q, scale, offset).to(device),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="each in"):
        kk.pack4(q, shift + 1 if shift == 0 else shift - 1)


def test_dequant_matmul_rejects_bad_inputs(device):
    x, q = torch.randn(2, 64, device=device), torch.zeros(8, 64, dtype=torch.int8, device=device)
    scale = torch.ones(8, 2, device=device)
    with pytest.raises(ValueError, match="x has 64 inputs and q 32"):
        kk.dequant_matmul(x, q[:, :32].contiguous(), scale, scale)
    with pytest.raises(ValueError, match=r"scale and offset must be \[N, K / group\]"):
        kk.dequant_matmul(x, q, scale[:4], scale[:4])
    with pytest.raises(ValueError, match="groups of 128 inputs do not divide"):
        kk.dequant_matmul(torch.randn(2, 128, device=device), torch.zeros(8, 128, dtype=torch.int8, device=device),
                          scale[:, :1], scale[:, :1])
    with pytest.raises(TypeError):
        kk.dequant_matmul(x, q.float(), scale, scale)


def test_package_imports_without_triton():
    code = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
import torch
import kvpage_kernels as kk
assert not kk.HAS_TRITON and kk.BLOCK_TOKENS == 64
out = torch.randn(2, 3, 4, 8)
lse = torch.randn(2, 3, 4)
kk.merge_attention_states_ref(out, lse, dim=1)
try:
    kk.merge_attention_states(out, lse, dim=1)
except kk.TritonUnavailableError as e:
    assert "Triton is not available" in str(e)
    print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_package_names_resolve_and_the_command_line_does_not_import_triton():
    """kvpage_kernels imports its modules on first use: every name of __all__ resolves, and the
    command line (which needs only BLOCK_TOKENS until a Triton backend is chosen) starts without
    Triton's import."""
    import kvpage_kernels

    assert all(callable(getattr(kvpage_kernels, name)) or name in ("BLOCK_TOKENS", "HAS_TRITON")
               for name in kvpage_kernels.__all__)
    code = "import sys, kvpage_cli.cli.app; print('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------- shared-prefix (cascade) decode


def shared_pool(num_slots, num_kv_heads, head_dim, dtype, seed, invalid=()):
    """A pool of random blocks; the `invalid` slots hold NaN and have their valid bit clear."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_slots, num_kv_heads, BLOCK_TOKENS, head_dim, generator=g)
    v_pool = torch.randn(num_slots, num_kv_heads, BLOCK_TOKENS, head_dim, generator=g)
    valid = torch.ones(num_slots, dtype=torch.int8)
    for slot in invalid:
        k_pool[slot] = v_pool[slot] = NAN
        valid[slot] = 0
    return k_pool.to(dtype), v_pool.to(dtype), valid


def shared_plan(lists, positions):
    """A DecodePlan whose ids are slots: lists[j] = [(slot, logical block index), ...] of query j."""
    from kvpage_cli.engine.attention.backend import DecodePlan

    blocks = [(torch.tensor([s for s, _ in entries], dtype=torch.int32),
               torch.tensor([b for _, b in entries], dtype=torch.int32)) for entries in lists]
    return DecodePlan.build(blocks, positions)


def plan_args(plan, device):
    return tuple(t.to(device) for t in (plan.item_ids, plan.item_pos, plan.item_off, plan.pair_query, plan.q_pos,
                                        plan.q_end))


# Forks of one document (slots 0, 1) reading its blocks together: a query at 63 (its block 1,
# positions 64.., shows it nothing), at 64 (one key of block 1) and 65 (two keys) sharing slot 1,
# and a query at 150 whose third block (slot 5) is invalid. Window 70 cuts the 150 query's
# block 1 at key 81 and leaves block 0 out; window 1 keeps only the query's own key.
SHARED_LISTS = [[(0, 0), (1, 1)], [(0, 0), (1, 1)], [(0, 0), (1, 1), (2, 2)], [(0, 0), (3, 1), (5, 2)]]
SHARED_POSITIONS = [63, 64, 65, 150]
SHARED_CASES = [
    # (num_kv_heads, group, head_dim, pool dtype, window)
    (2, 1, 64, torch.float32, 0),
    (1, 3, 64, torch.float32, 70),
    (1, 3, 128, torch.bfloat16, 0),
    (2, 1, 64, torch.float32, 1),
]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,dtype,window", SHARED_CASES)
def test_shared_decode_states_matches_reference(device, num_kv_heads, group, head_dim, dtype, window):
    # fp32 products either way (a bf16 pool is upcast exactly): fp32 tolerance 1e-5 abs+rel
    k_pool, v_pool, valid = (t.to(device) for t in shared_pool(6, num_kv_heads, head_dim, dtype, seed=head_dim,
                                                                invalid=(5,)))
    plan = shared_plan(SHARED_LISTS, SHARED_POSITIONS)
    assert plan.item_ids.numel() < plan.num_pairs  # blocks are shared
    q = torch.randn(4, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(8)).to(device)
    args = (q, k_pool, v_pool, valid, *plan_args(plan, device))
    scale = head_dim**-0.5
    out, lse = kk.shared_decode_states(*args, scale=scale, window=window)
    ref_out, ref_lse = kk.shared_decode_states_ref(*args, scale=scale, window=window)
    assert out.shape == (plan.num_pairs, num_kv_heads * group, head_dim) and out.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    empty = torch.isneginf(lse)
    assert torch.equal(empty, torch.isneginf(ref_lse)) and (out[empty] == 0).all()
    # the invalid slot's pair and the 63 query's pair over block 1 see nothing
    item_of_pair = torch.repeat_interleave(torch.arange(plan.item_ids.numel()), plan.item_off.diff().long())
    nothing = (plan.item_ids[item_of_pair] == 5) | ((plan.pair_query == 0) & (plan.item_pos[item_of_pair] == 1))
    assert empty[nothing].all() and nothing.sum() == 2

    # written into given buffers, only the pairs of the items passed (a pass through the pool)
    first, last = 1, plan.item_ids.numel() - 1
    part = plan.items(first, last)
    given_out = torch.full_like(out, 7.0)
    given_lse = torch.full_like(lse, 7.0)
    kk.shared_decode_states(q, k_pool, v_pool, valid, *plan_args(part, device), scale=scale, window=window,
                            out=given_out, lse=given_lse)
    written = torch.zeros(plan.num_pairs, dtype=torch.bool)
    written[int(plan.item_off[first]):int(plan.item_off[last])] = True
    assert torch.equal(given_out[written], out[written]) and torch.equal(given_lse[written], lse[written])
    assert (given_out[~written] == 7.0).all() and (given_lse[~written] == 7.0).all()


def test_merge_ragged_states_matches_reference(device):
    out, lse = random_states((40, 3), 64, device, seed=11)
    g = torch.Generator().manual_seed(12)
    # groups of 0, 1, 20 (> one 16-state chunk) and 5 states, picked in a shuffled order
    sizes = [0, 1, 20, 5, 0]
    indices = torch.randperm(40, generator=g)[:sum(sizes)].to(torch.int32)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    indices, offsets = indices.to(device), offsets.to(device)
    got, got_lse = kk.merge_ragged_states(out, lse, offsets, indices)
    ref, ref_lse = kk.merge_ragged_states_ref(out, lse, offsets, indices)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-6, rtol=1e-5)
    assert not got.isnan().any()
    assert (got[[0, 4]] == 0).all() and torch.isneginf(got_lse[[0, 4]]).all()  # no states: 0, -inf
    for j in (1, 2, 3):  # as merge_attention_states over the group's states
        chosen = indices[offsets[j]:offsets[j + 1]].long()
        expected = kk.merge_attention_states(out[chosen], lse[chosen], dim=0)
        torch.testing.assert_close(got[j], expected[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 70])
def test_triton_backend_shared_decode_equals_torch(device, window):
    """TritonBackend's states and merge against TorchBackend's on one plan, in two pool passes
    (the plan on the CPU, as the engine builds it; the pool and the queries on the device)."""
    from kvpage_cli.engine.attention.backend import LayerBlocks, TorchBackend, TritonBackend

    num_kv_heads, group, head_dim, scale = 1, 3, 64, 0.125
    k_slots, v_slots, valid = (t.to(device) for t in shared_pool(5, num_kv_heads, head_dim, torch.float32, seed=13))
    blocks = LayerBlocks(None, None, lambda slots: (k_slots[slots], v_slots[slots]), k_slots, v_slots, valid)
    lists = SHARED_LISTS[:3] + [[(0, 0), (3, 1), (4, 2)]]  # the pool never lists an invalid slot
    plan = shared_plan(lists, SHARED_POSITIONS)
    q = torch.randn(4, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(14)).to(device)
    results = {}
    for backend in (TorchBackend(num_kv_heads * group, num_kv_heads, head_dim, scale),
                    TritonBackend(kk, num_kv_heads * group, num_kv_heads, head_dim, scale)):
        states, lse = backend.states(plan.num_pairs, q.device)
        middle = 2
        for part in (plan.items(0, middle), plan.items(middle, plan.item_ids.numel())):
            backend.decode_states(q, part, blocks, window, states, lse)
        results[backend.name] = (states, lse, backend.merge(states, lse, plan))
    # fp32 both ways; they differ in summation order and exp2 vs exp: 1e-5 abs+rel
    for got, expected in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # a query gets the same bits decoded alone as batched with the queries sharing its blocks
    triton = TritonBackend(kk, num_kv_heads * group, num_kv_heads, head_dim, scale)
    for j in range(4):
        alone = shared_plan([lists[j]], [SHARED_POSITIONS[j]])
        states, lse = triton.states(alone.num_pairs, q.device)
        triton.decode_states(q[j:j + 1], alone, blocks, window, states, lse)
        assert torch.equal(triton.merge(states, lse, alone)[0], results["triton"][2][j])


# -- the engine's triton backend, end to end (interpreter on CPU, compiled on CUDA) --------------


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_engine_triton_backend_matches_torch(arch, kv_home):
    from kvpage_cli.engine import Engine, EngineConfig

    from .conftest import random_prompt, tiny_model

    shape = dict(num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=1)  # kernels: D >= 64
    if arch == "gemma3_text":
        shape["layer_types"] = ["sliding_attention", "full_attention"]
    model = tiny_model(arch, **shape)
    ids = random_prompt(150, seed=61)  # past gemma's 100-token window, three blocks
    engines = {
        backend: Engine.load(model, EngineConfig(home=str(kv_home), backend=backend, kv_path="pool", pool_mib=0.0625,
                                                 prefill_chunk=64))
        for backend in ("torch", "triton")
    }
    assert engines["triton"].backend.name == "triton"
    results = {}
    for backend, engine in engines.items():
        ctx = engine.prefill(ids)
        logits = engine.logits(ctx).clone()
        results[backend] = (logits, list(engine.generate(ctx, max_new_tokens=6, stop=())))
    assert results["triton"][1] == results["torch"][1]
    assert (results["triton"][0] - results["torch"][0]).abs().max().item() < 1e-4


def test_a_head_size_the_triton_kernels_do_not_take_is_refused_at_load(kv_home):
    """backend triton with a 16-wide head (the kernels take 64, 128, 256) stops at load with what
    to do; backend auto on a GPU picks the torch backend for such a model instead."""
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.errors import UsageError

    from .conftest import tiny_model

    with pytest.raises(UsageError, match="head dims 64, 128, 256; this model's is 16: use backend 'torch'"):
        Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home), backend="triton", kv_path="pool"))


def test_device_auto_is_the_cpu_for_what_runs_only_there(monkeypatch):
    """With a GPU in sight, device auto is CUDA, except for the native kernels and the store path,
    which run on the CPU alone: asking for them picks the CPU instead of failing."""
    from kvpage_cli.engine import EngineConfig
    from kvpage_cli.engine.load import _resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _resolve_device(EngineConfig()).type == "cuda"
    assert _resolve_device(EngineConfig(backend="native")).type == "cpu"
    assert _resolve_device(EngineConfig(kv_path="store")).type == "cpu"
    assert _resolve_device(EngineConfig(backend="triton", kv_path="pool")).type == "cuda"


def test_engine_triton_backend_batches_and_retrieves_like_torch(kv_home):
    """Batched decoding over forks, and a retrieval assembly, through the Triton kernels (interpreter)."""
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.engine import Request
    from kvpage_cli.engine.index import RetrievalIndex

    from .conftest import random_prompt, tiny_model

    model = tiny_model("llama", num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=1)
    results = {}
    for backend in ("torch", "triton"):
        engine = Engine.load(model, EngineConfig(home=str(kv_home), backend=backend, kv_path="pool", pool_mib=0.0625,
                                                 prefill_chunk=64))
        doc = engine.prefill(random_prompt(130, seed=62))
        requests = [Request(engine.fork(doc), random_prompt(n, seed=63 + n), 3, stop=()) for n in (2, 5, 9)]
        list(engine.run(requests, max_batch=3))
        index = RetrievalIndex.build(engine, random_prompt(40, seed=70), random_prompt(400, seed=71), window=128, overlap=64)
        ctx = index.assemble([1, 4])
        answer = list(engine.generate(ctx, index.rest + [5, 6], max_new_tokens=3, stop=()))
        results[backend] = ([r.generated for r in requests], answer)
    assert results["triton"] == results["torch"]
