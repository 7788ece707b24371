"""`kvpage info`: what a model costs on the paged KV cache, and where it runs."""

from __future__ import annotations

import json

from ..engine import ALIASES, BLOCK_TOKENS, Engine
from ..engine.config import SMALL_ROWS
from ..engine.model.spec import KV_ELEMENT_BYTES
from ..tasks.retrieval import budget_bounds, question_budget
from . import ranks
from .options import MODEL, OUTPUT, RUN, Options, shared_options
from .output import Sink, check_out_path, choose_format
from .session import MIB, Session, pool_capacity_bytes

FORMATS = ("text", "json")


@shared_options(MODEL, OUTPUT, RUN)
def info(*, opts: Options) -> None:
    """Show the model, its context limit, KV bytes per token, pool and store sizes, device and backend.

    Loads the model and prints what the engine would run with: architecture, context limit, KV
    bytes per token in float32 and bfloat16, the pool (MiB and 64-token slots per layer), the store
    in use, the weights (their format and the memory they take; a GGUF file's blocks are mapped,
    not read, so this is cheap even for a large file), the device, the attention backend and how
    exact mode reaches blocks. With --weights float32 a GGUF file is dequantized once, into
    KVPAGE_HOME or ~/.cache/kvpage.

    Examples:

    ```
    kvpage info
    kvpage info --model gemma3-270m --dtype bfloat16 --pool-mib 16
    kvpage info --model ./Llama-3.2-3B-Instruct-Q4_K_M.gguf
    kvpage info --model ./my-model-folder --json
    kvpage info --tp 2
    ```

    With --tp N the model is split over N processes, and each rank's heads, KV bytes per token
    and weights (measured in that rank) are listed.
    """
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS)
    check_out_path(opts.out)
    sink = Sink(opts.out, opts.no_color)
    with Session(opts) as session:
        engine = session.load_engine()
        data = describe(engine, opts.model)
        shares = ranks.gather({"heads": engine.spec.num_heads, "kv_heads": engine.spec.num_kv_heads,
                               "kv_bytes_per_token": engine.kv_bytes_per_token(),
                               "weights_mib": round(engine.runner.weight_bytes / MIB, 1)})
        if len(shares) > 1:
            data["tp_ranks"] = [{"rank": r, **share} for r, share in enumerate(shares)]
        session.reporter.stop_bars()
        if fmt == "json":
            sink.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        else:
            sink.write(_text(data))
        sink.commit()


def describe(engine: Engine, source: str) -> dict:
    """The model (whole, also when split over ranks) and this process's engine."""
    spec = engine.runner.full_spec
    kv_dtype = engine.kv_dtype_name
    stats = engine.stats()
    windows = sorted({layer.window for layer in spec.layers if layer.window})
    alias = ALIASES.get(source)
    return {
        "model": engine.name,
        "description": alias.description if alias else None,
        "architecture": spec.arch,
        "layers": spec.num_layers,
        "sliding_window_layers": sum(1 for layer in spec.layers if layer.window),
        "sliding_windows": windows,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "context_limit": engine.max_context,
        "dtype": engine.config.dtype,
        "kv_dtype": kv_dtype,
        "kv_dtype_option": engine.config.kv_dtype,
        "kv_bytes_per_token": spec.kv_bytes_per_token(kv_dtype),
        "kv_bytes_per_token_by_dtype": {d: spec.kv_bytes_per_token(d) for d in KV_ELEMENT_BYTES},
        "kv_bytes_per_token_full_attention_layers": spec.kv_bytes_per_token(kv_dtype, full_layers_only=True),
        "block_tokens": BLOCK_TOKENS,
        "pool_mib": round(pool_capacity_bytes(engine) / MIB, 2),
        "pool_slots_per_layer": engine.pool.num_slots,
        "store_mib": round(stats.store_bytes / MIB, 2),
        "weights_mib": round(stats.weight_bytes / MIB, 1),
        "weights": engine.runner.weights,
        "weights_option": engine.config.weights,
        "activations": engine.config.activations,
        "int8_activation_formats": engine.runner.int8_activation_formats(),
        "weights_mib_by_format": {name: round(size / MIB, 1) for name, size in engine.runner.weight_formats().items()},
        "weights_float32_mib_computed": round(engine.runner.weight_values() * 4 / MIB, 1),
        "device": str(engine.device),
        "backend": engine.backend.name,
        "prefill_attention": _prefill_attention(engine),
        "tile_products": _tile_products(engine),
        "kv_path": engine.kv_path,
        "mode": engine.config.mode,
        # retrieval mode: the most document tokens a question reads, before its own tokens are taken
        "retrieval_tokens": question_budget(engine, 0) * BLOCK_TOKENS,
        "retrieval_bound": _retrieval_bound(engine),
    }


def _prefill_attention(engine: Engine) -> str | None:
    """What computes a prompt's attention on a CPU's native backend (None elsewhere: the backend says)."""
    backend = engine.backend
    if backend.name != "native" or engine.kv_path != "store":
        return None
    from ..engine import native

    head_dim = engine.spec.head_dim
    short = f"; segments of {SMALL_ROWS} tokens or fewer: the decode kernel, a query per token"
    if engine.kv_dtype_name != "bfloat16":
        return f"torch's float32 flash attention (KV in {engine.kv_dtype_name}; prefill.c reads bfloat16 KV){short}"
    if head_dim % 64:
        return f"torch's float32 flash attention (head dim {head_dim}; prefill.c takes multiples of 64){short}"
    if not native.has_bf16_prefill(backend.lib):
        return f"torch's float32 flash attention (this CPU has no AVX512-BF16 for prefill.c){short}"
    if native.prefill_amx(backend.lib):
        return "bfloat16 tile products (prefill.c, AMX; a batch's generated tokens too, over blocks they share)"
    return "bfloat16 dot products (prefill.c, AVX512-BF16)"


def _tile_products(engine: Engine) -> list[str]:
    """The weight formats whose products run on AMX tiles for a batch's generated tokens and long
    prompt chunks (native backend, a CPU with AMX)."""
    lib = engine.runner.native
    if engine.backend.name != "native" or lib is None:
        return []
    from ..engine import native
    from ..engine.model.quant import NAMES, TILE_FORMATS

    if not native.qgemm_tiles(lib):
        return []
    return sorted({NAMES[q] for q in TILE_FORMATS} & set(engine.runner.weight_formats()))


def _retrieval_bound(engine: Engine) -> str:
    """What sets the retrieval budget: the least of its bounds."""
    bounds = budget_bounds(engine)
    return min(bounds, key=bounds.get)


def _weights(d: dict) -> str:
    parts = ", ".join(f"{name} {mib:,.1f} MiB" for name, mib in d["weights_mib_by_format"].items())
    kept = {"gguf": "the GGUF file's own blocks, mapped from the file", "float32": f"{d['dtype']}",
            "bfloat16": "bfloat16, made at load", "int8": "int8 with a scale per output channel, made at load",
            "int4": "int4 in groups of 32 (Q4_1), made at load"}[d["weights"]]
    if d["backend"] == "triton" and d["weights"] != "float32":
        kept = (f"{d['weights']} decoded at load to integers (of 4 bits or fewer: two a byte) with a scale and an "
                "offset per group, for the Triton kernels")
    how = (f"--weights auto chose {d['weights']}" if d["weights_option"] == "auto" else f"--weights {d['weights']}")
    text = f"{d['weights_mib']:,.1f} MiB as {kept} ({parts}); {how}"
    if d["weights"] != "float32":
        text += f"; float32 would take {d['weights_float32_mib_computed']:,.1f} MiB (computed)"
    if d["weights"] in ("gguf", "int8", "int4") and d["backend"] == "triton":
        text += "; the Triton kernels dequantize them in registers and multiply float32 activations"
    elif d["weights"] in ("gguf", "int8", "int4"):  # quantized: integer dot products can apply
        rounded = d["int8_activation_formats"]
        if d["activations"] == "int8":
            text += "; decoding multiplies them with int8 activations (--activations int8)"
        elif rounded:
            text += (f"; {' and '.join(rounded)} products round activations to int8, decoding and prompts alike, "
                     "as llama.cpp does (--activations auto; float32: the weights' exact values times fp32 "
                     "activations, slower)")
            if len(rounded) < len(d["weights_mib_by_format"]):
                text += "; the other formats' multiply float32 activations"
        else:
            text += "; decoding multiplies them with float32 activations (--activations int8: faster, rounded)"
    if d["tile_products"] and d["activations"] != "int8":
        text += (f"; {' and '.join(d['tile_products'])} products on AMX tiles for a batch's generated tokens "
                 "(from 8) and prompt chunks over 64 tokens")
    return text


def _kv_how(d: dict) -> str:
    if d["kv_dtype_option"] != "auto":
        return ""
    return " (--kv-dtype auto: beside quantized weights)" if d["kv_dtype"] != d["dtype"] else " (--kv-dtype auto)"


def _text(d: dict) -> str:
    kv = d["kv_bytes_per_token_by_dtype"]
    arch = (f"{d['architecture']}: {d['layers']} layers, {d['heads']} heads, {d['kv_heads']} KV heads, "
            f"head dim {d['head_dim']}, hidden {d['hidden_size']}, vocab {d['vocab_size']:,}")
    if d["sliding_window_layers"]:
        arch += f"; {d['sliding_window_layers']} sliding-window layers (window {', '.join(map(str, d['sliding_windows']))})"
    rows = [
        ("model", d["model"] + (f" ({d['description']})" if d["description"] else "")),
        ("architecture", arch),
        ("context limit", f"{d['context_limit']:,} tokens"),
        ("kv per token", f"{d['kv_bytes_per_token']:,} bytes ({d['kv_bytes_per_token'] / 1024:.1f} KiB) in {d['kv_dtype']}"
                         + _kv_how(d) + "; "
                         + ", ".join(f"{name} {value:,}" for name, value in kv.items()) + " (int8: with each row's scale)"
                         + (f"; full-attention layers only {d['kv_bytes_per_token_full_attention_layers']:,} "
                            "(sliding layers keep a fixed window)" if d["sliding_window_layers"] else "")),
        ("pool", f"{d['pool_mib']:,.1f} MiB, {d['pool_slots_per_layer']:,} slots of {d['block_tokens']} tokens per layer"),
        ("store", f"{d['store_mib']:,.1f} MiB in use"),
        ("weights", _weights(d)),
        ("device", d["device"]),
        ("backend", d["backend"] + (f"; prompt attention: {d['prefill_attention']}" if d["prefill_attention"] else "")),
        ("kv path", d["kv_path"]),
        ("mode", d["mode"]),
        ("retrieval", f"a question over a document longer than the context reads at most {d['retrieval_tokens']:,} "
                      f"tokens of it (set by {d['retrieval_bound']}; fewer where the prompt leaves less room)"),
    ]
    if d.get("tp_ranks"):
        rows.append(("tensor parallel", f"{len(d['tp_ranks'])} ranks; " + "; ".join(
            f"rank {r['rank']}: {r['heads']} heads, {r['kv_heads']} KV head{'s' * (r['kv_heads'] != 1)}, "
            f"{r['kv_bytes_per_token']:,} KV bytes "
            f"per token, weights {r['weights_mib']:,.1f} MiB" for r in d["tp_ranks"])
            + " (pool, store and weights above are rank 0's)"))
    width = max(len(name) for name, _ in rows)
    return "".join(f"{name:<{width}}  {value}\n" for name, value in rows)
