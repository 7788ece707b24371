"""Guarded Triton import: the package imports (and the references run) without Triton."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the references still work; the launchers raise TritonUnavailableError
    HAS_TRITON = False
    triton = None

    class _MissingLanguage:
        # Only what kernel signatures evaluate at definition time; bodies never run.
        constexpr = None

    tl = _MissingLanguage()


class TritonUnavailableError(RuntimeError):
    """A kernel launcher was called but Triton is not installed."""


def jit(fn):
    """`triton.jit` when Triton is installed; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def require_launchable(kernel, name: str, device: torch.device) -> None:
    """Raise a clear error when `kernel` cannot be launched on tensors living on `device`."""
    if not HAS_TRITON:
        raise TritonUnavailableError(
            f"{name}: Triton is not available; install it (pip install 'kvpage[triton]') "
            f"or use {name}_ref"
        )
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"{name}: tensors are on {device}, but Triton kernels need CUDA tensors; to run them on "
            "CPU set TRITON_INTERPRET=1 before triton and kvpage_kernels are imported"
        )
