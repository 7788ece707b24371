"""Input checks shared by the launchers: each raises ValueError/TypeError naming the argument."""

from __future__ import annotations

import torch

from .constants import BLOCK_TOKENS, HEAD_DIMS

ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
VALID_DTYPES = (torch.int8, torch.uint8, torch.bool)


def check_tensor(fn: str, name: str, t, *, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: {name} must have dtype in ({allowed}), got {t.dtype}")


def check_unit_last_stride(fn: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{fn}: {name} must have stride 1 in its last dim (got strides {t.stride()}); "
            f"pass {name}.contiguous()"
        )


def check_same_device(fn: str, **tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{n}={d}" for n, d in devices.items())
        raise ValueError(f"{fn}: all tensors must be on one device, got {listed}")
    return first


def check_pool(fn: str, k_pool, v_pool, valid) -> tuple[int, int, int]:
    """Check the pool pair and its valid mask; return (num_slots, num_kv_heads, head_dim)."""
    check_tensor(fn, "k_pool", k_pool, ndim=4, dtypes=ATTENTION_DTYPES)
    check_tensor(fn, "v_pool", v_pool, ndim=4, dtypes=ATTENTION_DTYPES)
    if v_pool.shape != k_pool.shape:
        raise ValueError(
            f"{fn}: k_pool and v_pool must have one shape [S, Hkv, {BLOCK_TOKENS}, D], "
            f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if v_pool.dtype != k_pool.dtype:
        raise TypeError(f"{fn}: k_pool and v_pool must share a dtype, got {k_pool.dtype} and {v_pool.dtype}")
    num_slots, num_kv_heads, block_tokens, head_dim = k_pool.shape
    if block_tokens != BLOCK_TOKENS:
        raise ValueError(f"{fn}: pool dim 2 must be BLOCK_TOKENS={BLOCK_TOKENS}, got {block_tokens}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{fn}: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    check_unit_last_stride(fn, "k_pool", k_pool)
    check_unit_last_stride(fn, "v_pool", v_pool)
    check_tensor(fn, "valid", valid, ndim=1, dtypes=VALID_DTYPES)
    if valid.shape[0] != num_slots:
        raise ValueError(f"{fn}: valid must have one entry per slot ({num_slots}), got {valid.shape[0]}")
    return num_slots, num_kv_heads, head_dim


def check_group(fn: str, num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{fn}: query heads ({num_q_heads}) must be a multiple of the pool's KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_scale_window(fn: str, scale, window) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{fn}: scale must be a Python float, got {type(scale).__name__}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{fn}: window must be an int >= 0 (0 = no sliding window), got {window!r}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
