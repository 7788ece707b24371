"""The generated tables of bench/README.md and docs/benchmarks.md, written from the result files.

bench/README.md gets, between its markers, the list of benchmarks (what each measures, its peer,
its command) and, for each benchmark, its latest result on each machine; docs/benchmarks.md the
latest result of each benchmark. A result's line says its machine, commit and date and a
headline computed from its rows (the ratio to the peer where it has one).

    python bench/summary.py            # rewrites both tables
    python bench/summary.py --check    # exit 1 where a table differs from what the results give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
README = REPO / "bench" / "README.md"
DOCS = REPO / "docs" / "benchmarks.md"
MARKERS = {
    "benchmarks": ("<!-- bench/summary.py: benchmarks -->", "<!-- end of bench/summary.py: benchmarks -->"),
    "latest": ("<!-- bench/summary.py: latest results -->", "<!-- end of bench/summary.py: latest results -->"),
}

# bench name (its folder in bench/results) -> (what it measures, the peer it is measured beside, command)
BENCHMARKS = {
    "engine": ("prefill and decode tok/s and peak RSS of one sequence, exact mode, 1K-32K contexts",
               "transformers (SDPA, DynamicCache), llama.cpp", "python bench/engine.py"),
    "batch": ("decode tok/s of B questions over one shared document, batch 1 to 64",
              "transformers, batched greedy decoding", "python bench/batch.py"),
    "startup": ("wall time and peak RSS of `kvpage ask -` in a new process", "llama.cpp in a new process",
                "python bench/startup.py"),
    "quant_models": ("load, prefill, decode and peak RSS of random 1B and 8B-shaped GGUF files", "llama.cpp",
                     "python bench/quant_models.py"),
    "quant_agreement": ("greedy tokens over the sample contract with int8 activations, against float32 activations",
                        "llama.cpp on the same GGUF file",
                        "python bench/quant_models.py --agreement gemma3-270m --activations auto,int8 --new-tokens 32"),
    "decode_gemm": ("a decode step's weight products at 1 to 64 rows", "torch float32 and bfloat16 products",
                    "python bench/decode_gemm.py"),
    "native_attention": ("the native decode attention kernel per KV element type", "torch SDPA",
                         "python bench/native_attention.py --layout store --layers 30"),
    "prefill_attention": ("the native bfloat16 prefill attention kernel", "torch's float32 flash attention",
                          "python bench/prefill_attention.py"),
    "prefill_gemm": ("a prompt chunk's fp32 products through oneDNN", "torch's default product (MKL)",
                     "python bench/prefill_gemm.py"),
    "profile_decode": ("where a decode step's host time goes (torch profiler)", "-",
                       "python bench/profile_decode.py --model smollm2 --context 1024"),
    "kernels_bench": ("the Triton decode attention kernel's GB/s on CUDA", "torch SDPA, a device-to-device copy",
                      "python bench/kernels_bench.py"),
    "review_batch": ("`kvpage review` end to end, batched against one question at a time", "`kvpage review --batch 1`",
                     "python bench/review_batch.py"),
    "review_quality": ("the review's findings against CUAD's expert labels, 50 development contracts",
                       "CUAD's labels; the lexical head, zero-shot scoring", "python bench/review_quality.py --reviews 50"),
    "retrieval-questions": ("79 questions over code, contracts and a PDF longer than the context, scored by regexes",
                            "BM25 chunks in the prompt; the whole document (exact)", "python bench/retrieval.py questions"),
    "retrieval-passkey": ("a pass key in 8K to 512K-token haystacks", "BM25 chunks in the prompt; exact",
                          "python bench/retrieval.py passkey"),
    "retrieval-select": ("which retrieval signals select the blocks holding a question's evidence",
                         "the lexical signal alone", "python bench/retrieval.py select"),
    "retrieval-windows": ("what indexing window by window loses, per window size and overlap", "an exact prefill",
                          "python bench/retrieval.py windows"),
    "retrieval-recall": ("how often BM25's packing holds a question's evidence (no model)", "-",
                         "python bench/retrieval.py recall"),
    "longctx": ("pass keys and needles: what selective mode's policies lose", "exact mode",
                "python bench/longctx.py --model gemma3-270m"),
    "decode": ("decode tok/s and KV read of each selective policy at 4K-32K", "exact mode",
               "python bench/decode.py"),
    "kvcache": ("a document asked about twice (saved KV) and decode with half its KV on disk",
                "the first ask; decode with the KV in RAM", "python bench/kvcache.py"),
    "tp": ("two ranks of one thread (gloo) against one process of two threads", "one process",
           "python bench/tp.py"),
    "soak": ("300 mixed operations in one process: RSS, files and answers must not drift",
             "a fresh `kvpage ask` process per answer", "python bench/soak.py --operations 300"),
    "train_clauses": ("the review's clause-category head trained on CUAD, scored on its development split", "-",
                      "python bench/train_clauses.py --variants"),
    "review_formats": ("time to write a review as HTML, DOCX and PDF, and each file's size", "the review's own time",
                       "python bench/review_formats.py"),
    "retrieval-find": ("`kvpage find` over a saved index: in process (a first find, then one over the saved index); "
                       "with --commands, the command as new processes, in its own and handed to `kvpage serve`",
                       "BM25's spans over the whole document; the command in its own process",
                       "python bench/retrieval_evidence.py find --home H --source packaging --limit 5 --commands 4"),
    "retrieval-rerank": ("the evidence spans ranked again from the attention `bench/retrieval.py questions "
                         "--evidence-dump` kept (no model): top-1/top-3 spans holding the key facts",
                         "each signal alone; BM25's spans over the whole document",
                         "python bench/retrieval_evidence.py rerank DUMP..."),
    "retrieval-lazy": ("a lazy index's choices replayed without the model: the passages' evidence and the window "
                       "tokens a question computes", "-", "python bench/retrieval_evidence.py lazy"),
    "device_step": ("the device decode step's host preparation and aten operations per layer, on the CPU",
                    "the per-layer host path", "python bench/device_step.py"),
    "pool_schedule": ("block copies per decode step when the pool is smaller than the context (simulated)",
                      "the least-recently-used pool", "python bench/pool_schedule.py"),
}


# -- headlines: one line a result's rows give -----------------------------------------------------

def tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def span(values, digits: int = 2) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def lengths(values) -> str:
    values = sorted(set(values))
    return tokens(values[0]) if len(values) == 1 else f"{tokens(values[0])}-{tokens(values[-1])}"


def engine(results: dict, stamp: dict) -> str:
    """Per model, kvpage's first setting against each peer over the contexts run."""
    rows = [r for r in results["rows"] if r.get("decode_tok_s")]
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        ours: dict[int, dict] = {}
        for r in mine:
            if r["system"] == "kvpage":
                ours.setdefault(r["context"], r)
        if not ours:
            continue
        setting = next(iter(ours.values())).get("weights")
        name = f"{Path(model).name}, kvpage {setting}" if setting else Path(model).name
        against = []
        for peer in ("transformers", "llama.cpp"):
            base = {r["context"]: r for r in mine if r["system"] == peer}
            pairs = [(ours[c], base[c]) for c in ours if c in base]
            if pairs:
                against.append(f"prefill {span([k['prefill_tok_s'] / b['prefill_tok_s'] for k, b in pairs])}x, "
                               f"decode {span([k['decode_tok_s'] / b['decode_tok_s'] for k, b in pairs])}x {peer}")
        if not against:
            against = [f"prefill {span([r['prefill_tok_s'] for r in ours.values()], 0)} tok/s, "
                       f"decode {span([r['decode_tok_s'] for r in ours.values()], 1)} tok/s (no peer in the run)"]
        on = " on the GPU" if results.get("device") == "cuda" else ""
        parts.append(f"{name}{on}, {lengths(ours)}: " + "; ".join(against))
    return "; ".join(parts)


def batch(results: dict, stamp: dict) -> str:
    """Per prefix, kvpage at batch 16 (or the largest batch below it) against batch 1 and transformers."""
    rows = [r for r in results["rows"] if r.get("decode_tok_s")]
    parts = []
    for prefix in dict.fromkeys(r["prefix"] for r in rows):
        ours = [r for r in rows if r["prefix"] == prefix and r["system"].startswith("kvpage")]
        if not ours:
            continue
        ours = [r for r in ours if r["system"] == ours[0]["system"]]
        row = max((r for r in ours if r["batch"] <= 16), key=lambda r: r["batch"], default=ours[-1])
        text = f"{tokens(prefix)}, batch {row['batch']}: {row['decode_tok_s']:.1f} tok/s"
        if row["batch"] > 1 and row.get("x_batch1"):
            text += f", {row['x_batch1']:.1f}x batch 1"
        if row.get("x_transformers"):
            text += f", {row['x_transformers']:.2f}x transformers"
        parts.append(text)
    return "; ".join(parts)


def review_batch(results: list, stamp: dict) -> str:
    """The largest --batch against --batch 1, without and with --explain."""
    parts = []
    for explain in dict.fromkeys(r["explain"] for r in results):
        rows = [r for r in results if r["explain"] == explain]
        row = max(rows, key=lambda r: r["batch"])
        parts.append(f"--batch {row['batch']}{' --explain' if explain == 'yes' else ''}: {row['ratio_x']:.2f}x "
                     f"--batch 1 ({rows[0]['seconds']:.1f} s to {row['seconds']:.1f} s)")
    same = all(r["same"] for r in results)
    return "; ".join(parts) + ("; the same output" if same else "; the output differs")


def decode_gemm(results: dict, stamp: dict) -> str:
    """At 16 rows (or the most below), kvpage's fastest product against torch float32's."""
    rows = results["rows"]
    count = max((r["rows"] for r in rows if r["rows"] <= 16), default=rows[0]["rows"])
    at = [r for r in rows if r["rows"] == count]
    ours = min((r for r in at if r["system"].startswith("kvpage")), key=lambda r: r["step_ms"])
    peer = next((r for r in at if r["system"] == "torch float32"), None)
    text = f"{count} rows: {ours['system']} {ours['step_ms']:.1f} ms a step ({ours['x_1_row_x']:.1f}x its 1-row throughput)"
    return text + (f", {peer['step_ms'] / ours['step_ms']:.2f}x torch float32" if peer else "")


def native_attention(results: list, stamp: dict) -> str:
    ours = [r for r in results if r["kind"].startswith("native")]
    queries = span([r.get("queries", 1) for r in ours], 0)
    return (f"native kernel {span([r['vs_sdpa'] for r in ours])}x torch SDPA "
            f"({span([r['blocks'] for r in ours], 0)} blocks, {queries} {'query' if queries == '1' else 'queries'})")


def prefill_attention(results: list, stamp: dict) -> str:
    return (f"native {span([r['torch_ratio'] for r in results])}x torch's float32 flash attention "
            f"({span([r['rows'] for r in results], 0)} rows, {span([r['keys'] for r in results], 0)} keys)")


def prefill_gemm(results: list, stamp: dict) -> str:
    return (f"oneDNN {span([r['ratio_x'] for r in results])}x torch's default product "
            f"({span([r['rows'] for r in results], 0)} rows)")


def quant_models(results: dict, stamp: dict) -> str:
    """Per file, kvpage's decode with its default activations against llama.cpp's at each prompt
    length the run measured (the range where there are several), and its prefill of the longest."""
    rows = [r for r in results["rows"] if r.get("decode_tok_s")]
    names = {r["system"] for r in rows}
    default = next((n for n in ("kvpage (auto activations)", "kvpage (float32 activations)", "kvpage") if n in names),
                   None)  # float32 activations were the default before auto
    parts = []
    for shape, fmt in dict.fromkeys((r["shape"], r["format"]) for r in rows):
        mine = [r for r in rows if (r["shape"], r["format"]) == (shape, fmt)]
        ours = {r.get("prompt_tokens"): r for r in mine if r["system"] == default}
        peer = {r.get("prompt_tokens"): r for r in mine if r["system"] == "llama.cpp"}
        both = [n for n in ours if n in peer]
        if both:
            ratios = sorted(ours[n]["decode_tok_s"] / peer[n]["decode_tok_s"] for n in both)
            text = f"{shape} {fmt} {ratios[0]:.2f}" + (f"-{ratios[-1]:.2f}x" if len(ratios) > 1 else "x")
            if len(both) > 1:
                longest = max(both, key=lambda n: n or 0)
                text += (f" (prefill of {longest} tokens "
                         f"{ours[longest]['prefill_tok_s'] / peer[longest]['prefill_tok_s']:.2f}x)")
            parts.append(text)
        elif ours:
            parts.append(f"{shape} {fmt} {max(r['decode_tok_s'] for r in ours.values()):.1f} tok/s")
    text = "decode against llama.cpp: " + ", ".join(parts) if any(p.endswith(("x", "x)")) for p in parts) else ", ".join(parts)
    threads = (stamp.get("args") or {}).get("threads")
    if threads and threads != stamp.get("cores"):
        text = f"{threads} thread{'s' if threads > 1 else ''} of {stamp['cores']} cores, {text}"
    load = results.get("load_average")
    if load and max(load["start"][0], load["end"][0]) > (stamp.get("cores") or 1):  # other work shared the CPUs
        text = (f"on a loaded machine (load average {load['start'][0]:.1f} to {load['end'][0]:.1f} on "
                f"{stamp['cores']} CPUs: decode figures swing with it), {text}")
    return text


def quant_agreement(results: dict, stamp: dict) -> str:
    """Each system's greedy tokens before its first unlike float32 activations', summed over the cuts."""
    rows = [r for r in results["summary"] if "float32" not in r["system"]]
    steps = results["summary"][0]["steps"]
    model = stamp["args"].get("agreement") if stamp.get("args") else None
    return ((f"{model}: " if model else "") + "tokens before the first unlike float32 activations' (of "
            + f"{steps}): " + ", ".join(f"{r['system'].replace(' activations)', '').replace('(', '')} {r['lead']}" for r in rows))


def startup(results: dict, stamp: dict) -> str:
    rows = results["rows"]
    parts = [f"{name}: {row['wall_s']:.2f} s, {row['peak_rss_mib']:.0f} MiB" for name, row in rows.items()]
    return "; ".join(parts)


def soak(results: dict, stamp: dict) -> str:
    rows = results["rows"]
    warm = next((r for r in rows if r["operations"] >= 50), rows[0])
    growth = 100 * (rows[-1]["rss_mib"] - warm["rss_mib"]) / warm["rss_mib"]
    answers = results["answers"]
    equal = sum(a["answer"] == a.get("fresh") for a in answers)
    verdict = "PASS" if not results.get("verdict") else "FAIL (" + "; ".join(results["verdict"]) + ")"
    return (f"{verdict}: {rows[-1]['operations']} operations, RSS {growth:+.1f}% after warm-up, "
            f"{equal} of {len(answers)} answers equal to a fresh process's")


def tp(results: list, stamp: dict) -> str:
    return (f"2 ranks x 1 thread against 1 x 2 threads, {lengths([r['context'] for r in results])}: "
            f"prefill {span([r['prefill_ratio'] for r in results])}x, decode {span([r['decode_ratio'] for r in results])}x")


def kernels_bench(results: dict, stamp: dict) -> str:
    if "skipped" in results:
        return f"skipped: {results['skipped']}"
    rows = results["decode"]
    return (f"decode attention {span([r['kernel_gbps'] / 1000 for r in rows], 1)} TB/s, torch SDPA "
            f"{span([r['sdpa_contiguous_gbps'] / 1000 for r in rows], 1)} TB/s, a device copy "
            f"{results['device_copy']['gbps_read_plus_write'] / 1000:.1f} TB/s")


def profile_decode(results: dict, stamp: dict) -> str:
    return (f"batch {results['batch']}, {tokens(results['context'])}-token document: {results['step_ms']:.1f} ms a step "
            f"({results['device']}, {results['path']})")


def review_quality(results: dict, stamp: dict) -> str:
    methods = results["methods"]
    name = next((m for m in methods if m.startswith("review ")), "lexical")
    micro = methods[name]["micro"]
    count = len(results["reviews"].get(name.removeprefix("review "), [])) or results["dev_contracts"]
    return (f"{name}: micro F1 {micro['f1']:.3f} (precision {micro['precision']:.3f}, recall {micro['recall']:.3f}) "
            f"over {count} development contracts")


def _right(rows: list[dict]) -> str:
    """Per system, the questions answered right of those it ran (and those it could not)."""
    parts = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ran = [r for r in mine if "skipped" not in r]
        if ran:
            text = f"{system} {sum(bool(r.get('right')) for r in ran)} of {len(ran)}"
            parts.append(text + (f" ({len(mine) - len(ran)} did not fit)" if len(ran) < len(mine) else ""))
        else:
            parts.append(f"{system} does not fit")
    return ", ".join(parts)


def _model(stamp: dict, rows: list[dict]) -> str:
    if stamp.get("args") and stamp["args"].get("model"):
        return stamp["args"]["model"]
    settings = rows[0].get("settings", "") if rows else ""  # a journal's rows name it
    return settings.split("|")[0] or "?"


def retrieval_questions(results: dict, stamp: dict) -> str:
    rows = results["rows"]
    text = f"{_model(stamp, rows)}, right: " + _right(rows)
    spans = [r for r in rows if "ev_top1_facts" in r]  # retrieval's evidence spans, where the run measured them
    if spans:
        top1, top3 = (100 * sum(bool(r[f"ev_top{k}_facts"]) for r in spans) / len(spans) for k in (1, 3))
        text += f"; evidence spans holding the key facts: top-1 {top1:.0f}%, top-3 {top3:.0f}% of {len(spans)}"
    return text


def retrieval_passkey(results: dict, stamp: dict) -> str:
    rows = results["rows"]
    by_length = [f"{tokens(n)}: " + _right([r for r in rows if r["length"] == n])
                 for n in dict.fromkeys(r["length"] for r in rows)]
    kv = (stamp.get("args") or {}).get("kv_dtype")
    return (f"{_model(stamp, rows)}{f', {kv} KV' if kv and kv != 'auto' else ''}, found: " + "; ".join(by_length))


def retrieval_select(results: dict, stamp: dict) -> str:
    summary = results["summary"]
    best = max(summary, key=lambda r: r["evidence_pct"])
    text = f"evidence selected: {summary[0]['signals']} {summary[0]['evidence_pct']:.1f}%"
    if best is summary[0]:
        return text + f", the best of {len(summary)} sets of signals"
    return text + f"; the best of {len(summary)} sets of signals, {best['signals']}, {best['evidence_pct']:.1f}%"


def retrieval_windows(results: dict, stamp: dict) -> str:
    summary = results["summary"]
    row = next((r for r in summary if r["window"] == 2048 and r["overlap"] == 512), summary[0])
    return (f"window {row['window']:,}, overlap {row['overlap']}: {row['extra_nll']} nats a token over an exact "
            f"prefill, indexing {row['index_tok_s']:.0f} tok/s")


def retrieval_recall(results: dict, stamp: dict) -> str:
    row = results["summary"][-1]
    return f"evidence in the BM25 pack: {row['evidence_pct']:.1f}% of {row['questions']} questions"


def longctx(results: dict, stamp: dict) -> str:
    if "cases" in results:  # a migrated run's log: one line per case and configuration
        cases = results["cases"]
        keys = [(c["config"], c.get("weights", "auto"), c.get("activations", "float32")) for c in cases]
        parts = []
        for config, weights, activations in dict.fromkeys(keys):
            mine = [c for c, k in zip(cases, keys) if k == (config, weights, activations)]
            label = f"{config}, {weights} weights" + (f", {activations} activations" if activations != "float32" else "")
            parts.append(f"{label}: {sum(c['score'] for c in mine):.0f} of {len(mine)}")
        return f"{cases[0]['task']} at {tokens(cases[0]['length'])}, found: " + "; ".join(parts)
    rows = results["rows"]
    longest = max(r["length"] for r in rows)
    return f"{tokens(longest)}, accuracy: " + ", ".join(
        f"{r['policy']} {r['pool']} {r['accuracy_pct']:.0f}%" for r in rows if r["length"] == longest)


def decode(results: dict, stamp: dict) -> str:
    rows = [r for r in results["rows"] if r["policy"] != "exact"]
    best = max(rows, key=lambda r: r["speedup_x"])
    return (f"fastest policy {best['policy']} at {tokens(best['context'])}: {best['speedup_x']:.2f}x exact's decode, "
            f"{best['same_tokens']} tokens the same")


def kvcache(results: dict, stamp: dict) -> str:
    summary = results["summary"]
    if "second_over_first_ttft" not in summary:
        return "-"
    return (f"second ask's first token in {summary['second_over_first_ttft']:.2f}x the first's time, "
            f"{'the same' if summary.get('same_answer') else 'another'} answer")


def review_formats(results: dict, stamp: dict) -> str:
    rows = results["rows"]
    worst = {fmt: max(r["share_pct"] for r in rows if r["format"] == fmt) for fmt in dict.fromkeys(r["format"] for r in rows)}
    return (f"{len({r['document'] for r in rows})} contracts: writing takes at most "
            + ", ".join(f"{share:.2f}% ({fmt})" for fmt, share in worst.items()) + " of the review's time")


def device_step(results: dict, stamp: dict) -> str:
    mode = f", selective mode ({results['policy']}, {results['budget_blocks']} blocks a query)" if results.get("policy") else ""
    text = (f"batch {results['batch']}, {tokens(results['context'])}-token document, {results['layers']} layers{mode}: "
            f"host preparation {results['host_prep_us_median']:.0f} us a step")
    if "host_prep_alone_us_median" in results:
        text += f" ({results['host_prep_alone_us_median']:.0f} us with no device work between)"
    text += (f"; aten ops a layer {results['aten_ops_per_layer_device_step']:.0f} against "
             f"{results['aten_ops_per_layer_host_path']:.0f} on the host path")
    if results.get("prefill_host_reads_per_chunk_device") is not None:
        text += (f"; a {results['prefill_chunk']}-token prompt chunk: {results['prefill_host_reads_per_chunk_device']:.0f} "
                 f"host reads against {results['prefill_host_reads_per_chunk_host_path']:.0f} (the torch backend's CPU kernel)")
    return text


def pool_schedule(results: dict, stamp: dict) -> str:
    rows = [r for r in results["rows"] if r["lru_copies"]]
    saved = [1 - r["schedule_copies"] / r["lru_copies"] for r in rows]
    return f"copies per step {span([1 - s for s in saved])}x the least-recently-used pool's where it streams"


def train_clauses(results: dict, stamp: dict) -> str:
    row = results["variants"][0]
    return f"development split micro F1 {row['f1']:.3f} (precision {row['precision']:.3f}, recall {row['recall']:.3f})"


def retrieval_find(results: dict, stamp: dict) -> str:
    rows = results["rows"]
    first, lookup = [r["first_s"] for r in rows], [r["lookup_s"] for r in rows]
    text = (f"{results['source']}, {len(rows)} questions over {rows[0]['document_tokens']:,} tokens: first find "
            f"{span(first)} s, over the saved index {span(lookup)} s (in process)")
    commands = results.get("commands")
    if commands:
        own, served = [r["own_median_s"] for r in commands], [r["served_median_s"] for r in commands]
        same = "the same output" if all(r["same_output"] for r in commands) else "OUTPUTS DIFFER"
        text += f"; the command {span(own)} s, handed to `kvpage serve` {span(served)} s (medians), {same}"
    return text


def retrieval_lazy(results: dict, stamp: dict) -> str:
    return "; ".join(f"{r['window']}/{r['overlap']}/{r['index_tokens']}: {r['evidence']} held, later median "
                     f"{r['later_tokens']:,.0f} tokens" for r in results["rows"])


def retrieval_rerank(results: dict, stamp: dict) -> str:
    by = {r["ranking"]: r for r in results["summary"]}
    return "; ".join(f"{name}: top-1 {by[name]['1_facts_pct']:.0f}%, top-3 {by[name]['3_facts_pct']:.0f}%"
                     for name in ("fused", "BM25 whole doc") if name in by) + f" of {by['fused']['questions']} questions"


HEADLINES = {"engine": engine, "batch": batch, "review_batch": review_batch, "decode_gemm": decode_gemm,
             "native_attention": native_attention, "prefill_attention": prefill_attention, "prefill_gemm": prefill_gemm,
             "quant_models": quant_models, "quant_agreement": quant_agreement, "startup": startup, "soak": soak, "tp": tp, "kernels_bench": kernels_bench,
             "profile_decode": profile_decode, "review_quality": review_quality,
             "retrieval-questions": retrieval_questions, "retrieval-passkey": retrieval_passkey,
             "retrieval-select": retrieval_select, "retrieval-windows": retrieval_windows,
             "retrieval-recall": retrieval_recall, "longctx": longctx, "decode": decode, "kvcache": kvcache,
             "train_clauses": train_clauses, "review_formats": review_formats,
             "device_step": device_step, "pool_schedule": pool_schedule, "retrieval-find": retrieval_find,
             "retrieval-lazy": retrieval_lazy,
             "retrieval-rerank": retrieval_rerank}


# -- tables ---------------------------------------------------------------------------------------

def written_order(path: Path) -> tuple[str, int]:
    """A result's file name in the order of writing: NAME.json before NAME-2.json."""
    match = re.fullmatch(r"(.*?)(?:-(\d+))?", path.stem)
    return match[1], int(match[2] or 1)


def results() -> dict[str, list[tuple[Path, dict]]]:
    """bench name -> its result files and documents, the latest first (by date; of one date, the
    first written)."""
    found: dict[str, list[tuple[Path, dict]]] = {}
    for path in sorted(RESULTS.glob("*/*.json")):
        document = json.loads(path.read_text())
        found.setdefault(path.parent.name, []).append((path, document))
    for entries in found.values():
        entries.sort(key=lambda e: written_order(e[0]))
        entries.sort(key=lambda e: e[1]["stamp"]["date"], reverse=True)
    return found


def machine(stamp: dict) -> str:
    """The CPU's tag, with the GPU's name where there was one (alone where the CPU is unknown)."""
    gpu, tag = stamp.get("gpu"), stamp["cpu"]["tag"]
    if not gpu:
        return tag
    return gpu["name"] if tag == "unknown" else f"{tag}, {gpu['name']}"


def result_cell(path: Path, document: dict, base: Path) -> list[str]:
    """machine, date, commit, link, headline."""
    stamp = document["stamp"]
    commit = (stamp["commit"] or "none")[:7] + ("-dirty" if stamp["dirty"] else "") + ("*" if stamp["migrated"] else "")
    link = f"[{path.name}]({Path('..') / path.relative_to(REPO) if base == DOCS.parent else path.relative_to(base)})"
    return [machine(stamp), stamp["date"][:10], commit, link, HEADLINES[document["bench"]](document["results"], stamp)]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


FOOTNOTE = ("\\* migrated: written before results were stamped; the commit is the one that added the result, the "
            "machine as the README named it (unknown where it named none).")


def tables() -> dict[str, str]:
    """The generated text between each pair of markers: bench/README.md's list of benchmarks and
    of every result (each benchmark's latest first), docs/benchmarks.md's latest result of each."""
    found = results()
    unknown = set(found) - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"results of benchmarks not in bench/summary.py's BENCHMARKS: {', '.join(sorted(unknown))}")
    listed = markdown(["benchmark", "measures", "beside", "command"],
                      [[name, what, peer, f"`{command}`"] for name, (what, peer, command) in BENCHMARKS.items()])
    every, latest = [], []
    for name in BENCHMARKS:
        entries = found.get(name, [])
        every += [[name, *result_cell(path, document, README.parent)] for path, document in entries]
        if entries:
            latest.append([name, *result_cell(*entries[0], DOCS.parent)])
    header = ["benchmark", "machine", "date", "commit", "result", "headline"]
    return {"readme:benchmarks": listed,
            "readme:latest": markdown(header, every) + "\n\n" + FOOTNOTE,
            "docs:latest": markdown(header, latest) + "\n\n" + FOOTNOTE}


def filled(text: str, part: str, generated: str) -> str:
    """`text` with what lies between `part`'s markers replaced by `generated`."""
    start, end = MARKERS[part]
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"expected one {start} and one {end}")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{generated}\n{end}{tail}"


def expected() -> dict[Path, str]:
    """bench/README.md and docs/benchmarks.md as the result files say they should read."""
    generated = tables()
    readme = filled(README.read_text(), "benchmarks", generated["readme:benchmarks"])
    readme = filled(readme, "latest", generated["readme:latest"])
    docs = filled(DOCS.read_text(), "latest", generated["docs:latest"])
    return {README: readme, DOCS: docs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table is out of date")
    args = parser.parse_args()
    stale = []
    for path, text in expected().items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    for path in stale:
        print(f"{'out of date' if args.check else 'rewrote'}: {path.relative_to(REPO)}", file=sys.stderr)
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
