"""y = x @ W^T with W kept quantized on the device and dequantized in registers, tile by tile.

W [N, K] is given as its integer values q (int8 [N, K]) and, per group of `group` consecutive
inputs of a row, a scale and an offset (fp32 [N, K / group]): W[n, k] = scale[n, g] * q[n, k] +
offset[n, g], g = k // group. Every GGUF block format decodes to this exactly (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 and Q4_K, Q5_K in groups of 32, Q6_K in groups of 16: the native decoder
`kvp_decode_i8_rows` writes it), and so do kvpage's int8 (one scale per row) and int4 (Q4_1)
weights. The weights stay at a byte per value plus 8 bytes per group instead of 4 bytes per
value; no fp32 copy of W is ever made.
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
    GROUP: tl.constexpr,
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
        q = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + k[None, :], mask=w_mask, other=0)
        at = rn[:, None].to(tl.int64) * stride_sn + (k // GROUP)[None, :]
        scale = tl.load(scale_ptr + at, mask=w_mask, other=0.0)
        offset = tl.load(offset_ptr + at, mask=w_mask, other=0.0)
        w = scale * q.to(tl.float32)
        w = w + offset  # two roundings, as the reference: the weights' exact values
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32, q int8 [N, K], scale and offset fp32 [N, K / group] -> x @ W^T: [M, N] fp32
    (fp32 products and sums: ieee, not TF32)."""
    fn = "dequant_matmul"
    check_tensor(fn, "x", x, ndim=2, dtypes=(torch.float32,))
    check_tensor(fn, "q", q, ndim=2, dtypes=(torch.int8,))
    check_tensor(fn, "scale", scale, ndim=2, dtypes=(torch.float32,))
    check_tensor(fn, "offset", offset, ndim=2, dtypes=(torch.float32,))
    for name, t in (("x", x), ("q", q), ("scale", scale), ("offset", offset)):
        check_unit_last_stride(fn, name, t)
    device = check_same_device(fn, x=x, q=q, scale=scale, offset=offset)
    (M, K), (N, Kq) = x.shape, q.shape
    if Kq != K:
        raise ValueError(f"{fn}: x has {K} inputs and q {Kq}")
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
        x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return y


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 from its values and group scales and offsets (the kernel's weights)."""
    group = q.shape[1] // scale.shape[1]
    w = scale.repeat_interleave(group, dim=1) * q.float()
    return w + offset.repeat_interleave(group, dim=1)


def dequant_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """fp32 torch reference of dequant_matmul."""
    return x.float() @ dequantize_ref(q, scale, offset).t()
