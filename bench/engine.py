"""Engine benchmark: kvpage (exact mode, small pool) beside transformers (and llama.cpp where installed).

A context of N tokens is a prompt of N - 128 tokens and 128 generated ones (so that 8K fits
SmolLM2's 8192-token limit). The same prompt token ids go through every system, each in its own process so that peak RSS
belongs to one system. Prefill and decode are timed around whole runs (prefill: the prompt;
decode: 128 greedy tokens, each fed back). Run:

    python bench/engine.py                       # SmolLM2 at 1K/4K/8K, Gemma 3 270M at 8K/16K/32K
    python bench/engine.py --models smollm2 --contexts 4096 --json out.json
    python bench/engine.py --models smollm2 --kv-paths store --weights gguf,float32,int8,int4,bfloat16
    python bench/engine.py --models smollm2 --kv-paths store --weights gguf,gguf:int8   # :int8 = --activations int8
    python bench/engine.py --models smollm2 --kv-paths store --weights gguf --kv-dtypes auto,bfloat16
    python bench/engine.py --device cuda --models FILE.gguf --contexts 1024,8192 --kv-paths auto \
        --weights float32,gguf --systems kvpage,transformers     # on a GPU: both systems there

--models takes aliases, Hugging Face folders and .gguf files (a path needs --contexts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (add_json_option, bench_device, import_error, peak_device_mib, peak_rss_mib,  # noqa: E402
                    prompt_ids, read_bandwidth_gbs, run_worker, sync, table, write_result)

DEFAULT_CONTEXTS = {"smollm2": [1024, 4096, 8192], "gemma3-270m": [8192, 16384, 32768]}


def worker_kvpage(model: str, length: int, new_tokens: int, dtype: str, pool_mib: float, kv_path: str, home: str | None,
                  weights: str = "auto", kv_dtype: str = "auto", device: str = "cpu") -> dict:
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.config import default

    started = time.perf_counter()
    weights, _, activations = weights.partition(":")
    engine = Engine.load(model, EngineConfig(pool_mib=pool_mib, dtype=dtype, kv_path=kv_path, home=home, weights=weights,
                                             activations=activations or default("activations"), kv_dtype=kv_dtype,
                                             device=device))
    load_s = time.perf_counter() - started
    ids = prompt_ids(engine.tokenizer, length - new_tokens)
    list(engine.generate(engine.prefill(ids[:80]), max_new_tokens=2, stop=()))  # warm-up: first calls, kernels
    engine.reset_stats()
    sync(device)
    started = time.perf_counter()
    ctx = engine.prefill(ids)
    sync(device)
    prefill_s = time.perf_counter() - started
    tokens = []
    started = time.perf_counter()
    for token in engine.generate(ctx, max_new_tokens=new_tokens, stop=()):
        tokens.append(token)
    decode_s = time.perf_counter() - started
    stats = engine.stats()
    return {
        "system": "kvpage",
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": (new_tokens - 1) / stats.decode_seconds,
        "decode_wall_tok_s": new_tokens / decode_s,
        "pool_mib": stats.pool_bytes / 2**20 if stats.pool_bytes else (engine.pool.num_slots * engine.spec.num_layers * engine.pool.slot_bytes) / 2**20,
        "pool_slots": stats.pool_slots_per_layer,
        "store_mib": stats.store_bytes / 2**20,
        "weight_mib": stats.weight_bytes / 2**20,
        "kv_bytes_per_token": engine.kv_bytes_per_token(),
        "path": f"{stats.backend}/{stats.kv_path}",
        "weights": engine.runner.weights + (f" + {activations} act." if activations else "")
                   + (f" + {engine.kv_dtype_name} KV" if engine.kv_dtype_name != dtype else ""),
        "kv_dtype": engine.kv_dtype_name,
        "load_s": load_s,
        "blocks_moved": stats.blocks_moved,
        "peak_rss_mib": peak_rss_mib(),
        "peak_device_mib": peak_device_mib(device),
        "tokens": tokens,
    }


def worker_transformers(model: str, length: int, new_tokens: int, dtype: str, home: str | None, device: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kvpage_cli.engine.home import default_home
    from kvpage_cli.engine.model.weights import resolve_folder

    folder = resolve_folder(model, Path(home) if home else default_home())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    reference = reference.to(device).eval()
    ids = prompt_ids(tokenizer, length - new_tokens)

    def greedy(prompt: list[int], count: int) -> tuple[list[int], float, float]:
        cache = DynamicCache(config=reference.config)
        with torch.no_grad():
            sync(device)
            started = time.perf_counter()
            out = reference(torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
            sync(device)
            prefill_s = time.perf_counter() - started
            token = int(out.logits[0, -1].argmax())
            tokens = [token]
            started = time.perf_counter()
            for _ in range(count - 1):
                out = reference(torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True,
                                logits_to_keep=1)
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
            decode_s = time.perf_counter() - started
        return tokens, prefill_s, decode_s

    greedy(ids[:80], 2)  # warm-up
    tokens, prefill_s, decode_s = greedy(ids, new_tokens)
    return {
        "system": "transformers",
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": (new_tokens - 1) / decode_s,
        "path": "sdpa/DynamicCache",
        "peak_rss_mib": peak_rss_mib(),
        "peak_device_mib": peak_device_mib(device),
        "tokens": tokens,
    }


def worker_llamacpp(model: str, length: int, new_tokens: int, home: str | None) -> dict:
    """llama.cpp on the model's own GGUF file (the one kvpage reads), all cores for prompt and decode."""
    import os

    from llama_cpp import Llama  # noqa: F401 - raises ImportError where llama.cpp is not installed

    from kvpage_cli.engine.home import default_home
    from kvpage_cli.engine.model.weights import gguf_file, resolve_folder

    gguf = gguf_file(model, Path(home) if home else default_home())
    if gguf is None:
        return {"system": "llama.cpp", "error": "no GGUF file for this model"}
    threads = os.cpu_count()
    llm = Llama(model_path=str(gguf), n_ctx=length + new_tokens + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=256, verbose=False)
    from transformers import AutoTokenizer

    ids = prompt_ids(AutoTokenizer.from_pretrained(resolve_folder(model, Path(home) if home else default_home())), length - new_tokens)
    started = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    tokens = []
    for _ in range(new_tokens):
        token = llm.sample(temp=0.0)
        tokens.append(int(token))
        llm.eval([token])
    decode_s = time.perf_counter() - started
    return {"system": "llama.cpp", "prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": new_tokens / decode_s,
            "path": gguf.name, "peak_rss_mib": peak_rss_mib(), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--contexts", default=None, help="comma-separated token counts (default: per model)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--pool-mib", type=float, default=8.0, help="kvpage pool size (far smaller than the KV)")
    parser.add_argument("--kv-paths", default="store,pool", help="kvpage paths to run: store (read in place), pool")
    parser.add_argument("--systems", default="kvpage,transformers,llama.cpp")
    parser.add_argument("--weights", default="auto", help="kvpage weight formats to run, comma-separated "
                                                          "(auto, float32, gguf, int8, int4, bfloat16; FORMAT:int8 adds --activations int8)")
    parser.add_argument("--kv-dtypes", default="auto", help="kvpage KV element types to run, comma-separated "
                        "(auto: --dtype; bfloat16 with float32 --dtype halves the KV bytes)")
    parser.add_argument("--home", default=None, help="KVPAGE_HOME for converted weights")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                        help="where kvpage and transformers compute (llama.cpp runs on the CPU)")
    add_json_option(parser)
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = bench_device(args.device)

    if args.worker is not None:
        system, model, length = args.worker[0], args.worker[1], int(args.worker[2])
        home = args.home
        if system == "kvpage":
            result = worker_kvpage(model, length, args.new_tokens, args.dtype, args.pool_mib, args.worker[3], home,
                                   args.worker[4], args.worker[5], device)
        elif system == "transformers":
            result = worker_transformers(model, length, args.new_tokens, args.dtype, home, device)
        else:
            try:
                result = worker_llamacpp(model, length, args.new_tokens, home)
            except ImportError as error:
                result = {"system": "llama.cpp", "error": import_error("llama_cpp", error)}
        print(json.dumps(result))
        return

    bandwidth = read_bandwidth_gbs(device=device)
    print(f"measured memory read bandwidth ({device}): {bandwidth:.1f} GB/s", flush=True)
    systems = args.systems.split(",")
    rows = []
    common = ["--new-tokens", str(args.new_tokens), "--dtype", args.dtype, "--pool-mib", str(args.pool_mib),
              "--device", device]
    if args.home:
        common += ["--home", args.home]
    for model in args.models.split(","):
        if not args.contexts and model not in DEFAULT_CONTEXTS:
            parser.error(f"--contexts is needed for {model} (defaults are known for {', '.join(DEFAULT_CONTEXTS)})")
        contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else DEFAULT_CONTEXTS[model]
        for length in contexts:
            base = {}
            if "transformers" in systems:
                base = run_worker(Path(__file__), ["transformers", model, str(length), *common])
                rows.append({"model": model, "context": length, **base})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
            peer = {}
            if "llama.cpp" in systems:
                result = run_worker(Path(__file__), ["llama.cpp", model, str(length), *common])
                if "not installed" not in result.get("error", ""):
                    rows.append({"model": model, "context": length, **result, **_ratios(result, base)})
                    peer = result
            if "kvpage" in systems:
                for kv_path, weights, kv_dtype in [(p, w, k) for p in args.kv_paths.split(",") for w in args.weights.split(",")
                                                   for k in args.kv_dtypes.split(",")]:
                    result = run_worker(Path(__file__), ["kvpage", model, str(length), kv_path, weights, kv_dtype, *common])
                    result.update(_ratios(result, base))
                    result.update({f"{key}_llamacpp": value for key, value in _ratios(result, peer).items()})
                    if "weight_mib" in result:
                        # bytes a decode step must read: the weights and every block held (sliding-window
                        # layers hold only their window), as measured after the run
                        per_token = (result["weight_mib"] + result["store_mib"]) * 2**20
                        result["bw_limit_tok_s"] = bandwidth * 1e9 / per_token
                        result["of_bw_limit_pct"] = 100 * result["decode_tok_s"] / result["bw_limit_tok_s"]
                    if base.get("tokens") and result.get("tokens"):
                        result["same_tokens"] = sum(a == b for a, b in zip(result["tokens"], base["tokens"]))
                    rows.append({"model": model, "context": length, **result})
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)

    columns = [
        ("model", "model"), ("context", "ctx"), ("system", "system"), ("path", "path"), ("weights", "weights"),
        ("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"),
        ("prefill_ratio", "prefill x"), ("decode_ratio", "decode x"), ("prefill_ratio_llamacpp", "prefill x llama.cpp"),
        ("decode_ratio_llamacpp", "decode x llama.cpp"), ("same_tokens", "same tok"),
        ("pool_mib", "pool MiB"), ("store_mib", "store MiB"), ("peak_rss_mib", "peak RSS MiB"),
        ("peak_device_mib", "peak GPU MiB"),
        ("of_bw_limit_pct", "% of BW limit"), ("error", "error"),
    ]
    print()
    print(f"device {device}; dtype {args.dtype}; {args.new_tokens} new tokens; memory read bandwidth {bandwidth:.1f} GB/s "
          "(measured)")
    print(table(rows, columns))
    print("x = kvpage / transformers (x llama.cpp: / llama.cpp), same run. % of BW limit: decode tok/s against measured bandwidth / "
          "(weight bytes + store bytes, both measured) per token (computed).")
    write_result("engine", args, {"bandwidth_gbs": bandwidth, "device": device, "dtype": args.dtype, "rows": rows},
                 args.json_path)


def _ratios(result: dict, base: dict) -> dict:
    out = {}
    for key in ("prefill", "decode"):
        if result.get(f"{key}_tok_s") and base.get(f"{key}_tok_s"):
            out[f"{key}_ratio"] = result[f"{key}_tok_s"] / base[f"{key}_tok_s"]
    return out


if __name__ == "__main__":
    main()
