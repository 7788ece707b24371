"""Two results of one benchmark side by side, as llama.cpp's compare-commits sets two builds.

Each row of A is matched with the row of B that has the same settings (its text fields and the
sizes a benchmark varies: context, batch, rows, blocks ...); for each number both measured, one
line gives A's, B's and B / A. Ratios the benchmark already computed against its peer are left
out unless --metrics names them.

    python bench/compare.py bench/results/engine/A.json bench/results/engine/B.json
    python bench/compare.py A.json B.json --metrics decode_tok_s,prefill_tok_s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402

# Integer fields that say which case a row measured, not what it measured.
SETTINGS = {"context", "prefix", "batch", "rows", "blocks", "queries", "keys", "k", "n", "length", "depth", "tp",
            "window", "overlap", "order", "steps", "context_tokens", "num_q_heads", "num_kv_heads", "head_dim"}
RATIO_MARKS = ("ratio", "_x", "x_", "vs_", "pct", "share")


def rows_of(results) -> list[dict]:
    """The rows a result holds: the list it is, or its "rows" ("decode": kernels_bench's; "cases":
    a migrated longctx log); startup's rows by name become rows with a "name"."""
    if isinstance(results, list):
        return results
    rows = results.get("rows", results.get("decode", results.get("cases")))
    if isinstance(rows, dict):
        return [{"name": name, **row} for name, row in rows.items()]
    return rows if isinstance(rows, list) else []


def settings_of(row: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in row.items()
                        if isinstance(v, str) or (k in SETTINGS and isinstance(v, int) and not isinstance(v, bool))))


def measured(row: dict, metrics: list[str] | None) -> dict[str, float]:
    """The numbers of a row worth setting side by side (all of `metrics` where given)."""
    numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in SETTINGS}
    if metrics:
        return {k: v for k, v in numbers.items() if k in metrics}
    return {k: v for k, v in numbers.items() if not any(mark in k for mark in RATIO_MARKS)}


def compare(a: dict, b: dict, metrics: list[str] | None = None) -> list[dict]:
    """One line per matched row and number: its settings, the number's name, A's, B's and B / A."""
    b_rows = {settings_of(row): row for row in rows_of(b["results"])}
    lines = []
    for row in rows_of(a["results"]):
        other = b_rows.get(settings_of(row))
        if other is None:
            continue
        theirs = measured(other, metrics)
        for name, value in measured(row, metrics).items():
            if name in theirs:
                lines.append({"case": ", ".join(f"{v}" for _, v in settings_of(row)), "measure": name, "a": value,
                              "b": theirs[name], "b_over_a_x": theirs[name] / value if value else None})
    return lines


def describe(document: dict) -> str:
    stamp = document["stamp"]
    commit = (stamp["commit"] or "none")[:7] + ("-dirty" if stamp["dirty"] else "")
    return f"{commit}, {stamp['date'][:10]}, {stamp['cpu']['tag']}" + (", migrated" if stamp["migrated"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="a result file (bench/results/BENCH/...json)")
    parser.add_argument("b", type=Path, help="another result of the same benchmark")
    parser.add_argument("--metrics", default=None, help="only these numbers, comma-separated (ratios included)")
    args = parser.parse_args()
    a, b = (json.loads(path.read_text()) for path in (args.a, args.b))
    if a["bench"] != b["bench"]:
        parser.error(f"{args.a} is a result of {a['bench']}, {args.b} of {b['bench']}")
    lines = compare(a, b, args.metrics.split(",") if args.metrics else None)
    if not lines:
        raise SystemExit("no row of A has a row of B with the same settings")
    print(f"A: {args.a} ({describe(a)})\nB: {args.b} ({describe(b)})")
    print(table(lines, [("case", "case"), ("measure", "measure"), ("a", "A"), ("b", "B"), ("b_over_a_x", "B / A")]))


if __name__ == "__main__":
    main()
