"""GGUF files: their weights as the file keeps them, or converted to a Hugging Face folder.

With `weights="gguf"` the matrices stay in the file's quantized blocks, memory-mapped
(`load_blocks`); only the config and tokenizer transformers derives from the file are cached
(`ensure_metadata`). With float weights the file is dequantized once to fp32 and written beside
that tokenizer and config (`ensure_converted`); later loads read that folder and take seconds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ModelError
from ..events import EventCallback, ModelLoading, emit
from ..home import private_dir, sweep_leftovers

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
    _check_readable(gguf_path)
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for unknown or broken files
        raise ModelError(f"{display} could not be read as a GGUF model: {exc}") from exc

    # Local import: spec_from_config raises the clear "unsupported architecture" error.
    from .spec import spec_from_config

    spec = spec_from_config(config)
    try:
        tensors, tokenizer = _dequantize(gguf_path, spec, on_event)
    except ModelError:
        raise
    except Exception as exc:  # a damaged file, an unsupported quantization: the gguf package raises anything
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelError(f"{display} could not be converted: {text}") from exc

    _write_folder(target, config, tokenizer, {"source": str(gguf_path), "dequantized_from": "gguf"}, tensors)
    return target


def _check_readable(gguf_path: Path) -> None:
    """A ModelError naming the file and what is wrong with it when its header or tensor table is
    damaged (transformers' reader would fail later, or with a numpy error about shapes)."""
    try:
        GGUFHeader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{gguf_path.name} could not be read as a GGUF model: {exc}") from exc


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


def _dequantize(gguf_path: Path, spec, on_event: EventCallback | None):
    """The GGUF's tensors dequantized to fp32 under their Hugging Face names, and its tokenizer."""
    from gguf import dequantize
    from transformers import AutoTokenizer

    display = gguf_path.name
    reader, gguf_arch, gguf_to_hf, hf_names = _open(gguf_path, spec)
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


def load_blocks(gguf_path: Path, spec, on_event: EventCallback | None = None) -> dict:
    """The GGUF's tensors under their Hugging Face names without expanding them: each matrix a
    QuantMatrix over the file's own blocks (memory-mapped: the file's pages are the weights),
    each vector (norms, biases) an fp32 tensor."""
    from gguf import dequantize

    from .quant import QuantMatrix

    display = gguf_path.name
    emit(on_event, ModelLoading(display, "mapping the GGUF file's quantized weights"))
    try:
        reader, gguf_arch, gguf_to_hf, hf_names = _open(gguf_path, spec)
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

    private_dir(target.parent)
    sweep_leftovers(target.parent, _TMP_PREFIX)
    if (target / "kvpage.json").exists():
        return target
    from transformers import AutoConfig, AutoTokenizer

    with FileLock(str(target) + ".lock"):
        if (target / "kvpage.json").exists():
            return target
        display = gguf_path.name
        emit(on_event, ModelLoading(display, "reading GGUF metadata and tokenizer (once; cached afterwards)"))
        _check_readable(gguf_path)
        try:
            with _metadata_parsed_once():
                config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    trust_remote_code=False)
                tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                          trust_remote_code=False)
        except Exception as exc:
            raise ModelError(f"{display} could not be read as a GGUF model: {exc}") from exc
        _write_folder(target, config, tokenizer, {"source": str(gguf_path), "weights": "in the source file"})
    return target


@contextmanager
def _metadata_parsed_once():
    """transformers parses a GGUF file's metadata for the config, then again for the tokenizer's
    config, through the gguf package's reader wherever its own faster reader does not cover the
    architecture (Gemma 3: 12 s each here): inside this block the second parse is a copy of the
    first. Where transformers has no such function, nothing changes."""
    try:
        import transformers.modeling_gguf_pytorch_utils as module
    except ImportError:
        yield
        return
    original = getattr(module, "load_gguf_checkpoint", None)
    if original is None:
        yield
        return
    parsed: dict[str, Any] = {}

    def once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original(path, return_tensors, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = original(path, return_tensors=False)
        return copy.deepcopy(parsed[key])  # each caller may change what it gets

    module.load_gguf_checkpoint = once
    try:
        yield
    finally:
        module.load_gguf_checkpoint = original


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its dims in GGUF order (inputs first), its block type, and its
    bytes (or values, for the plain types) mapped from the file, shaped as gguf.GGUFReader shapes them."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFHeader:
    """A GGUF file's metadata and tensor table, read without reading its arrays.

    gguf.GGUFReader makes a numpy view for every element of every metadata array, and a
    tokenizer's vocabulary is hundreds of thousands of elements: Gemma 3's file took 30-46 s to
    open with it. Here an array of numbers is skipped by its length and an array of strings by
    reading only each string's length; `fields` holds the scalars and strings (arrays are absent).
    The layout is the GGUF specification's (github.com/ggml-org/ggml, docs/gguf.md), versions 2-3,
    little-endian."""

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

        self.data = np.memmap(path, mode="r")
        self.header = memoryview(self.data)  # struct reads it far faster than numpy slices
        self.fields: dict[str, Any] = {}
        self._offset = 0
        if self._scalar("<u4") != 0x46554747:  # "GGUF"
            raise ValueError("not a GGUF file (bad magic)")
        version = self._scalar("<u4")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file: only little-endian files are read")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = self._scalar("<u8"), self._scalar("<u8")
        scalars = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
                   GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
                   GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
                   GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
        for _ in range(kv_count):
            key = self._string()
            kind = GGUFValueType(self._scalar("<u4"))
            if kind == GGUFValueType.STRING:
                self.fields[key] = self._string()
            elif kind == GGUFValueType.ARRAY:
                item, count = GGUFValueType(self._scalar("<u4")), self._scalar("<u8")
                if item == GGUFValueType.STRING:
                    self._skip_strings(count)
                elif item in scalars:
                    self._offset += count * np.dtype(scalars[item]).itemsize
                else:
                    raise ValueError(f"metadata {key!r}: arrays of {item.name} are not supported")
            else:
                value = self._scalar(scalars[kind])
                self.fields[key] = bool(value) if kind == GGUFValueType.BOOL else value
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._scalar("<u8") for _ in range(self._scalar("<u4")))
            infos.append((name, dims, GGMLQuantizationType(self._scalar("<u4")), self._scalar("<u8")))
        alignment = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid alignment {alignment!r}: must be a power of two")
        start = -(-self._offset // alignment) * alignment
        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            elements = int(np.prod(dims))
            block, size = GGML_QUANT_SIZES[kind]
            if elements % block:
                raise ValueError(f"tensor {name}: {elements} values are not whole blocks of {block}")
            begin = start + offset
            if kind in plain:
                dtype, count, shape = plain[kind], elements, tuple(reversed(dims))
            else:  # rows of blocks' bytes
                dtype, count = np.uint8, elements // block * size
                shape = (*reversed(dims[1:]), dims[0] // block * size)
            end = begin + count * np.dtype(dtype).itemsize
            if end > self.data.size:
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, dims, kind, self.data[begin:end].view(dtype).reshape(shape)))

    def _skip_strings(self, count: int) -> None:
        """Steps over `count` strings (each its u64 length, then its bytes) without reading them:
        a vocabulary is 50K-260K of them, so one tight loop rather than a call each."""
        unpack, buffer, offset = _U64.unpack_from, self.header, self._offset
        try:
            for _ in range(count):
                offset += 8 + unpack(buffer, offset)[0]
        except struct.error:
            raise ValueError("the GGUF header ends early (truncated file?)") from None
        if offset > len(buffer):
            raise ValueError("the GGUF header ends early (truncated file?)")
        self._offset = offset

    def _scalar(self, dtype: str):
        (value,) = _unpack(self.header, self._offset, dtype)
        self._offset += int(dtype[2])
        return value

    def _string(self) -> str:
        length = self._scalar("<u8")
        if self._offset + length > len(self.header):
            raise ValueError("the GGUF header ends early (truncated file?)")
        text = self.header[self._offset:self._offset + length].tobytes().decode("utf-8", errors="replace")
        self._offset += length
        return text


_U64 = struct.Struct("<Q")
_STRUCT = {"<u1": "<B", "<i1": "<b", "<u2": "<H", "<i2": "<h", "<u4": "<I", "<i4": "<i", "<f4": "<f", "<u8": "<Q",
           "<i8": "<q", "<f8": "<d"}


def _unpack(buffer, offset: int, dtype: str):
    try:
        return struct.unpack_from(_STRUCT[dtype], buffer, offset)
    except struct.error:
        raise ValueError("the GGUF header ends early (truncated file?)") from None


def _open(gguf_path: Path, spec):
    """The file's reader, architecture, GGUF -> Hugging Face tensor names, and the names wanted."""
    from gguf import get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES

    hf_names = list(spec.tensor_names())
    reader = GGUFHeader(gguf_path)
    gguf_arch = reader.fields.get("general.architecture")
    if not isinstance(gguf_arch, str):
        raise ModelError(f"{gguf_path.name}: the GGUF file names no architecture (general.architecture)")
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
