"""Review quality against CUAD's expert labels: precision and recall of the categories flagged.

For each contract, the categories the review assigns to at least one clause (mapped to CUAD's
names; kvpage categories with no CUAD counterpart are left out) are compared with the CUAD
categories the experts answered "Yes" for (among those with a counterpart). Also reported:
for each CUAD category found in a contract, whether a finding of that category quotes text that
overlaps one of the expert-highlighted spans.

    python bench/review_quality.py corpus/cuad/01-affiliate-short corpus/cuad/02-ip-short corpus/cuad/03-endorsement-short
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402

# kvpage category -> CUAD categories that count as the same thing
TO_CUAD = {
    "governing law": ["Governing Law"],
    "liability cap": ["Cap On Liability"],
    "uncapped liability": ["Uncapped Liability"],
    "termination for convenience": ["Termination For Convenience"],
    "auto-renewal and renewal notice": ["Renewal Term", "Notice Period To Terminate Renewal"],
    "non-compete": ["Non-Compete", "No-Solicit Of Customers", "No-Solicit Of Employees"],
    "exclusivity": ["Exclusivity"],
    "change of control": ["Change Of Control"],
    "anti-assignment": ["Anti-Assignment"],
    "liquidated damages": ["Liquidated Damages"],
    "audit rights": ["Audit Rights"],
    "ip assignment": ["Ip Ownership Assignment"],
    "warranty": ["Warranty Duration"],
    "insurance": ["Insurance"],
}


def labelled(labels: dict) -> dict[str, list[str]]:
    """kvpage categories the experts marked present -> their highlighted spans."""
    out = {}
    for ours, theirs in TO_CUAD.items():
        spans = []
        for name in theirs:
            entry = labels.get(name) or {}
            answer = str(entry.get("answer", "")).strip().lower()
            clauses = entry.get("clauses") or []
            if answer not in ("", "no", "[]") and clauses:
                spans += [part.strip() for c in clauses for part in c.split("<omitted>") if part.strip()]
        if spans:
            out[ours] = spans
    return out


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--home", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import Reviewer

    engine = Engine.load(args.model, EngineConfig(home=args.home))
    rows, totals = [], {"tp": 0, "fp": 0, "fn": 0}
    for folder in map(Path, args.folders):
        labels = json.loads((folder / "labels.json").read_text())["labels"]
        truth = labelled(labels)
        doc = load(str(folder / "contract.pdf"))
        started = time.time()
        findings = list(Reviewer(engine, doc).findings())
        flagged: dict[str, list] = {}
        for f in findings:
            if f.category in TO_CUAD:
                flagged.setdefault(f.category, []).append(f)
        tp = sorted(set(flagged) & set(truth))
        fp = sorted(set(flagged) - set(truth))
        fn = sorted(set(truth) - set(flagged))
        located = sum(
            any(normalise(span)[:60] in normalise(doc.text[f.start - 400:f.end + 400]) for f in flagged[c] for span in truth[c])
            for c in tp
        )
        totals["tp"] += len(tp)
        totals["fp"] += len(fp)
        totals["fn"] += len(fn)
        rows.append({
            "contract": folder.name, "clauses": len(findings), "seconds": time.time() - started,
            "precision_pct": 100 * len(tp) / max(1, len(tp) + len(fp)), "recall_pct": 100 * len(tp) / max(1, len(tp) + len(fn)),
            "tp": ", ".join(tp), "fp": ", ".join(fp), "fn": ", ".join(fn), "quote_near_label": f"{located}/{len(tp)}",
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    precision = totals["tp"] / max(1, totals["tp"] + totals["fp"])
    recall = totals["tp"] / max(1, totals["tp"] + totals["fn"])
    rows.append({"contract": "all", "precision_pct": 100 * precision, "recall_pct": 100 * recall})
    print(table(rows, [("contract", "contract"), ("clauses", "clauses"), ("seconds", "s"), ("precision_pct", "precision %"),
                       ("recall_pct", "recall %"), ("quote_near_label", "quote near label"), ("fp", "false positives"),
                       ("fn", "missed")]))
    print(f"model {args.model}; categories compared: {len(TO_CUAD)} with a CUAD counterpart")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
