"""The window size and overlap retrieval indexes with: what indexing window by window loses.

Each document's first --prefix tokens indexed (every block attended in place), the next
--continuation tokens scored: their extra negative log-likelihood against an exact prefill, and
the indexing speed (three corpus contracts not in the question set, two Python standard library
modules)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import mean
from typing import Callable

from common import REPO, add_json_option

from .running import ENGINE, add_options, engines_from, progress_log, report


def add_arguments(parser) -> None:
    add_options(parser, *ENGINE)
    parser.add_argument("--windows", default="512,1024,2048,4096", help="window sizes in tokens")
    parser.add_argument("--overlaps", default="0,0.25,0.5", help="overlaps, as shares of the window")
    parser.add_argument("--prefix", type=int, default=6144, help="tokens indexed per document")
    parser.add_argument("--continuation", type=int, default=512, help="tokens scored after them")
    add_json_option(parser)


def run(args) -> None:
    engines = engines_from(args)
    started = time.time()
    stdlib = Path(argparse.__file__).parent
    paths = [REPO / p if p.startswith("corpus/") else stdlib / p for p in WINDOW_DOCUMENTS]
    rows = window_loss(engines.for_system("retrieval"), paths, [int(w) for w in args.windows.split(",")],
                       [float(o) for o in args.overlaps.split(",")], args.prefix, args.continuation, progress_log(started))
    summary = [{"window": w, "overlap": o, "documents": len(mine),
                "extra_nll": f"{mean(r['extra_nll'] for r in mine):+.4f}",
                "worst_extra_nll": f"{max(r['extra_nll'] for r in mine):+.4f}",
                "index_tok_s": sum(args.prefix for _ in mine) / sum(r["index_s"] for r in mine)}
               for w, o in dict.fromkeys((r["window"], r["overlap"]) for r in rows)
               for mine in [[r for r in rows if (r["window"], r["overlap"]) == (w, o)]]]
    report(args, summary, rows, [("window", "window"), ("overlap", "overlap"), ("documents", "documents"),
                                 ("extra_nll", "extra NLL / token vs exact (mean)"), ("worst_extra_nll", "(worst)"),
                                 ("index_tok_s", "indexing tok/s")],
           f"model {args.model}; {args.prefix} tokens indexed, the next {args.continuation} scored; exact NLL "
           f"{mean({r['document']: r['exact_nll'] for r in rows}.values()):.3f} (mean over documents); "
           f"wall {time.time() - started:.0f} s")


WINDOW_DOCUMENTS = ("corpus/cuad/06-cooperation/contract.txt", "corpus/cuad/08-manufacturing/contract.txt",
                    "corpus/cuad/09-development/contract.txt", "argparse.py", "email/_header_value_parser.py")


def window_loss(engine, paths: list[Path], windows: list[int], overlaps: list[float], prefix: int, continuation: int,
                log: Callable[[dict], None]) -> list[dict]:
    """How much indexing window by window loses against one exact prefill, per window size and
    overlap: the first `prefix` tokens of each document are indexed as retrieval mode indexes them
    (after the `kvpage ask` prompt's head) and every block attended in place, then the next
    `continuation` tokens of the document are scored (teacher-forced); their mean negative
    log-likelihood is compared with the same tokens after an exact prefill of the same prefix.
    Also the indexing throughput."""
    from kvpage_cli.engine.index import RetrievalIndex
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import Asker

    rows = []
    for path in paths:
        doc = load(str(path))
        asker = Asker(engine, doc, "?", max_new_tokens=1)
        first = next(i for i, c in enumerate(asker._chars) if c is not None)
        head, body = asker.prefix_ids[:first], asker.prefix_ids[first:]
        if len(body) < prefix + continuation:
            raise SystemExit(f"{path}: {len(body)} tokens, fewer than --prefix + --continuation")
        target = body[prefix:prefix + continuation]
        ctx = engine.prefill(head + body[:prefix], use_cache=False)
        exact = -mean(engine.score(ctx, target))
        engine.release(ctx)
        for window in windows:
            for share in overlaps:
                overlap = int(window * share) // 64 * 64
                began = time.perf_counter()
                index = RetrievalIndex.build(engine, head, body[:prefix], window, overlap, use_cache=False)
                index_s = time.perf_counter() - began
                ctx = engine.append(index.assemble(list(range(index.num_blocks))), index.rest)
                nll = -mean(engine.score(ctx, target))
                engine.release(ctx)
                index.release()
                row = {"document": path.parent.name if path.name == "contract.txt" else path.name,
                       "path": str(path), "window": window, "overlap": overlap, "nll": nll, "exact_nll": exact,
                       "extra_nll": nll - exact, "index_s": index_s, "index_tok_s": prefix / index_s}
                rows.append(row)
                log({"system": f"window {window} overlap {overlap}", "id": row["document"], **row})
    return rows
