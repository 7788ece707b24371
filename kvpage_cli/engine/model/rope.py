"""Rotary position embedding, identical to the model's own.

The inverse frequencies and the attention scaling come from the architecture's own
transformers RotaryEmbedding module (so every scaling variant transformers knows, and Gemma 3's
per-layer-type theta, is reproduced exactly). Importing that module loads transformers' generation
code, torch's compiler and Triton (about 200 MiB of RSS and seconds of start-up), so what it
computes is kept under the home folder, keyed by the config and the transformers version, and a
later load reads it back bit for bit. cos/sin and the rotation follow transformers'
arithmetic: fp32 angles, cos/sin cast to the activation dtype, then x*cos + rotate_half(x)*sin.
RoPE is applied to K once, before a block is written ("baked"), so blocks are self-contained, and
a block moves from position p to q by one more rotation of its K rows by q - p (`rotate`): the
rotation of every frequency pair composes additively, and the attention scaling, applied once at
the bake, is not applied again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

_ROTARY_CLASSES = {
    "llama": ("llama", "LlamaRotaryEmbedding"),
    "mistral": ("mistral", "MistralRotaryEmbedding"),
    "qwen2": ("qwen2", "Qwen2RotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3RotaryEmbedding"),
    "gemma3_text": ("gemma3", "Gemma3RotaryEmbedding"),
}


@dataclass(frozen=True)
class RopeParams:
    inv_freq: torch.Tensor  # [D/2] fp32
    attention_scaling: float


def rope_params_from_config(config, arch: str, rope_keys: set[str], home: Path | None = None) -> dict[str, RopeParams]:
    """inv_freq and attention scaling per rope key, computed by the model's own rotary module, or
    read from `home/rope/` where an earlier load computed them for the same config."""
    if home is None:
        return _computed(config, arch, rope_keys)
    import transformers

    from ..home import private_dir

    key = hashlib.sha256(json.dumps([config.to_json_string(use_diff=False), arch, sorted(rope_keys),
                                     transformers.__version__]).encode()).hexdigest()[:24]
    path = Path(home) / "rope" / f"{key}.json"
    try:
        saved = json.loads(path.read_text())
        return {k: RopeParams(inv_freq=torch.tensor(v["inv_freq"], dtype=torch.float32),
                              attention_scaling=float(v["attention_scaling"])) for k, v in saved.items()}
    except (OSError, ValueError, TypeError, KeyError):  # not computed yet, or a damaged file: compute it
        pass
    params = _computed(config, arch, rope_keys)
    # float32 -> Python float (a double) -> float32 is exact, so the file gives back the same bits
    text = json.dumps({k: {"inv_freq": p.inv_freq.tolist(), "attention_scaling": p.attention_scaling}
                       for k, p in params.items()})
    try:
        private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:  # a read-only home: compute it again next time
        pass
    return params


def _computed(config, arch: str, rope_keys: set[str]) -> dict[str, RopeParams]:
    module_name, class_name = _ROTARY_CLASSES[arch]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    rotary = getattr(module, class_name)(config=config)
    params = {}
    for key in rope_keys:
        prefix = "" if key == "default" else f"{key}_"
        inv_freq = getattr(rotary, f"{prefix}inv_freq").detach().to(torch.float32).clone()
        scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
        params[key] = RopeParams(inv_freq=inv_freq, attention_scaling=scaling)
    return params


def rope_cos_sin(params: RopeParams, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, D] in `dtype` for absolute `positions` [T]."""
    inv_freq = params.inv_freq if params.inv_freq.device == positions.device else params.inv_freq.to(positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * params.attention_scaling
    sin = emb.sin() * params.attention_scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D] -> rotated x, same shape and dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotation(delta: torch.Tensor, params: RopeParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin [T, D] fp32 of a move by `delta` [T] positions (int), for `rotate`: the
    same for every layer of one RoPE setting."""
    freqs = delta.to(torch.float32)[:, None] * params.inv_freq.to(delta.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, delta: torch.Tensor, params: RopeParams,
           table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Baked K rows moved by `delta` positions: x [..., T, D] (rotated at positions p), delta [T]
    (int) -> x rotated as if baked at p + delta, in x's dtype (computed in fp32). table:
    `rotation(delta, params)`, computed once for many layers (the same bits)."""
    cos, sin = rotation(delta, params) if table is None else table
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
