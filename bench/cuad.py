"""CUAD for training and evaluating the review: the split by contract, and labels per clause.

The 494 contracts of ../shared/cuad/contracts.jsonl are split once, by contract, with a recorded
seed: DEV_CONTRACTS of them form the development split, never trained on; the rest train. Each
contract is read as `kvpage review contract.txt` reads it (ingest.read_text) and cut with the
review's own `split_clauses`, so training sees the clauses a review sees. A clause is labelled
with a category when it overlaps an expert span of that category (by at least OVERLAP_CHARS
characters, or the whole span when it is shorter).
"""

from __future__ import annotations

import bisect
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = REPO.parent / "shared" / "cuad" / "contracts.jsonl"
SEED = 13
DEV_CONTRACTS = 50
OVERLAP_CHARS = 30


@dataclass
class Contract:
    name: str
    kind: str
    text: str
    labels: dict


def contracts_path(path: str | None = None) -> Path:
    if path:
        return Path(path)
    for candidate in (CONTRACTS, Path("/work/shared/cuad/contracts.jsonl")):
        if candidate.exists():
            return candidate
    raise SystemExit(f"CUAD contracts not found at {CONTRACTS}; pass --contracts PATH")


def load_contracts(path: str | None = None) -> list[Contract]:
    with open(contracts_path(path), encoding="utf-8") as f:
        return [Contract(d["cuad_filename"], d["contract_type"], d["text"], d["labels"]) for d in map(json.loads, f)]


def split(contracts: list[Contract], seed: int = SEED, dev: int = DEV_CONTRACTS) -> tuple[list[Contract], list[Contract]]:
    """(train, dev): a seeded shuffle of the contracts by file name, the first `dev` for development."""
    order = sorted(contracts, key=lambda c: c.name)
    random.Random(seed).shuffle(order)
    return order[dev:], order[:dev]


def _collapsed(text: str) -> tuple[str, list[int]]:
    """The text with every whitespace run made one space, lower-cased, and each character's offset in `text`."""
    out, where, space = [], [], False
    for i, ch in enumerate(text):
        if ch.isspace():
            if not space and out:
                out.append(" ")
                where.append(i)
            space = True
            continue
        out.append(ch.lower())
        where.append(i)
        space = False
    return "".join(out), where


def expert_spans(text: str, labels: dict) -> dict[str, list[tuple[int, int]]]:
    """CUAD category -> the (start, end) offsets in `text` of its expert spans (parts split at
    <omitted>; a span found nowhere is left out)."""
    collapsed, where = _collapsed(text)
    found: dict[str, list[tuple[int, int]]] = {}
    for category, entry in labels.items():
        for clause in entry.get("clauses") or []:
            for part in clause.split("<omitted>"):
                needle = re.sub(r"\s+", " ", part).strip().lower()
                if len(needle) < 3:
                    continue
                at = collapsed.find(needle)
                if at < 0:
                    continue
                found.setdefault(category, []).append((where[at], where[at + len(needle) - 1] + 1))
    return found


def clause_labels(clauses, spans: dict[str, list[tuple[int, int]]]) -> list[set[str]]:
    """Per clause, the categories whose expert spans it overlaps."""
    starts = [c.start for c in clauses]
    out: list[set[str]] = [set() for _ in clauses]
    for category, ranges in spans.items():
        for s, e in ranges:
            need = min(OVERLAP_CHARS, e - s)
            i = max(0, bisect.bisect_right(starts, s) - 1)
            while i < len(clauses) and clauses[i].start < e:
                c = clauses[i]
                if min(c.end, e) - max(c.start, s) >= need:
                    out[i].add(category)
                i += 1
    return out


def present(labels: dict, category: str) -> bool:
    """Whether the experts marked the category present in the contract (a Yes, or a value and a span)."""
    entry = labels.get(category) or {}
    answer = str(entry.get("answer", "")).strip().lower()
    return bool(entry.get("clauses")) and answer not in ("", "no", "[]")


def read(contract: Contract):
    """The contract as the review reads a text file, and its clauses."""
    from kvpage_cli.ingest import split_clauses
    from kvpage_cli.ingest.text import read_text

    doc = read_text(contract.text.encode("utf-8"), display=contract.name)
    return doc, split_clauses(doc)
