"""Train the review's clause-category head on CUAD and write it as package data.

    pip install scikit-learn            # training only (pip install -e ".[train]")
    python bench/train_clauses.py       # writes kvpage_cli/tasks/heads/clauses-lexical.npz

The split is by contract (bench/cuad.py: seed 13, 50 development contracts never trained on).
Each training contract is cut with the review's own split_clauses and each clause labelled with
the categories whose expert spans it overlaps. One logistic regression per category over tf-idf
of words and word pairs (classifier.terms); each category's threshold is tuned for
contract-level presence (a contract has a category when one clause reaches it) on out-of-fold
predictions over the training contracts (3 folds by contract), so the development split is used
only to report. The written head holds the arrays the runtime applies with numpy, and a check:
the trainer's own probabilities for a few development clauses, which tests compare with the
runtime's (tests/test_classifier.py).

--variants also fits the other settings compared on the development split and prints them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuad  # noqa: E402
from common import add_json_option, write_result  # noqa: E402

from kvpage_cli.tasks.classifier import HEAD_FORMAT, LEXICAL_HEAD, terms  # noqa: E402
from kvpage_cli.tasks.taxonomy import CATEGORIES  # noqa: E402

OUT = cuad.REPO / "kvpage_cli" / "tasks" / "heads" / LEXICAL_HEAD
FOLDS = 3


def dataset(contracts):
    """Clause texts, their label sets, the index of their contract, and per-contract presence."""
    texts, labels, owner, truth = [], [], [], []
    for n, contract in enumerate(contracts):
        doc, clauses = cuad.read(contract)
        spans = cuad.expert_spans(doc.text, contract.labels)
        for clause, found in zip(clauses, cuad.clause_labels(clauses, spans)):
            texts.append(clause.text)
            labels.append(found)
            owner.append(n)
        truth.append({c for c in CATEGORIES if cuad.present(contract.labels, c)})
    return texts, labels, np.array(owner), truth


def fit(X, Y, c_value: float):
    """One logistic regression per category (two at a time), None for a category without positives."""
    from joblib import Parallel, delayed
    from sklearn.linear_model import LogisticRegression

    X = X.tocsr()
    X.sum_duplicates()
    X.sort_indices()  # done here: the workers get a read-only copy

    def one(y):
        return LogisticRegression(C=c_value, solver="liblinear", tol=1e-3).fit(X, y) if y.sum() else None

    return Parallel(n_jobs=2)(delayed(one)(Y[:, j]) for j in range(Y.shape[1]))


def predict(models, X) -> np.ndarray:
    out = np.zeros((X.shape[0], len(models)), dtype=np.float64)
    for j, m in enumerate(models):
        if m is not None:
            out[:, j] = m.predict_proba(X)[:, 1]
    return out


def contract_max(probs: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
    out = np.zeros((count, probs.shape[1]))
    np.maximum.at(out, owner, probs)
    return out


def truth_matrix(truth, categories) -> np.ndarray:
    return np.array([[c in t for c in categories] for t in truth], dtype=bool)


def tune_thresholds(scores: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per category, the threshold with the best F1 of contract-level presence."""
    grid = np.linspace(0.05, 0.99, 95)
    best = np.full(scores.shape[1], 0.5)
    for j in range(scores.shape[1]):
        f1s = []
        for t in grid:
            pred = scores[:, j] >= t
            tp = (pred & truth[:, j]).sum()
            f1s.append(2 * tp / max(1, pred.sum() + truth[:, j].sum()))
        best[j] = grid[int(np.argmax(f1s))]
    return best


def prf(pred: np.ndarray, truth: np.ndarray) -> dict:
    tp, fp, fn = int((pred & truth).sum()), int((pred & ~truth).sum()), int((~pred & truth).sum())
    p, r = tp / max(1, tp + fp), tp / max(1, tp + fn)
    return {"tp": tp, "fp": fp, "fn": fn, "precision": p, "recall": r, "f1": 2 * p * r / max(1e-9, p + r)}


def train(train_set, c_value: float, max_features: int, min_df: int, seed: int):
    """Fits the vectorizer and heads on the training contracts; thresholds from out-of-fold scores."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    texts, labels, owner, truth = train_set
    categories = list(CATEGORIES)
    Y = np.array([[c in found for c in categories] for found in labels], dtype=np.int8)
    rng = np.random.default_rng(seed)
    fold_of_contract = rng.permutation(len(truth)) % FOLDS
    oof = np.zeros(Y.shape, dtype=np.float64)
    for fold in range(FOLDS):
        held = fold_of_contract[owner] == fold
        vec = TfidfVectorizer(analyzer=terms, min_df=min_df, max_features=max_features, sublinear_tf=True)
        X = vec.fit_transform([t for t, h in zip(texts, held) if not h])
        models = fit(X, Y[~held], c_value)
        oof[held] = predict(models, vec.transform([t for t, h in zip(texts, held) if h]))
        print(f"  fold {fold + 1}/{FOLDS} fitted", file=sys.stderr, flush=True)
    thresholds = tune_thresholds(contract_max(oof, owner, len(truth)), truth_matrix(truth, categories))
    vec = TfidfVectorizer(analyzer=terms, min_df=min_df, max_features=max_features, sublinear_tf=True)
    X = vec.fit_transform(texts)
    models = fit(X, Y, c_value)
    return vec, models, thresholds


def evaluate(vec, models, thresholds, dev_set, categories) -> dict:
    texts, _, owner, truth = dev_set
    probs = predict(models, vec.transform(texts))
    pred = contract_max(probs, owner, len(truth)) >= thresholds
    gold = truth_matrix(truth, categories)
    per = {c: prf(pred[:, j], gold[:, j]) for j, c in enumerate(categories)}
    return {"micro": prf(pred, gold), "per_category": per, "probs": probs}


def write(path: Path, vec, models, thresholds, meta: dict, check_texts, check_probs) -> None:
    categories = list(CATEGORIES)
    vocabulary = np.array(vec.get_feature_names_out().tolist())
    coef = np.zeros((len(categories), len(vocabulary)), dtype=np.float32)
    intercept = np.full(len(categories), -30.0, dtype=np.float32)  # a category never seen in training: never present
    for j, m in enumerate(models):
        if m is not None:
            coef[j] = m.coef_[0]
            intercept[j] = m.intercept_[0]
    meta = dict(meta, format=HEAD_FORMAT, check_texts=check_texts, check_probabilities=check_probs)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), categories=np.array(categories), vocabulary=vocabulary,
                        idf=vec.idf_.astype(np.float32), coef=coef, intercept=intercept,
                        thresholds=thresholds.astype(np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contracts", default=None, help="contracts.jsonl (default: ../shared/cuad/)")
    parser.add_argument("--seed", type=int, default=cuad.SEED)
    parser.add_argument("--C", dest="c_value", type=float, default=4.0)
    parser.add_argument("--max-features", type=int, default=20000)
    parser.add_argument("--min-df", type=int, default=3)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--variants", action="store_true", help="also fit and report the other settings on dev")
    add_json_option(parser)
    args = parser.parse_args()

    started = time.time()
    train_contracts, dev_contracts = cuad.split(cuad.load_contracts(args.contracts), args.seed)
    train_set, dev_set = dataset(train_contracts), dataset(dev_contracts)
    categories = list(CATEGORIES)
    print(f"train: {len(train_contracts)} contracts, {len(train_set[0])} clauses; "
          f"dev: {len(dev_contracts)} contracts, {len(dev_set[0])} clauses", file=sys.stderr)
    settings = [(args.c_value, args.max_features, args.min_df)]
    if args.variants:
        settings += [(1.0, 20000, 3), (16.0, 20000, 3), (4.0, 5000, 3), (4.0, 50000, 2)]
    report = []
    chosen = None
    for c_value, max_features, min_df in settings:
        vec, models, thresholds = train(train_set, c_value, max_features, min_df, args.seed)
        result = evaluate(vec, models, thresholds, dev_set, categories)
        micro = result["micro"]
        report.append({"C": c_value, "max_features": max_features, "min_df": min_df, **micro})
        print(f"C={c_value} features={max_features} min_df={min_df}: dev micro P {micro['precision']:.3f} "
              f"R {micro['recall']:.3f} F1 {micro['f1']:.3f} ({time.time() - started:.0f} s)", file=sys.stderr)
        if chosen is None:
            chosen = (vec, models, thresholds, result)
    vec, models, thresholds, result = chosen
    check = list(range(0, len(dev_set[0]), max(1, len(dev_set[0]) // 8)))[:8]
    meta = {
        "head": "lexical", "trained_on": "CUAD v1 (../shared/cuad/contracts.jsonl)",
        "command": "python bench/train_clauses.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "seed": args.seed, "dev_contracts": [c.name for c in dev_contracts],
        "train_contracts": len(train_contracts), "train_clauses": len(train_set[0]),
        "C": args.c_value, "max_features": args.max_features, "min_df": args.min_df, "folds": FOLDS,
        "dev_micro": {k: round(v, 4) for k, v in result["micro"].items()},
    }
    write(Path(args.out), vec, models, thresholds, meta, [dev_set[0][i] for i in check],
          [[round(float(p), 6) for p in result["probs"][i]] for i in check])
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    write_result("train_clauses", args, {"variants": report, "per_category": result["per_category"]}, args.json_path)


if __name__ == "__main__":
    main()
