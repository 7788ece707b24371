"""Review quality against CUAD's expert labels, on the development split (bench/cuad.py).

Contract-level presence of the 14 risk categories below (a contract has one when the experts
marked any of its CUAD categories; a method finds one when it flags any clause with it):
per-category and micro precision, recall and F1, for every method compared:
- lexical: the shipped lexical head (the review's detector), over every development contract;
- values-head: a logistic regression on the model's pooled value vectors of each clause, and
- zero-shot: today's calibrated zero-shot scoring (single label per clause), both from the
  features bench/clause_features.py wrote for a model (--features MODEL=PATH), the head fitted
  here on that file's training contracts with thresholds from their out-of-fold scores;
- review: the findings of full `Reviewer` runs with each model (--reviews N contracts), which
  also give the share of true positives whose quote overlaps an expert span, clause-level
  figures (of the clauses flagged with a category, those overlapping an expert span of it; of
  the experts' spans, those a clause flagged with their category overlaps), and the accuracy
  of the key terms against CUAD's normalised answers: Governing Law (case-insensitive
  containment either way), Renewal Term and Notice Period To Terminate Renewal (the same
  number and unit as a duration in the answer, or containment).

    python bench/review_quality.py --reviews 10 --models smollm2,gemma3-270m \\
        --features smollm2=/tmp/features-smollm2.npz
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuad  # noqa: E402
from common import add_json_option, table, write_result  # noqa: E402

from kvpage_cli.tasks.taxonomy import CATEGORIES  # noqa: E402
from kvpage_cli.tasks.values import duration_parts, in_unit  # noqa: E402
from kvpage_cli.tasks.zero_shot import TO_CUAD as ZERO_SHOT_TO_CUAD  # noqa: E402

# the 14 risk categories compared -> the CUAD categories that count as the same thing (the zero-shot
# classifier's own table: its categories bear these names)
RISK: dict[str, tuple[str, ...]] = ZERO_SHOT_TO_CUAD
GROUPS = list(RISK)
VALUE_TERMS = {"Governing Law": "Governing law", "Renewal Term": "Renewal term",
               "Notice Period To Terminate Renewal": "Notice to stop renewal"}


def truth_groups(labels: dict) -> set[str]:
    return {g for g, names in RISK.items() if any(cuad.present(labels, n) for n in names)}


def groups_of(cuad_names) -> set[str]:
    names = set(cuad_names)
    return {g for g, members in RISK.items() if names & set(members)}


def prf(pred: list[set[str]], truth: list[set[str]]) -> dict:
    """Micro and per-group precision, recall, F1 of contract-level presence."""
    def score(tp, fp, fn):
        p, r = tp / max(1, tp + fp), tp / max(1, tp + fn)
        return {"tp": tp, "fp": fp, "fn": fn, "precision": round(p, 3), "recall": round(r, 3),
                "f1": round(2 * p * r / max(1e-9, p + r), 3)}

    per = {}
    for g in GROUPS:
        tp = sum(g in p and g in t for p, t in zip(pred, truth))
        fp = sum(g in p and g not in t for p, t in zip(pred, truth))
        fn = sum(g not in p and g in t for p, t in zip(pred, truth))
        per[g] = score(tp, fp, fn)
    micro = score(*(sum(per[g][k] for g in GROUPS) for k in ("tp", "fp", "fn")))
    return {"micro": micro, "per_category": per}


# -- methods -----------------------------------------------------------------------------------

def lexical(dev) -> list[set[str]]:
    from kvpage_cli.tasks.classifier import lexical_head

    head = lexical_head()
    out = []
    for contract in dev:
        _, clauses = cuad.read(contract)
        present = head.present(head.probabilities([c.text for c in clauses])).any(axis=0)
        out.append(groups_of(c for c, on in zip(head.categories, present) if on))
    return out


def from_features(path: str, dev_names: list[str]) -> dict[str, list[set[str]]]:
    """values-head and zero-shot presence per development contract, from clause_features.py's file."""
    from sklearn.linear_model import LogisticRegression

    data = np.load(path, allow_pickle=False)
    X, Y, owner, split = data["features"].astype(np.float32), data["labels"], data["owner"], data["split"]
    names = data["contracts"].tolist()
    X = X / np.maximum(1e-6, np.linalg.norm(X, axis=1, keepdims=True))
    train_rows = np.array([split[o] == "train" for o in owner])
    categories = list(CATEGORIES)
    # out-of-fold contract-level thresholds on the training contracts (3 folds by contract)
    train_contracts = sorted({int(o) for o in owner[train_rows]})
    fold = {c: i % 3 for i, c in enumerate(train_contracts)}
    scores = np.zeros(Y.shape)
    for f in range(3):
        fit_rows = train_rows & np.array([fold.get(int(o), -1) != f for o in owner])
        held = train_rows & ~fit_rows
        for j in range(len(categories)):
            if Y[fit_rows, j].any() and not Y[fit_rows, j].all():
                model = LogisticRegression(C=1.0, max_iter=500).fit(X[fit_rows], Y[fit_rows, j])
                scores[held, j] = model.predict_proba(X[held])[:, 1]
    thresholds = []
    for j in range(len(categories)):
        best, best_f1 = 0.5, -1.0
        for t in np.linspace(0.05, 0.95, 19):
            tp = fp = fn = 0
            for c in train_contracts:
                rows = owner == c
                p, y = bool((scores[rows, j] >= t).any()), bool(Y[rows, j].any())
                tp, fp, fn = tp + (p and y), fp + (p and not y), fn + (not p and y)
            f1 = 2 * tp / max(1, 2 * tp + fp + fn)
            if f1 > best_f1:
                best, best_f1 = t, f1
        thresholds.append(best)
    dev_scores = np.zeros(Y.shape)
    dev_rows = ~train_rows
    for j in range(len(categories)):
        if Y[train_rows, j].any() and not Y[train_rows, j].all():
            model = LogisticRegression(C=1.0, max_iter=500).fit(X[train_rows], Y[train_rows, j])
            dev_scores[dev_rows, j] = model.predict_proba(X[dev_rows])[:, 1]
    zero_names = data["zero_shot_categories"].tolist()
    zero = data["zero_shot"]
    head_out, zero_out = [], []
    for name in dev_names:
        n = names.index(name) if name in names else -1
        rows = (owner == n) & dev_rows
        flagged = [c for j, c in enumerate(categories) if (dev_scores[rows, j] >= thresholds[j]).any()]
        head_out.append(groups_of(flagged))
        picks = {zero_names[k] for k in zero[rows].argmax(axis=1)} if rows.any() else set()
        zero_out.append(groups_of(c for p in picks for c in ZERO_SHOT_TO_CUAD.get(p, ())))
    return {"values-head": head_out, "zero-shot": zero_out,
            "covered": [name in names for name in dev_names], "train_contracts": len(train_contracts)}


# -- full reviews --------------------------------------------------------------------------------

def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def value_right(category: str, ours: str | None, answer: str) -> bool:
    if not ours:
        return False
    a, o = _norm(answer), _norm(ours)
    if o in a or (a and a in o):
        return True
    if category == "Governing Law":
        return False
    parts = duration_parts(o)
    if parts is None:
        return False
    ours_days = in_unit(o, "day")
    for piece in re.split(r"[;,]| or ", a):
        theirs = in_unit(piece, "day")
        if theirs is not None and abs(theirs - ours_days) <= 5:  # "12 months" and "1 year" are the same term
            return True
    return False


def review(engine, contract, batch: int | None):
    from kvpage_cli.tasks import Reviewer

    doc, clauses = cuad.read(contract)
    started = time.time()
    reviewer = Reviewer(engine, doc, clauses, max_batch=batch)
    findings = reviewer.findings()
    seconds = time.time() - started
    spans = cuad.expert_spans(doc.text, contract.labels)
    truth = truth_groups(contract.labels)
    flagged: dict[str, list] = {}
    for f in findings:
        for a in f.assessments:
            for g in groups_of([a.cuad]):
                if f not in flagged.setdefault(g, []):  # a finding counts once per category group
                    flagged[g].append(f)
    pred = set(flagged)
    overlap = {}
    for g in pred & truth:
        ranges = [r for name in RISK[g] for r in spans.get(name, [])]
        overlap[g] = any(min(f.end, e) > max(f.start, s) for f in flagged[g] for s, e in ranges)
    # clause level: each (finding's clause, category) flagged, whether the clause overlaps an expert span of
    # the category; each expert span, whether a clause flagged with its category overlaps it
    ranges_of = {g: [r for name in RISK[g] for r in spans.get(name, [])] for g in GROUPS}
    clause_of = {id(f): next((c for c in clauses if c.start <= f.start < c.end), None) for f in findings}
    pairs = [(g, c) for g, fs in flagged.items() for f in fs if (c := clause_of[id(f)]) is not None]
    right = [any(min(c.end, e) > max(c.start, s) for s, e in ranges_of[g]) for g, c in pairs]
    covered = [any(min(c.end, e) > max(c.start, s) for f in flagged.get(g, []) if (c := clause_of[id(f)]) is not None)
               for g in GROUPS for s, e in ranges_of[g]]
    terms = {t.label: " and ".join(v.text for v in t.values) for t in reviewer.terms}
    values = {}
    for category, label in VALUE_TERMS.items():
        answer = str((contract.labels.get(category) or {}).get("answer", "")).strip()
        if answer and cuad.present(contract.labels, category):
            values[category] = {"answer": answer, "ours": terms.get(label), "right": value_right(category, terms.get(label), answer)}
    return {"contract": contract.name, "mode": reviewer.mode, "clauses": len(clauses), "findings": len(findings),
            "seconds": round(seconds, 1), "pred": sorted(pred), "truth": sorted(truth),
            "quote_overlap": overlap, "values": values,
            "clauses_flagged": {"flagged": len(right), "in_spans": sum(right),
                                "outside": [[g, " ".join(doc.text[c.start:c.end].split())[:160]]
                                            for (g, c), ok in zip(pairs, right) if not ok]},
            "spans_found": {"spans": len(covered), "found": sum(covered)}}


def _logged(path: str | None, model: str) -> dict[str, dict]:
    """The reviews of `model` a --log file holds, by contract."""
    if not path or not Path(path).exists():
        return {}
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            if item.pop("model") == model:
                out[item["contract"]] = item
    return out


def _fmt(micro: dict) -> dict:
    return {k: f"{v:.2f}" if isinstance(v, float) else v for k, v in micro.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--reviews", type=int, default=10, help="development contracts reviewed in full per model")
    parser.add_argument("--max-chars", type=int, default=None,
                        help="review only development contracts of at most this many characters (the first --reviews of them)")
    parser.add_argument("--features", action="append", default=[], help="MODEL=PATH of bench/clause_features.py")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--contracts", default=None)
    add_json_option(parser)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of each model's engine")
    parser.add_argument("--log", default=None,
                        help="append each full review to this file (JSON lines) and take the ones already there "
                             "instead of reviewing those contracts again (a stopped run resumes)")
    args = parser.parse_args()

    _, dev = cuad.split(cuad.load_contracts(args.contracts))
    truth = [truth_groups(c.labels) for c in dev]
    report: dict = {"dev_contracts": len(dev), "methods": {}}
    rows = []
    lex = prf(lexical(dev), truth)
    report["methods"]["lexical"] = lex
    rows.append({"method": "lexical head (any model)", "contracts": len(dev), **_fmt(lex["micro"])})
    for item in args.features:
        model, path = item.split("=", 1)
        got = from_features(path, [c.name for c in dev])
        covered = got.pop("covered")
        train_count = got.pop("train_contracts")
        keep = [i for i, c in enumerate(covered) if c]
        for method, pred in got.items():
            result = prf([pred[i] for i in keep], [truth[i] for i in keep])
            result["train_contracts"] = train_count
            report["methods"][f"{method} {model}"] = result
            rows.append({"method": f"{method} ({model}, trained on {train_count})" if method == "values-head"
                         else f"{method} ({model})", "contracts": len(keep), **_fmt(result["micro"])})
        if len(keep) < len(dev):  # the lexical head on the same contracts, once per model, for comparison
            keep_lex = prf([lexical_pred for i, lexical_pred in enumerate(lexical(dev)) if i in keep],
                           [truth[i] for i in keep])
            rows.append({"method": "lexical head, same contracts", "contracts": len(keep), **_fmt(keep_lex["micro"])})
    from kvpage_cli.engine import Engine, EngineConfig

    reviews = {}
    for model in [m for m in args.models.split(",") if m]:
        engine = Engine.load(model, EngineConfig(threads=args.threads))
        logged = _logged(args.log, model)
        done = []
        chosen = [c for c in dev if args.max_chars is None or len(c.text) <= args.max_chars][:args.reviews]
        for contract in chosen:
            if contract.name in logged:
                done.append(logged[contract.name])
                continue
            done.append(review(engine, contract, args.batch))
            print(json.dumps(done[-1]), file=sys.stderr, flush=True)
            if args.log:
                with open(args.log, "a") as log:
                    log.write(json.dumps({"model": model, **done[-1]}) + "\n")
        reviews[model] = done
        result = prf([set(d["pred"]) for d in done], [set(d["truth"]) for d in done])
        tps = [v for d in done for v in d["quote_overlap"].values()]
        result["quote_overlap"] = {"overlapping": sum(tps), "true_positives": len(tps)}
        result["values"] = {}
        for category in VALUE_TERMS:
            judged = [d["values"][category]["right"] for d in done if category in d["values"]]
            result["values"][category] = {"right": sum(judged), "contracts": len(judged)}
        result["seconds"] = [d["seconds"] for d in done]
        if all("clauses_flagged" in d for d in done):  # reviews logged before this was measured lack it
            flagged_n, in_spans = (sum(d["clauses_flagged"][k] for d in done) for k in ("flagged", "in_spans"))
            spans_n, found = (sum(d["spans_found"][k] for d in done) for k in ("spans", "found"))
            result["clauses"] = {"flagged": flagged_n, "in_spans": in_spans, "spans": spans_n, "found": found}
        report["methods"][f"review {model}"] = result
        row = {"method": f"review ({model})", "contracts": len(done), **_fmt(result["micro"]),
               "quotes": f"{sum(tps)}/{len(tps)}"}
        for category, short in (("Governing Law", "law"), ("Renewal Term", "renewal"),
                                ("Notice Period To Terminate Renewal", "notice")):
            v = result["values"][category]
            row[short] = f"{v['right']}/{v['contracts']}"
        row["s_per_contract"] = round(sum(result["seconds"]) / max(1, len(done)), 1)
        if "clauses" in result:
            row["clause_p"] = f'{result["clauses"]["in_spans"]}/{result["clauses"]["flagged"]}'
            row["span_r"] = f'{result["clauses"]["found"]}/{result["clauses"]["spans"]}'
        rows.append(row)
    report["reviews"] = reviews
    print(table(rows, [("method", "method"), ("contracts", "contracts"), ("precision", "micro P"), ("recall", "micro R"),
                       ("f1", "micro F1"), ("quotes", "quote overlaps"), ("law", "governing law"),
                       ("renewal", "renewal term"), ("notice", "renewal notice"), ("clause_p", "clauses in spans"),
                       ("span_r", "spans found"), ("s_per_contract", "s / contract")]))
    per = [{"category": g, **{f"{m} F1": f'{report["methods"][m]["per_category"][g]["f1"]:.2f}' for m in report["methods"]}}
           for g in GROUPS]
    print(table(per, [("category", "category")] + [(f"{m} F1", f"{m} F1") for m in report["methods"]]))
    write_result("review_quality", args, report, args.json_path)


if __name__ == "__main__":
    main()
