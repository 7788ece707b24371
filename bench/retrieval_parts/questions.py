"""The question set answered by each system at the same budget, scored by its regexes.

Every question over a source goes through every system (--systems): the first question over a
document pays for what the system builds for it (retrieval mode's index, BM25's, the exact
prefill), the next ones reuse it. Reported per system: accuracy; how often all the question's
evidence lines were among the text attended; time to the first answer token for the first
question and for the next ones; KV read per question; tokens attended per question."""

from __future__ import annotations

import time

from common import add_json_option, peak_rss_mib, table

from .running import (ANSWERS, ENGINE, SOURCES, SUMMARY_COLUMNS, add_options, engines_from, journal_from,
                      progress_log, question_documents, report, run_document, settings_from, summarise)


def add_arguments(parser) -> None:
    add_options(parser, *ENGINE, "saved_kv_mib", *SOURCES, *ANSWERS)
    parser.add_argument("--evidence-dump", default=None,
                        help="each retrieval answer's attention per document token, as JSON lines "
                             "(bench/retrieval_evidence.py rerank ranks them again without the model)")
    add_json_option(parser)


def run(args) -> None:
    engines, settings, journal = engines_from(args), settings_from(args), journal_from(args)
    started = time.time()
    log = progress_log(started)
    rows, documents = [], {}
    for source_id, doc, questions, tokens in question_documents(args, engines):
        documents[source_id] = tokens
        rows += run_document(engines, doc, questions, args.systems, settings, log, journal)
    summary = summarise(rows, args.systems)
    report(args, summary, rows, SUMMARY_COLUMNS,
           f"model {args.model}; {len(rows) // max(1, len(args.systems))} questions over {len(documents)} documents "
           f"({', '.join(f'{k} {v:,} tok' for k, v in documents.items())}); budget {args.budget} tokens of document "
           f"per question; chunks of {args.chunk_tokens} tokens; peak RSS {peak_rss_mib():.0f} MiB; "
           f"wall {time.time() - started:.0f} s")
    if any("ev_top1_facts" in r for r in rows):  # retrieval mode's evidence spans (issue 47)
        import retrieval_evidence

        print(table(retrieval_evidence.summary(rows), retrieval_evidence.COLUMNS))



