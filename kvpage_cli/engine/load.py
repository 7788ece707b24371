"""Loading an engine: the device, the attention backend, the weights' format, the model runner,
and the fingerprint of how its KV is computed (which names its saved KV)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from kvpage_kernels.constants import HEAD_DIMS as TRITON_HEAD_DIMS

from ..errors import ModelError, UsageError
from . import native
from .attention.backend import NativeBackend, TorchBackend, TritonBackend
from .config import EngineConfig, kv_dtype_of
from .events import EngineWarning, EventCallback, emit
from .home import default_home
from .kv.saved.keys import model_fingerprint
from .model.parallel import Shard
from .model.quant import UnsupportedFormat
from .model.runner import ModelRunner
from .model.weights import DEFAULT_MODEL, gguf_file, load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def load(engine_class, source=DEFAULT_MODEL, config: EngineConfig | None = None, *, tokenizer=None,
         on_event: EventCallback | None = None, observer=None):
    """Loads a model into a new `engine_class` (`Engine.load` calls this): an alias ("smollm2",
    "gemma3-270m"), a Hugging Face folder, a .gguf file, or an in-memory transformers
    PreTrainedModel (then pass its tokenizer, if any)."""
    config = config or EngineConfig()
    home = Path(config.home).expanduser() if config.home else default_home()
    if config.threads:
        torch.set_num_threads(config.threads)
    device = _resolve_device(config)
    backend_name, native_lib, triton_ops = _resolve_backend(config.backend, device, home, on_event)
    if backend_name == "triton" and config.kv_dtype not in ("auto", config.dtype):
        raise UsageError(f"--kv-dtype {config.kv_dtype} with --dtype {config.dtype} runs on the native and torch "
                         "backends; the Triton kernels read KV of the compute dtype")
    if backend_name == "triton" and config.weights not in ("auto", "float32") and native_lib is None:
        try:  # quantized weights for the Triton kernels are decoded once at load, by the native decoder
            native_lib = native.load(home)
        except native.NativeUnavailable as exc:
            raise UsageError(f"{config.weights} weights on the Triton kernels are decoded at load by the native "
                             f"kernels, which are unavailable: {exc}") from exc
    weights_format = _resolve_weights(config.weights, source, home, native_lib, device, on_event)
    try:
        weights = load_weights(source, home, on_event, tokenizer, blocks=weights_format == "gguf")
    except UnsupportedFormat as exc:
        if config.weights != "auto":
            raise
        emit(on_event, EngineWarning(f"{exc}; using float32 weights (dequantized once)"))
        weights_format = "float32"
        weights = load_weights(source, home, on_event, tokenizer)
    spec = weights.spec
    if backend_name == "triton" and spec.head_dim not in TRITON_HEAD_DIMS:
        if config.backend == "triton" or weights_format != "float32":
            raise UsageError(f"the Triton kernels take head dims {', '.join(map(str, TRITON_HEAD_DIMS))}; this "
                             f"model's is {spec.head_dim}: use backend 'torch' with float32 weights")
        emit(on_event, EngineWarning(f"the Triton kernels take head dims {', '.join(map(str, TRITON_HEAD_DIMS))}, "
                                     f"not this model's {spec.head_dim}: using the slower torch backend"))
        backend_name, triton_ops = "torch", None
    dtype = DTYPES[config.dtype]
    rope = weights.rope
    # the split path also runs for a process group of one rank (torchrun --nproc-per-node 1:
    # bench/gpu_check.sh tries NCCL so); a caller's own larger group with tp 1 is left alone
    shard = Shard.current(config.tp) if config.tp > 1 or _process_group_size() == 1 else None
    runner = ModelRunner(spec, weights.tensors, rope, dtype, device, native_lib, weights_format, shard,
                         config.activations, kernels=triton_ops if backend_name == "triton" else None)
    del weights.tensors
    spec = runner.spec  # a rank's own heads: its store, pool and kernels hold and read only those
    kv_dtype = kv_dtype_of(config, weights_format, backend_name)
    if backend_name == "native":
        backend = NativeBackend(native_lib, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale,
                                kv_dtype)
    elif backend_name == "triton":
        backend = TritonBackend(triton_ops, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale)
    else:
        backend = TorchBackend(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale)
    kv_path = config.kv_path
    if kv_path == "auto":
        kv_path = "store" if device.type == "cpu" else "pool"
    if kv_path == "store" and device.type != "cpu":
        raise UsageError("kv_path='store' reads blocks in place and needs the store on the compute device (cpu)")
    if backend_name == "triton" and kv_path == "store":
        kv_path = "pool"  # the Triton kernels read pool slots
    if config.max_context and config.max_context > spec.max_position:
        emit(on_event, EngineWarning(f"max_context {config.max_context} is beyond the {spec.max_position} "
                                     "positions the model was trained on; expect worse answers past that"))
    # the weights' format changes the KV they compute: it is part of the saved KV's key
    computed = config.dtype if weights_format == "float32" else f"{config.dtype}|{weights_format} weights"
    if config.activations == "int8":
        computed += "|int8 activations"
    elif config.activations == "auto" and runner.int8_activation_formats():  # else auto multiplies float32
        computed += f"|int8 activations for {','.join(runner.int8_activation_formats())}"
    if kv_dtype != config.dtype:
        computed += f"|{kv_dtype} KV"
    if runner.native_layers is not None:  # decode rows' norms and SiLU are rounded as layer.c rounds them
        computed += "|native layers"
    if shard is not None:  # the all-reduce's order changes the bits; each rank saves its own heads' share
        computed += f"|tensor-parallel over {shard.world} ranks"
    fingerprint = model_fingerprint(weights.fingerprint, computed, rope)
    engine_ref: list = []
    draft = None
    if config.draft_model and config.mode == "selective":
        draft = load(engine_class, config.draft_model, replace(config, mode="exact", draft_model=None, kv_cache=False,
                                                     host_mib=None), on_event=on_event,
                         observer=lambda *args: engine_ref[0]._draft_observed(*args))
        if draft.spec.vocab_size != spec.vocab_size:
            raise ModelError(f"the draft model {config.draft_model} must share the model's tokenizer "
                             f"(vocabularies of {draft.spec.vocab_size} and {spec.vocab_size} tokens)")
    engine = engine_class(weights.name, spec, runner, weights.tokenizer, config, device, backend, kv_path, home,
                 fingerprint, kv_dtype, draft, observer)
    engine_ref.append(engine)
    return engine


def _process_group_size() -> int:
    """Ranks of the running torch.distributed process group (0: none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0


def _resolve_device(config: EngineConfig) -> torch.device:
    """auto: CUDA when torch sees a GPU, unless the backend or KV path asked for runs on the CPU
    alone (native kernels; blocks read in place in the store), which then picks the CPU."""
    name = config.device
    if name == "auto":
        cpu_only = config.backend == "native" or config.kv_path == "store"
        return torch.device("cuda" if torch.cuda.is_available() and not cpu_only else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _resolve_backend(name: str, device: torch.device, home: Path, on_event: EventCallback | None):
    if name == "auto":
        if device.type == "cuda":
            try:
                return "triton", None, _triton_ops()
            except ModelError:
                return "torch", None, None
        try:
            return "native", native.load(home), None
        except native.NativeUnavailable as exc:
            emit(on_event, EngineWarning(f"native CPU kernels unavailable ({exc}); using the slower torch backend"))
            return "torch", None, None
    if name == "native":
        if device.type != "cpu":
            raise UsageError("the native backend runs on the CPU; use backend 'triton' or 'torch' on CUDA")
        try:
            return "native", native.load(home), None
        except native.NativeUnavailable as exc:
            raise UsageError(f"the native backend is unavailable: {exc}") from exc
    if name == "triton":
        return "triton", None, _triton_ops()
    return "torch", None, None


def _resolve_weights(name: str, source, home: Path, native_lib, device: torch.device,
                     on_event: EventCallback | None) -> str:
    """The weights' format: "auto" keeps a GGUF file's own blocks where the native kernels run
    (faster and smaller than fp32: see bench/engine.py --weights), float32 otherwise (on a GPU the
    Triton kernels read quantized weights too, when asked for: not yet measured against fp32)."""
    if name == "auto":
        if native_lib is None or device.type != "cpu":
            return "float32"
        try:
            return "gguf" if gguf_file(source, home, on_event) is not None else "float32"
        except ModelError:
            return "float32"  # loading the source raises the error that says what is wrong with it
    if name != "float32" and native_lib is None:
        raise UsageError(f"{name} weights run on the native CPU kernels or the Triton kernels, and this engine "
                         f"runs on neither (device {device.type}); use float32 weights here")
    return name


def _triton_ops():
    try:
        import kvpage_kernels
    except ImportError as exc:  # pragma: no cover - kvpage_kernels ships with kvpage
        raise ModelError(f"the Triton kernels cannot be imported: {exc}") from exc
    if not getattr(kvpage_kernels, "HAS_TRITON", False):
        raise ModelError("the triton backend needs the triton package: pip install triton")
    return kvpage_kernels
