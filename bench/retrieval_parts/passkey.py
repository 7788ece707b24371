"""A 5-digit pass key in haystacks cut from the CUAD contracts of corpus/, found by each system.

Haystacks of --lengths tokens (32K, 128K and 512K by default), the key at --depths percent of
each (10, 50 and 90); reported per length and system as `questions` reports."""

from __future__ import annotations

import random
import re
import time
from typing import Callable

from common import add_json_option, corpus_text, peak_rss_mib

from .running import (ANSWERS, ENGINE, SUMMARY_COLUMNS, Journal, add_options, engines_from, journal_from, progress_log,
                      report, run_document, settings_from, summarise)
from .systems import Engines, RunSettings

PASSKEY_LENGTHS = (32768, 131072, 524288)
PASSKEY_DEPTHS = (10, 50, 90)
PASSKEY_QUESTION = "What is the pass key?"
HAYSTACK_HEADER = "Below is a long text with some important facts hidden in it. Memorize them."


def add_arguments(parser) -> None:
    add_options(parser, *ENGINE, "saved_kv_mib", *ANSWERS)
    parser.add_argument("--lengths", default=",".join(map(str, PASSKEY_LENGTHS)), help="haystack tokens, comma-separated")
    parser.add_argument("--depths", default=",".join(map(str, PASSKEY_DEPTHS)), help="the key's depth in %%, comma-separated")
    add_json_option(parser)


def run(args) -> None:
    engines, settings, journal = engines_from(args), settings_from(args), journal_from(args)
    started = time.time()
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    rows = run_passkey(engines, args.systems, lengths, depths, settings, args.seed, progress_log(started), journal)
    summary = []
    for length in lengths:
        for row in summarise([r for r in rows if r["length"] == length], args.systems):
            summary.append({"length": length, **row})
    report(args, summary, rows, [("length", "haystack tokens")] + SUMMARY_COLUMNS,
           f"model {args.model}; depths {args.depths}%; budget {args.budget} tokens; peak RSS {peak_rss_mib():.0f} MiB; "
           f"wall {time.time() - started:.0f} s")


def haystack_lines(tokenizer, length: int) -> tuple[list[str], list[int]]:
    """Lines of contract text (the corpus's, repeated) holding about `length` tokens, and each
    line's token count on its own."""
    corpus = [line for line in corpus_text().splitlines() if line.strip()]
    counts = [len(ids) for ids in tokenizer(corpus, add_special_tokens=False).input_ids]
    lines, sizes, total = [HAYSTACK_HEADER], [len(tokenizer(HAYSTACK_HEADER, add_special_tokens=False).input_ids)], 0
    while total < length:
        for line, count in zip(corpus, counts):
            lines.append(line)
            sizes.append(count)
            total += count + 1
            if total >= length:
                break
    return lines, sizes


def passkey_document(tokenizer, lines: list[str], sizes: list[int], depth: float, key_seed: int, name: str):
    """A Document of the haystack `lines` with one pass key at `depth` (0-1), and the key.

    The needle replaces a line of the same token count (padded with that line's own words), so
    every haystack of one length has the same tokens but around its needle: a retrieval index of
    one depth shares every other window with the others (the saved-KV cache maps them)."""
    from kvpage_cli.ingest import Document
    from kvpage_cli.ingest.text import line_spans

    key = str(random.Random(key_seed).randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    total = sum(sizes)
    at, seen = 1, 0
    while at < len(lines) and seen + sizes[at] < depth * total:
        seen += sizes[at]
        at += 1
    def tokens(some: list[str]) -> int:
        return len(tokenizer("\n".join(some), add_special_tokens=False).input_ids)

    for index in range(at, len(lines) - 2):
        words = lines[index].split()
        near = lines[index - 1:index + 2]  # a line break can join tokens of the lines beside it
        wanted = tokens(near)
        for cut in range(len(words) + 1):  # the needle, then as many of the line's words as make its count
            padded = " ".join([needle] + words[:cut])
            count = tokens([near[0], padded, near[2]])
            if count == wanted:
                text = "\n".join(lines[:index] + [padded] + lines[index + 1:])
                return Document(source=name, kind="text", text=text, spans=line_spans(text, name)), [key]
            if count > wanted:
                break
    raise SystemExit(f"no line after depth {depth:.0%} can hold the pass key")


def run_passkey(engines: Engines, systems: list[str], lengths: list[int], depths: list[int], settings: RunSettings,
                seed: int, log: Callable[[dict], None], journal: Journal) -> list[dict]:
    tokenizer = engines.tokenizer
    rows = []
    for length in lengths:
        # the document leaves room for the prompt's template, the question and the answer
        lines, sizes = haystack_lines(tokenizer, length - 256)
        for depth in depths:
            # one name per length: the prompt's head is the same for every depth
            doc, expected = passkey_document(tokenizer, lines, sizes, depth / 100, seed * 1000 + length + depth,
                                             f"haystack-{length}.txt")
            needle = doc.text.find(f"The pass key is {expected[0]}")
            assert needle >= 0
            q = {"id": f"passkey-{length}-{depth}", "source": doc.source, "question": PASSKEY_QUESTION,
                 # the key as a number of its own: "187324" is not the key 87324
                 "regexes": [rf"(?<!\d){re.escape(e)}(?!\d)" for e in expected],
                 "evidence_ranges": [(needle, needle + 21)],
                 "tags": {"length": length, "depth": depth, "expected": expected}}
            rows += run_document(engines, doc, [q], systems, settings, log, journal)
            del doc
    return rows
