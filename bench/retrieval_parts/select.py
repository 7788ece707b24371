"""No answers: retrieval mode's selection alone, for each set of retrieval signals.

Each document indexed as `kvpage ask --mode retrieval` indexes it; then for each question and each
set of --signals (lexical, bounds, keys and their combinations): how often the selected blocks
hold the question's evidence, the selection's time and the K/V it read."""

from __future__ import annotations

import time
from statistics import mean, median
from typing import Callable

from common import add_json_option

from .running import (ENGINE, SOURCES, add_options, engines_from, progress_log, question_documents, report,
                      settings_from)
from .sources import evidence_attended
from .systems import RunSettings


def add_arguments(parser) -> None:
    add_options(parser, *ENGINE, "saved_kv_mib", *SOURCES, "budget", "max_new_tokens")
    parser.add_argument("--signals", default="lexical;bounds;keys;lexical+keys;bounds+keys;lexical+bounds+keys",
                        help="the sets of retrieval signals compared (';' between sets, '+' within one)")
    add_json_option(parser)


def run(args) -> None:
    engines, settings = engines_from(args), settings_from(args)
    started = time.time()
    log = progress_log(started)
    signal_sets = [tuple(s.split("+")) for s in args.signals.split(";") if s]
    rows, documents = [], {}
    for source_id, doc, questions, tokens in question_documents(args, engines):
        documents[source_id] = tokens
        rows += signal_recall(engines.for_system("retrieval"), doc, questions, settings, signal_sets, log)
    summary = [{"signals": name, "questions": len(mine),
                "evidence_pct": 100 * mean(r["evidence_attended"] for r in mine),
                "select_s": median(r["select_s"] for r in mine),
                "kv_mib": mean(r["kv_read_bytes"] for r in mine) / 2**20,
                "bounds_mib": mean(r["bounds_read_bytes"] for r in mine) / 2**20,
                "blocks": f"{mean(r['blocks'] for r in mine):.0f} of {mean(r['total_blocks'] for r in mine):.0f}"}
               for name in dict.fromkeys(r["signals"] for r in rows) for mine in [[r for r in rows if r["signals"] == name]]]
    report(args, summary, rows, [("signals", "signals"), ("questions", "questions"),
                                 ("evidence_pct", "evidence selected %"), ("select_s", "selection s (median)"),
                                 ("kv_mib", "K read MiB / q"), ("bounds_mib", "bounds read MiB / q"),
                                 ("blocks", "blocks selected (mean)")],
           f"model {args.model}; budget {args.budget} tokens; indexing "
           f"{', '.join(f'{k} {v:,} tok' for k, v in documents.items())}; wall {time.time() - started:.0f} s")


def signal_recall(engine, doc, questions: list[dict], settings: RunSettings, signal_sets: list[tuple[str, ...]],
                  log: Callable[[dict], None]) -> list[dict]:
    """Retrieval mode's selection alone (no decoding): the document indexed as `kvpage ask --mode
    retrieval` indexes it, then for each question and each set of signals, whether the selected
    blocks hold all its evidence, how long the selection took (the question's queries included)
    and what it read: the K of the keys signal's candidates, the bounds signal's key bounds (2
    bfloat16 rows per block, layer and head, in memory)."""
    from kvpage_cli.tasks import Asker

    asker = Asker(engine, doc, [q["question"] for q in questions], max_new_tokens=settings.max_new_tokens,
                  retrieval_tokens=settings.budget)
    asker.mode = "retrieval"
    started = time.perf_counter()
    retriever = asker.index()
    index_s = time.perf_counter() - started
    budget = asker.budget()
    index = retriever.index
    rows = []
    for q, ids in zip(questions, asker.question_ids):
        asked = retriever.tail + ids
        for signals in signal_sets:
            candidates = len(retriever.units) if signals == ("keys",) else None
            read = []
            original = index._kv

            def counted(group, pos, chosen, values=True, original=original, read=read):
                read.append(len(chosen) * group.block_bytes_per_layer // (1 if values else 2))
                return original(group, pos, chosen, values)

            index._kv = counted
            began = time.perf_counter()
            try:
                selection = retriever.select(q["question"], asked, budget, signals=signals, candidates=candidates)
            finally:
                index._kv = original
            row = {"id": q["id"], "source": q["source"], "signals": "+".join(signals),
                   "select_s": time.perf_counter() - began, "kv_read_bytes": sum(read),
                   "bounds_read_bytes": 2 * index.kmin.nbytes if "bounds" in signals else 0,
                   "blocks": len(selection.blocks), "total_blocks": selection.total, "index_s": index_s,
                   "evidence_attended": evidence_attended(q["evidence_ranges"],
                                                          [retriever.char_spans[i] for i in selection.blocks])}
            rows.append(row)
            log({"system": row["signals"], **row})
    index.release()
    return rows
