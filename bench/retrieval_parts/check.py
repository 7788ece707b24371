"""Fetch the sources into the cache and check every question's evidence against kvpage's ingest.

Each source is fetched as `questions` fetches it (pinned sdists from PyPI and a Debian package
holding a 311-page PDF manual, checked by sha256; CUAD contracts) and read with kvpage's ingest;
every evidence quote must be on its file:line (a PDF's: on its page) and every reference answer
must match its own regexes. Prints the problems; exit code 1 when there is one."""

from __future__ import annotations

import sys
from pathlib import Path

from .running import add_options
from .sources import evidence_place, evidence_spans, fetch_source, is_right, load_question_set


def add_arguments(parser) -> None:
    add_options(parser, "cache", "cuad_jsonl")


def run(args) -> None:
    question_set = load_question_set()
    problems = check_evidence(question_set, Path(args.cache).expanduser(), Path(args.cuad_jsonl))
    for problem in problems:
        print(problem)
    count = len(question_set["questions"])
    print(f"{count} questions over {len(question_set['sources'])} sources: "
          f"{'all evidence found' if not problems else f'{len(problems)} problems'}")
    sys.exit(1 if problems else 0)


def check_evidence(question_set: dict, cache: Path, cuad_jsonl: Path) -> list[str]:
    """Problems found: an evidence quote not on its file:line in the ingested document, or a
    reference answer its own regexes do not match."""
    from kvpage_cli.ingest import load

    problems = []
    docs = {}
    for q in question_set["questions"]:
        if q["source"] not in docs:
            path = fetch_source(q["source"], question_set["sources"][q["source"]], cache, cuad_jsonl)
            docs[q["source"]] = load(str(path))
        doc = docs[q["source"]]
        if not is_right(q["answer"], q["regexes"]):
            problems.append(f"{q['id']}: the reference answer does not match its regexes")
        for ev in q["evidence"]:
            if not any(ev["quote"] in doc.text[s.start:s.end] for s in evidence_spans(doc, ev)):
                problems.append(f"{q['id']}: {evidence_place(ev)} does not hold {ev['quote']!r}")
    return problems
