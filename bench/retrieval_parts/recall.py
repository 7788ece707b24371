"""No answers: how often the BM25 packing of each question holds its evidence lines.

The text baseline's retrieval alone, at the budget (quick, no decoding): each document cut into
--chunk-tokens chunks, ranked by BM25 against the question and packed into --budget tokens."""

from __future__ import annotations

from statistics import mean

from common import add_json_option

from .running import ENGINE, SOURCES, add_options, engines_from, question_documents, report, settings_from
from .sources import evidence_attended
from .systems import BM25Chunks, RunSettings


def add_arguments(parser) -> None:
    add_options(parser, *ENGINE, *SOURCES, "budget", "chunk_tokens")
    add_json_option(parser)


def run(args) -> None:
    engines, settings = engines_from(args), settings_from(args)
    rows, documents = [], {}
    for source_id, doc, questions, tokens in question_documents(args, engines):
        documents[source_id] = tokens
        rows += bm25_recall(engines.tokenizer, doc, questions, settings)
    summary = [{"source": s, "questions": len(mine), "evidence_pct": 100 * mean(r["evidence_attended"] for r in mine)}
               for s in documents for mine in [[r for r in rows if r["source"] == s]]]
    summary.append({"source": "all", "questions": len(rows),
                    "evidence_pct": 100 * mean(r["evidence_attended"] for r in rows)})
    report(args, summary, rows, [("source", "source"), ("questions", "questions"),
                                 ("evidence_pct", "evidence in BM25 pack %")],
           f"model {args.model} (tokenizer); budget {args.budget} tokens; chunks of {args.chunk_tokens} tokens")


def bm25_recall(tokenizer, doc, questions: list[dict], settings: RunSettings) -> list[dict]:
    """For each question, whether the BM25 packing at the budget holds all its evidence (no decoding)."""
    index = BM25Chunks(doc, tokenizer, settings.chunk_tokens)
    rows = []
    for q in questions:
        _, chosen = index.pack(doc, tokenizer, q["question"], settings.budget)
        rows.append({"id": q["id"], "source": q["source"], "chunks": len(chosen),
                     "evidence_attended": evidence_attended(q["evidence_ranges"], [(c.start, c.end) for c in chosen])})
    return rows
