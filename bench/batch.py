"""Batch benchmark: decode throughput of many sequences over one shared document.

B questions over one document: kvpage prefills the document once, forks it B times and decodes
all B answers in one batch (`Engine.run`, shared blocks read once per step for every sequence);
transformers runs batched greedy decoding over the same B prompts (document + question; the
questions have the same token count, so the batch needs no padding; one forward pass over the
batch, then one step per token over one DynamicCache, SDPA; what `generate` does greedily,
without its per-step overheads), with the same weights and dtype. Reported per (prefix,
batch): decode tokens/s over all sequences, kvpage's ratio to its own batch 1 and to
transformers at the same batch, whether every sequence's tokens are equal, peak RSS and store
MiB. Each system runs in its own process.

    python bench/batch.py                                   # SmolLM2, 1K and 8K prefixes, batch 1/4/16/64
    python bench/batch.py --prefixes 1024 --batches 1,16 --json out.json
    python bench/batch.py --device cuda --model FILE.gguf   # on a GPU: both systems there
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (add_json_option, bench_device, corpus_text, peak_device_mib, peak_rss_mib,  # noqa: E402
                    prompt_ids, run_worker, sync, table, write_result)

QUESTION_TOKENS = 16


def questions(tokenizer, count: int) -> list[list[int]]:
    """`count` distinct 16-token questions cut from the corpus (the same for every system)."""
    ids = tokenizer(corpus_text()[-200_000:], add_special_tokens=False).input_ids
    return [ids[i * QUESTION_TOKENS:(i + 1) * QUESTION_TOKENS] for i in range(count)]


def document_tokens(prefix: int, new_tokens: int, limit: int) -> int:
    """The document's token count for a prefix of `prefix`: all of it where the document, a
    question and the answer fit the model's context, else as much as does (an 8K prefix of an 8K
    model is 8,192 - 16 - new_tokens tokens; the row says so)."""
    return min(prefix, limit - QUESTION_TOKENS - new_tokens)


def worker_kvpage(model: str, prefix: int, batch: int, new_tokens: int, dtype: str, home: str | None,
                  activations: str = "float32", device: str = "cpu", pool_mib: float | None = None) -> dict:
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.engine import Request

    pool = {"pool_mib": pool_mib} if pool_mib else {}
    engine = Engine.load(model, EngineConfig(dtype=dtype, home=home, max_batch=batch, activations=activations,
                                             device=device, **pool))
    doc_ids = prompt_ids(engine.tokenizer, document_tokens(prefix, new_tokens, engine.max_context), question="")
    asks = questions(engine.tokenizer, batch)
    warm = engine.prefill(doc_ids[:80])
    list(engine.run([Request(engine.fork(warm), q[:4], 2, stop=()) for q in asks[:2]]))  # warm-up: kernels, first calls
    engine.release(warm)
    doc = engine.prefill(doc_ids)
    requests = [Request(engine.fork(doc), q, new_tokens, stop=()) for q in asks]
    engine.reset_stats()
    sync(device)
    started = time.perf_counter()
    list(engine.run(requests, max_batch=batch))
    sync(device)
    wall = time.perf_counter() - started
    stats = engine.stats()
    return {
        "system": "kvpage" if activations == "float32" else f"kvpage:{activations}", "decode_tok_s": stats.decode_tokens / stats.decode_seconds,
        "question_prefill_s": stats.prefill_seconds, "wall_s": wall,
        "store_mib": stats.store_bytes / 2**20, "peak_rss_mib": peak_rss_mib(), "peak_device_mib": peak_device_mib(device),
        "document_tokens": len(doc_ids),
        "tokens": [r.generated for r in requests],
    }


def worker_transformers(model: str, prefix: int, batch: int, new_tokens: int, dtype: str, home: str | None,
                        device: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kvpage_cli.engine.home import default_home
    from kvpage_cli.engine.model.weights import resolve_folder

    folder = resolve_folder(model, Path(home) if home else default_home())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    reference = reference.to(device).eval()
    doc_ids = prompt_ids(tokenizer, document_tokens(prefix, new_tokens, reference.config.max_position_embeddings),
                         question="")
    prompts = [doc_ids + q for q in questions(tokenizer, batch)]  # same length: no padding needed
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        cache = DynamicCache(config=reference.config)
        reference(ids[:, :80], past_key_values=cache, use_cache=True, logits_to_keep=1)  # warm-up
        cache = DynamicCache(config=reference.config)
        sync(device)
        started = time.perf_counter()
        out = reference(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync(device)
        prefill_s = time.perf_counter() - started
        token = out.logits[:, -1].argmax(-1)
        tokens = [token]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = reference(token[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1)
            tokens.append(token)
        sync(device)
        decode_s = time.perf_counter() - started
    generated = torch.stack(tokens, dim=1).tolist()
    return {"system": "transformers", "decode_tok_s": batch * (new_tokens - 1) / decode_s, "prefill_s": prefill_s,
            "peak_rss_mib": peak_rss_mib(), "peak_device_mib": peak_device_mib(device), "document_tokens": len(doc_ids),
            "tokens": generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefixes", default="1024,8192")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--systems", default="kvpage,transformers", help="kvpage, kvpage:int8 (--activations int8), transformers")
    parser.add_argument("--transformers-max-tokens", type=int, default=140_000,
                        help="skip transformers where batch x prefix exceeds this (its KV per sequence)")
    parser.add_argument("--home", default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="where both systems compute")
    parser.add_argument("--pool-mib", type=float, default=None,
                        help="kvpage's pool (default: the engine's); on a GPU, one that holds every block keeps them resident")
    add_json_option(parser)
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = bench_device(args.device)
    if args.worker is not None:
        system, prefix, batch = args.worker[0], int(args.worker[1]), int(args.worker[2])
        if system.startswith("kvpage"):  # kvpage, or kvpage:int8 (--activations int8)
            result = worker_kvpage(args.model, prefix, batch, args.new_tokens, args.dtype, args.home,
                                   system.partition(":")[2] or "float32", device, args.pool_mib)
        else:
            result = worker_transformers(args.model, prefix, batch, args.new_tokens, args.dtype, args.home, device)
        print(json.dumps(result))
        return

    common = ["--model", args.model, "--new-tokens", str(args.new_tokens), "--dtype", args.dtype, "--device", device]
    if args.home:
        common += ["--home", args.home]
    if args.pool_mib:
        common += ["--pool-mib", str(args.pool_mib)]
    rows = []
    for prefix in [int(p) for p in args.prefixes.split(",")]:
        single = None
        for batch in [int(b) for b in args.batches.split(",")]:
            results = {}
            for system in args.systems.split(","):
                if system == "transformers" and batch * prefix > args.transformers_max_tokens:
                    results[system] = {"system": system, "error": f"skipped: {batch} x {prefix} tokens of KV"}
                else:
                    results[system] = run_worker(Path(__file__), [system, str(prefix), str(batch), *common])
            tf = results.get("transformers", {})
            if batch == 1:
                single = {s: r["decode_tok_s"] for s, r in results.items() if r.get("decode_tok_s")}
            for system, result in results.items():
                row = {"prefix": prefix, "batch": batch, **{k: v for k, v in result.items() if k != "tokens"}}
                if system.startswith("kvpage") and result.get("decode_tok_s"):
                    row["x_batch1"] = result["decode_tok_s"] / single[system] if single and system in single else None
                    row["x_transformers"] = result["decode_tok_s"] / tf["decode_tok_s"] if tf.get("decode_tok_s") else None
                    if tf.get("tokens"):
                        row["same_tokens"] = sum(a == b for a, b in zip(result["tokens"], tf["tokens"]))
                rows.append(row)
                print(json.dumps(row), flush=True)
    columns = [("prefix", "prefix"), ("document_tokens", "doc tok"), ("batch", "batch"), ("system", "system"), ("decode_tok_s", "decode tok/s"),
               ("x_batch1", "x batch 1"), ("x_transformers", "x transformers"), ("same_tokens", "same seqs"),
               ("store_mib", "store MiB"), ("peak_rss_mib", "peak RSS MiB"), ("peak_device_mib", "peak GPU MiB"),
               ("error", "error")]
    print()
    print(f"{args.model}, {device}, {args.dtype}, {args.new_tokens} new tokens per sequence; decode tok/s over all sequences "
          "(measured); same seqs: sequences whose tokens equal transformers'")
    print(table(rows, columns))
    write_result("batch", args, {"device": device, "rows": rows}, args.json_path)


if __name__ == "__main__":
    main()
