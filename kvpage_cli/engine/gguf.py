"""GGUF files: their weights as the file keeps them, or converted to a Hugging Face folder.

With `weights="gguf"` the matrices stay in the file's quantized blocks, memory-mapped
(`load_blocks`); only the config and tokenizer transformers derives from the file are cached
(`ensure_metadata`). With float weights the file is dequantized once to fp32 and written beside
that tokenizer and config (`ensure_converted`); later loads read that folder and take seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelError
from .events import EventCallback, ModelLoading, emit
from .home import private_dir, sweep_leftovers

CACHE_FORMAT = 1
_TMP_PREFIX = ".tmp-"  # a conversion in progress: .tmp-<pid>-<random> beside its target


def file_key(path: Path) -> str:
    """Identifies a file's version cheaply: its resolved path, size and modification time."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def cached_folder_for(stem: str, key: str, home: Path) -> Path:
    """The cache folder for converted weights named `stem`, keyed by `key` (see file_key)."""
    digest = hashlib.sha256(f"{key}|format{CACHE_FORMAT}".encode()).hexdigest()[:16]
    return home / "models" / f"{stem}-{digest}"


def ensure_converted(gguf_path: Path, target: Path, on_event: EventCallback | None = None) -> Path:
    """The HF folder for `gguf_path`, converting it first unless another run already has.

    A file lock keeps two processes from converting the same file at once."""
    from filelock import FileLock

    private_dir(target.parent)
    sweep_leftovers(target.parent, _TMP_PREFIX)  # conversions killed before they finished
    if (target / "model.safetensors").exists():
        return target
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").exists():
            convert_gguf(gguf_path, target, on_event)
    return target


def convert_gguf(gguf_path: Path, target: Path, on_event: EventCallback | None = None) -> Path:
    """Dequantize `gguf_path` into the HF folder `target` (atomically: temp folder, then rename)."""
    from transformers import AutoConfig

    display = gguf_path.name
    emit(on_event, ModelLoading(display, "reading GGUF metadata"))
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for unknown or broken files
        raise ModelError(f"{display} could not be read as a GGUF model: {exc}") from exc

    # Local import: spec_from_config raises the clear "unsupported architecture" error.
    from .spec import spec_from_config

    spec = spec_from_config(config)
    try:
        tensors, tokenizer = _dequantize(gguf_path, config, spec, on_event)
    except ModelError:
        raise
    except Exception as exc:  # a damaged file, an unsupported quantization: the gguf package raises anything
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelError(f"{display} could not be converted: {text}") from exc

    _write_folder(target, config, tokenizer, {"source": str(gguf_path), "dequantized_from": "gguf"}, tensors)
    return target


def _write_folder(target: Path, config, tokenizer, marker: dict, tensors: dict | None = None) -> None:
    """Writes config, tokenizer, weights (if any) and kvpage.json into `target`, atomically: a
    temporary folder beside it, renamed into place."""
    from safetensors.torch import save_file

    private_dir(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if tensors is not None:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "kvpage.json").write_text(json.dumps({"format": CACHE_FORMAT, **marker}, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dequantize(gguf_path: Path, config, spec, on_event: EventCallback | None):
    """The GGUF's tensors dequantized to fp32 under their Hugging Face names, and its tokenizer."""
    from gguf import dequantize
    from transformers import AutoTokenizer

    display = gguf_path.name
    reader, gguf_arch, gguf_to_hf, hf_names = _open(gguf_path, config, spec)
    emit(on_event, ModelLoading(display, "dequantizing weights (once; cached afterwards)"))
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf.get(tensor.name)
        if hf_name is None:
            continue
        weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        heads = _permuted_heads(gguf_arch, tensor.name, spec)
        if heads:
            weights = _unpermute_rope(weights, heads)
        if gguf_arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
            weights = weights - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(weights))
    _check_complete(display, hf_names, tensors, spec)

    emit(on_event, ModelLoading(display, "converting the tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False)
    return tensors, tokenizer


def load_blocks(gguf_path: Path, config, spec, on_event: EventCallback | None = None) -> dict:
    """The GGUF's tensors under their Hugging Face names without expanding them: each matrix a
    QuantMatrix over the file's own blocks (memory-mapped: the file's pages are the weights),
    each vector (norms, biases) an fp32 tensor."""
    from gguf import dequantize

    from .quant import QuantMatrix

    display = gguf_path.name
    emit(on_event, ModelLoading(display, "mapping the GGUF file's quantized weights"))
    try:
        reader, gguf_arch, gguf_to_hf, hf_names = _open(gguf_path, config, spec)
        tensors: dict = {}
        for tensor in reader.tensors:
            hf_name = gguf_to_hf.get(tensor.name)
            if hf_name is None:
                continue
            shape = [int(n) for n in tensor.shape]  # GGUF order: inputs first
            if len(shape) == 1:
                values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
                if gguf_arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
                    values = values - 1.0
                tensors[hf_name] = torch.from_numpy(values)
                continue
            cols, rows = shape[0], int(np.prod(shape[1:]))
            data = tensor.data.view(np.uint8).reshape(rows, -1)
            heads = _permuted_heads(gguf_arch, tensor.name, spec)
            perm = torch.from_numpy(_unpermute_rope(np.arange(rows), heads).copy()) if heads else None
            tensors[hf_name] = QuantMatrix(int(tensor.tensor_type), data, rows, cols, perm)
    except ModelError:
        raise
    except Exception as exc:  # a damaged file: the gguf package raises anything
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelError(f"{display} could not be read: {text}") from exc
    _check_complete(display, hf_names, tensors, spec)
    return tensors


def ensure_metadata(gguf_path: Path, target: Path, on_event: EventCallback | None = None) -> Path:
    """A folder with the config and tokenizer transformers derives from `gguf_path` (no weights:
    those stay in the file), made once."""
    from filelock import FileLock
    from transformers import AutoConfig, AutoTokenizer

    private_dir(target.parent)
    sweep_leftovers(target.parent, _TMP_PREFIX)
    if (target / "kvpage.json").exists():
        return target
    with FileLock(str(target) + ".lock"):
        if (target / "kvpage.json").exists():
            return target
        display = gguf_path.name
        emit(on_event, ModelLoading(display, "reading GGUF metadata and tokenizer (once; cached afterwards)"))
        try:
            config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                      trust_remote_code=False)
        except Exception as exc:
            raise ModelError(f"{display} could not be read as a GGUF model: {exc}") from exc
        _write_folder(target, config, tokenizer, {"source": str(gguf_path), "weights": "in the source file"})
    return target


def _open(gguf_path: Path, config, spec):
    """The file's reader, architecture, GGUF -> Hugging Face tensor names, and the names wanted."""
    from gguf import GGUFReader, get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    hf_names = list(skeleton.state_dict().keys())
    reader = GGUFReader(str(gguf_path))
    gguf_arch = str(reader.fields["general.architecture"].contents())
    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_arch), None)
    if arch_id is None:
        raise ModelError(f"{gguf_path.name}: GGUF architecture {gguf_arch!r} is not known to the gguf package")
    name_map = get_tensor_name_map(arch_id, spec.num_layers)
    gguf_to_hf = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            gguf_to_hf[f"{gguf_base}.{suffix}"] = hf_name
    return reader, gguf_arch, gguf_to_hf, hf_names


def _permuted_heads(gguf_arch: str, name: str, spec) -> int:
    """llama.cpp permutes the Q and K rows of llama-architecture files: their head count, else 0."""
    if gguf_arch != "llama":
        return 0
    if ".attn_q." in name:
        return spec.num_heads
    if ".attn_k." in name:
        return spec.num_kv_heads
    return 0


def _check_complete(display: str, hf_names: list[str], tensors: dict, spec) -> None:
    missing = [n for n in hf_names if n not in tensors and not (n == "lm_head.weight" and spec.tie_embeddings)]
    if missing:
        raise ModelError(f"{display}: tensors missing from the GGUF file: {', '.join(missing[:5])}")


def _unpermute_rope(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split rotary layout)."""
    dim = weights.shape[0] // heads // 2
    w = weights.reshape(heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)
