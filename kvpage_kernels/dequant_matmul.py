"""y = x @ W^T with W kept quantized on the device and dequantized in registers, tile by tile.

W [N, K] is given as its integer values q (int8 [N, K]) and, per group of `group` consecutive
inputs of a row, a scale and an offset (fp32 [N, K / group]): W[n, k] = scale[n, g] * q[n, k] +
offset[n, g], g = k // group. Every GGUF block format decodes to this exactly (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 and Q4_K, Q5_K in groups of 32, Q2_K, Q3_K, Q6_K in groups of 16: the native decoder
`kvp_decode_i8_rows` writes it), and so do kvpage's int8 (one scale per row) and int4 (Q4_1)
weights. The weights stay at a byte per value plus 8 bytes per group instead of 4 bytes per
value; no fp32 copy of W is ever made. Formats of 4 bits or fewer (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K)
are packed two values a byte: q is then uint8 [N, K / 2], input 2j in the low nibble of byte j and
2j + 1 in the high one, each value the nibble less `shift` (8 for Q4_0's signed values, 4 for
Q3_K's, else 0).
"""

from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor, check_unit_last_stride
from ._triton import jit, require_launchable, tl

_BLOCK_M = 16
_BLOCK_N = 32
_BLOCK_K = 64


@jit
def _dequant_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    SHIFT,
    GROUP: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: a BLOCK_M x BLOCK_N tile of y, over K in steps of BLOCK_K (a multiple of GROUP).
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        if PACKED:  # two 4-bit values a byte: each byte is read for both of its inputs
            byte = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + (k // 2)[None, :], mask=w_mask, other=0)
            q = ((byte.to(tl.int32) >> ((k % 2) * 4)[None, :]) & 15) - SHIFT
        else:
            q = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + k[None, :], mask=w_mask, other=0)
        at = rn[:, None].to(tl.int64) * stride_sn + (k // GROUP)[None, :]
        scale = tl.load(scale_ptr + at, mask=w_mask, other=0.0)
        offset = tl.load(offset_ptr + at, mask=w_mask, other=0.0)
        w = scale * q.to(tl.float32)
        w = w + offset  # two roundings, as the reference: the weights' exact values
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   shift: int = 0) -> torch.Tensor:
    """x [M, K] fp32, q int8 [N, K] (or packed 4-bit values: uint8 [N, K / 2], see above), scale
    and offset fp32 [N, K / group] -> x @ W^T: [M, N] fp32 (fp32 products and sums: ieee, not TF32)."""
    fn = "dequant_matmul"
    check_tensor(fn, "x", x, ndim=2, dtypes=(torch.float32,))
    check_tensor(fn, "q", q, ndim=2, dtypes=(torch.int8, torch.uint8))
    check_tensor(fn, "scale", scale, ndim=2, dtypes=(torch.float32,))
    check_tensor(fn, "offset", offset, ndim=2, dtypes=(torch.float32,))
    for name, t in (("x", x), ("q", q), ("scale", scale), ("offset", offset)):
        check_unit_last_stride(fn, name, t)
    device = check_same_device(fn, x=x, q=q, scale=scale, offset=offset)
    packed = q.dtype == torch.uint8
    (M, K), (N, Kq) = x.shape, q.shape
    if Kq * (2 if packed else 1) != K:
        raise ValueError(f"{fn}: x has {K} inputs and q {Kq * (2 if packed else 1)}")
    if scale.shape != offset.shape or scale.shape[0] != N or scale.shape[1] == 0 or K % scale.shape[1]:
        raise ValueError(f"{fn}: scale and offset must be [N, K / group] for q {tuple(q.shape)}, got "
                         f"{tuple(scale.shape)} and {tuple(offset.shape)}")
    group = K // scale.shape[1]
    if _BLOCK_K % group:
        raise ValueError(f"{fn}: groups of {group} inputs do not divide a tile of {_BLOCK_K}")
    require_launchable(_dequant_matmul_kernel, fn, device)
    y = torch.empty((M, N), dtype=torch.float32, device=device)
    if M == 0 or N == 0:
        return y
    grid = (-(-M // _BLOCK_M), -(-N // _BLOCK_N))
    _dequant_matmul_kernel[grid](
        x, q, scale, offset, y, M, N, K,
        x.stride(0), q.stride(0), scale.stride(0), y.stride(0), shift,
        GROUP=group, PACKED=packed, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return y


def pack4(q: torch.Tensor, shift: int) -> torch.Tensor:
    """int8 values in [-shift, 15 - shift] [N, K] -> two a byte: uint8 [N, K / 2]."""
    wide = q.to(torch.int16) + shift
    if q.shape[1] % 2 or (wide.numel() and (int(wide.min()) < 0 or int(wide.max()) > 15)):
        raise ValueError(f"pack4: needs an even number of inputs, each in [{-shift}, {15 - shift}]")
    nibbles = wide.to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack4(packed: torch.Tensor, shift: int) -> torch.Tensor:
    """The inverse of pack4: int8 [N, K]."""
    both = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return (both.to(torch.int16) - shift).to(torch.int8)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """W [N, K] fp32 from its values (int8, or packed 4-bit uint8) and group scales and offsets."""
    if q.dtype == torch.uint8:
        q = unpack4(q, shift)
    group = q.shape[1] // scale.shape[1]
    w = scale.repeat_interleave(group, dim=1) * q.float()
    return w + offset.repeat_interleave(group, dim=1)


def dequant_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                       shift: int = 0) -> torch.Tensor:
    """fp32 torch reference of dequant_matmul."""
    return x.float() @ dequantize_ref(q, scale, offset, shift).t()
