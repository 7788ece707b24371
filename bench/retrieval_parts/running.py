"""What the parts that run a model share: their command-line options, the documents of the question
set, every system run over a document's questions (journaled, so that a stopped run resumes), the
summary of those rows, and the report: a table on stdout, the result through common.write_result."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from statistics import mean, median
from typing import Callable, Iterator

from common import table, write_result

from .sources import (CUAD_JSONL, DEFAULT_CACHE, evidence_attended, evidence_ranges, fetch_source, is_right,
                      load_question_set)
from .systems import ENGINE_OPTIONS, SYSTEM_FUNCTIONS, SYSTEMS, Engines, NotBuilt, RunSettings


def systems_list(text: str) -> list[str]:
    """--systems: names of SYSTEMS, comma-separated."""
    systems = [s for s in text.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems: {', '.join(sorted(unknown))}")
    return systems


# The options several parts take, by name; each part adds those it reads (add_options).
OPTIONS: dict[str, tuple[tuple[str, ...], dict]] = {
    "model": (("--model",), {"default": "smollm2"}),
    "home": (("--home",), {"default": None, "help": "KVPAGE_HOME for the engine (converted weights)"}),
    "threads": (("--threads",), {"type": int, "default": None}),
    "dtype": (("--dtype",), {"default": "float32", "choices": ("float32", "bfloat16")}),
    "kv_dtype": (("--kv-dtype",), {"default": "auto", "choices": ("auto", "float32", "bfloat16", "int8"),
                                   "help": "the KV blocks' element type (EngineConfig.kv_dtype)"}),
    "activations": (("--activations",), {"default": "auto", "choices": ("auto", "float32", "int8"),
                                         "help": "what quantized weights multiply (EngineConfig.activations)"}),
    "saved_kv_mib": (("--saved-kv-mib",), {
        "type": float, "default": None,
        "help": "index into the saved-KV cache under --home, up to this many MiB: windows leave memory for their files "
                "as they are saved (what a long document needs), and a window already saved (the same tokens after "
                "the same head) is mapped instead of computed"}),
    "sources": (("--sources",), {"default": None, "help": "only these source ids (comma-separated)"}),
    "limit": (("--limit",), {"type": int, "default": None, "help": "at most this many questions per source"}),
    "cache": (("--cache",), {"default": str(DEFAULT_CACHE), "help": "where fetched sources are kept"}),
    "cuad_jsonl": (("--cuad-jsonl",), {"default": str(CUAD_JSONL)}),
    "systems": (("--systems",), {"type": systems_list, "default": ",".join(SYSTEMS),
                                 "help": f"the systems that answer, comma-separated ({', '.join(SYSTEMS)})"}),
    "budget": (("--budget",), {"type": int, "default": 4096,
                               "help": "tokens of document text attended per question, every system"}),
    "chunk_tokens": (("--chunk-tokens",), {"type": int, "default": 256, "help": "BM25 chunk size in tokens"}),
    "order": (("--order",), {"default": "best-last", "choices": ("best-last", "document"),
                             "help": "passages read in document order, or so but the best one last (kvpage's order)"}),
    "max_new_tokens": (("--max-new-tokens",), {"type": int, "default": 48}),
    "seed": (("--seed",), {"type": int, "default": 0}),
    "log": (("--log",), {"default": None,
                         "help": "JSON lines of measured rows; what is already there is not run again"}),
}
ENGINE = ("model", "home", "threads", "dtype", "kv_dtype", "activations")
SOURCES = ("sources", "limit", "cache", "cuad_jsonl")
ANSWERS = ("systems", "budget", "chunk_tokens", "order", "max_new_tokens", "seed", "log")


def add_options(parser: argparse.ArgumentParser, *names: str) -> None:
    """The shared OPTIONS named, in that order."""
    for name in names:
        flags, settings = OPTIONS[name]
        parser.add_argument(*flags, **settings)


def engines_from(args) -> Engines:
    """The engines of --model with the command line's options; retrieval mode's saves its index in
    the saved-KV cache where --saved-kv-mib asks for it (only retrieval mode's index is saved)."""
    saved_mib = getattr(args, "saved_kv_mib", None)
    ENGINE_OPTIONS["retrieval"] = {"kv_cache": True, "cache_mib": saved_mib} if saved_mib else {}
    return Engines(args.model, home=args.home, threads=args.threads, dtype=args.dtype, kv_dtype=args.kv_dtype,
                   activations=args.activations)


def settings_from(args) -> RunSettings:
    """The RunSettings of the options a part takes (the defaults of those it does not). --order
    document also sets retrieval mode's reading order as it was before it read its best passage last."""
    def value(name: str):
        return getattr(args, name, OPTIONS[name][1]["default"])

    if value("order") == "document":
        import kvpage_cli.tasks.ask as ask_task

        ask_task.reading_order = lambda selection, again: sorted(set(selection.blocks) - set(again))
    dump = getattr(args, "evidence_dump", None)
    return RunSettings(value("budget"), value("max_new_tokens"), value("chunk_tokens"), value("order"),
                       Path(dump) if dump else None)


def journal_from(args) -> Journal:
    """The --log journal, its rows keyed by the settings that change an answer."""
    return Journal(Path(args.log) if args.log else None,
                   f"{args.model}|budget {args.budget}|chunks {args.chunk_tokens}|new {args.max_new_tokens}|seed {args.seed}"
                   f"|order {args.order}" + (f"|activations {args.activations}" if args.activations != "auto" else ""))


def progress_log(started: float) -> Callable[[dict], None]:
    """A function that shows a row's main fields on stderr as it is measured, with the seconds since `started`."""
    def log(row: dict) -> None:
        shown = {k: row[k] for k in ("system", "id", "right", "evidence_attended", "first_token_s", "index_s",
                                     "select_s", "kv_read_bytes", "extra_nll", "attended_tokens", "skipped") if k in row}
        if "text" in row:
            shown["text"] = (row.get("text") or "")[:120]
        print(f"[{time.time() - started:6.0f}s] {json.dumps(shown)}", file=sys.stderr, flush=True)

    return log


def question_documents(args, engines: Engines) -> Iterator[tuple[str, object, list[dict], int]]:
    """(source id, document, its questions, its token count) for each source of the question set
    (--sources; at most --limit questions each), fetched into --cache and read with kvpage's
    ingest; each question with the character ranges of its evidence ("evidence_ranges")."""
    from kvpage_cli.ingest import load

    question_set = load_question_set()
    wanted = set(args.sources.split(",")) if args.sources else None
    by_source: dict[str, list[dict]] = {}
    for q in question_set["questions"]:
        if wanted is None or q["source"] in wanted:
            by_source.setdefault(q["source"], []).append(q)
    for source_id, questions in by_source.items():
        questions = questions[:args.limit] if args.limit else questions
        path = fetch_source(source_id, question_set["sources"][source_id], Path(args.cache).expanduser(),
                            Path(args.cuad_jsonl))
        doc = load(str(path))
        questions = [{**q, "evidence_ranges": evidence_ranges(doc, q["evidence"])} for q in questions]
        yield source_id, doc, questions, len(engines.tokenizer(doc.text, add_special_tokens=False).input_ids)


class Journal:
    """Rows already measured (`--log PATH`, JSON lines). A system whose every question over a
    document is there, measured with the same settings, is not run over it again (a document is
    redone whole, so that its first question still pays the indexing); new rows are appended as
    they are measured."""

    def __init__(self, path: Path | None, settings: str) -> None:
        self.path = path
        self.settings = settings
        self.rows: dict[tuple[str, str], dict] = {}
        if path is not None and path.exists():
            with open(path) as f:
                for row in map(json.loads, f):
                    if row.get("settings") == settings:
                        self.rows[(row["system"], row["id"])] = row

    def done(self, system: str, ids: list[str]) -> list[dict] | None:
        found = [self.rows.get((system, i)) for i in ids]
        return found if all(found) else None

    def add(self, row: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({**row, "settings": self.settings}) + "\n")


def run_document(engines: Engines, doc, questions: list[dict], systems: list[str], settings: RunSettings,
                 log: Callable[[dict], None], journal: Journal) -> list[dict]:
    """Every question over one document through every system; one row per (system, question)."""
    rows = []
    for system in systems:
        kept = journal.done(system, [q["id"] for q in questions])
        if kept:
            rows += kept
            continue
        state: dict = {}
        for order, q in enumerate(questions):
            row = {"system": system, "id": q["id"], "source": q["source"], "order": order, "question": q["question"],
                   **q.get("tags", {})}
            try:
                answer = SYSTEM_FUNCTIONS[system](engines.for_system(system), doc, q["question"], state, settings)
            except NotBuilt as exc:
                row.update(skipped=str(exc))
                log(row)
                # the system cannot run over this document: the same for every question
                for later, q2 in enumerate(questions[order:], start=order):
                    rows.append({**row, "id": q2["id"], "order": later, "question": q2["question"]})
                    journal.add(rows[-1])
                break
            row.update(asdict(answer), right=is_right(answer.text, q["regexes"]),
                       evidence_attended=evidence_attended(q["evidence_ranges"], answer.ranges))
            row.pop("ranges")
            if "asker" in state:  # retrieval mode: its evidence spans against the question's facts (issue 47)
                import retrieval_evidence

                row.update(retrieval_evidence.measure(doc, q, state.pop("asker"), state, settings.evidence_dump))
            rows.append(row)
            journal.add(row)
            log(row)
        if "ctx" in state:
            engines.for_system(system).release(state["ctx"])
    return rows


def summarise(rows: list[dict], systems: list[str]) -> list[dict]:
    """One row per system: questions answered (the rest skipped, and why), accuracy, evidence
    attended, first-token times (the first question over a document, indexing included, and the
    next ones), indexing rate, KV read per question, tokens attended."""
    out = []
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        ran = [r for r in mine if "skipped" not in r]
        first = [r for r in ran if r["order"] == 0]
        later = [r for r in ran if r["order"] > 0]
        out.append({
            "system": system,
            "answered": f"{len(ran)}/{len(mine)}",
            "accuracy_pct": 100 * sum(r["right"] for r in ran) / len(ran) if ran else None,
            "evidence_pct": 100 * sum(r["evidence_attended"] for r in ran) / len(ran) if ran else None,
            "ttft_first_s": median(r["first_token_s"] for r in first) if first else None,
            "ttft_next_s": median(r["first_token_s"] for r in later) if later else None,
            "index_s": median(r["index_s"] for r in first) if first else None,
            "index_tok_s": (sum(r.get("indexed_tokens", 0) for r in first) / sum(r["index_s"] for r in first)
                            if first and any(r.get("indexed_tokens") for r in first) else None),
            "kv_first_mib": mean(r["kv_read_bytes"] for r in first) / 2**20 if first else None,
            "kv_next_mib": mean(r["kv_read_bytes"] for r in later) / 2**20 if later else None,
            "attended": int(mean(r["attended_tokens"] for r in ran)) if ran else None,
            "skipped": sorted({r["skipped"].split(":")[0] for r in mine if "skipped" in r}) or None,
        })
    return out


SUMMARY_COLUMNS = [
    ("system", "system"), ("answered", "answered"), ("accuracy_pct", "accuracy %"), ("evidence_pct", "evidence attended %"),
    ("ttft_first_s", "1st token, 1st question s"), ("index_s", "of which indexing s"),
    ("index_tok_s", "indexing tok/s"),
    ("ttft_next_s", "1st token, next questions s"),
    ("kv_first_mib", "KV read 1st q MiB"), ("kv_next_mib", "KV read next q MiB"),
    ("attended", "tokens attended / q"),
]


def report(args, summary: list[dict], rows: list[dict], columns: list[tuple[str, str]], footer: str) -> None:
    """A part's table, its settings line and the documents a system skipped on stdout; the summary and
    every row as the part's result (common.write_result: bench/results/retrieval-PART/, or --json)."""
    print(table(summary, columns))
    print(footer)
    for line in skipped_lines(summary):
        print(line)
    write_result(f"retrieval-{args.part}", args, {"summary": summary, "rows": rows}, args.json_path)


def skipped_lines(summary: list[dict]) -> list[str]:
    return [f"{row['system']}: {'; '.join(row['skipped'])}" for row in summary if row.get("skipped")]
