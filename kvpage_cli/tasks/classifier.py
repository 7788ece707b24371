"""Clause categories from a trained head: multi-label, one logistic regression per CUAD category.

The lexical head reads a clause's words and word pairs (tf-idf, as `bench/train_clauses.py`
computed them with scikit-learn) and gives each category a probability on its own, so a clause
can be anti-assignment and change of control at once. A category is present in a clause when
its probability reaches the category's threshold (tuned by the trainer on held-out folds of the
training contracts for contract-level presence: a contract has a category when one of its
clauses does). The parameters are package data (`heads/*.npz`, plain arrays read with
allow_pickle=False); the runtime needs only numpy.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

HEAD_FORMAT = 1
LEXICAL_HEAD = "clauses-lexical.npz"

_WORD = re.compile(r"[a-z][a-z0-9]*(?:['\u2019\-][a-z0-9]+)*|\d+")


def terms(text: str) -> list[str]:
    """The lexical head's features of a text: lower-cased words (numbers as "#") and adjacent
    word pairs. The trainer passes this function to scikit-learn, so both count the same terms."""
    words = ["#" if w[0].isdigit() else w.replace("\u2019", "'") for w in _WORD.findall(text.lower())]
    return words + [f"{a} {b}" for a, b in zip(words, words[1:])]


@dataclass(frozen=True)
class ClauseHead:
    """A trained multi-label head: categories, their thresholds and the weights of each term."""

    categories: tuple[str, ...]  # CUAD names, one per row of coef
    vocabulary: dict[str, int]
    idf: np.ndarray  # [V] float32
    coef: np.ndarray  # [C, V] float32
    intercept: np.ndarray  # [C] float32
    thresholds: np.ndarray  # [C] probability at which a category is present
    meta: dict  # how it was trained: split, seed, command, dev figures

    @classmethod
    def load(cls, path) -> "ClauseHead":
        """Reads a head written by bench/train_clauses.py (an .npz of plain arrays)."""
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != HEAD_FORMAT:
                raise ValueError(f"{path}: head format {meta.get('format')}, this kvpage reads {HEAD_FORMAT}")
            vocabulary = {term: i for i, term in enumerate(data["vocabulary"].tolist())}
            return cls(tuple(data["categories"].tolist()), vocabulary, data["idf"].astype(np.float32),
                       data["coef"].astype(np.float32), data["intercept"].astype(np.float32),
                       data["thresholds"].astype(np.float32), meta)

    def features(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(term indices, weights) of a text: sublinear tf times idf, L2-normalised, as
        scikit-learn's TfidfVectorizer(sublinear_tf=True) computes them."""
        counts: dict[int, int] = {}
        for term in terms(text):
            index = self.vocabulary.get(term)
            if index is not None:
                counts[index] = counts.get(index, 0) + 1
        if not counts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        indices = np.fromiter(counts, dtype=np.int64, count=len(counts))
        tf = np.array([1.0 + math.log(counts[i]) for i in counts], dtype=np.float64)
        weights = tf * self.idf[indices]
        weights /= np.linalg.norm(weights)
        return indices, weights.astype(np.float32)

    def probabilities(self, texts: list[str]) -> np.ndarray:
        """[len(texts), C] each category's probability for each text."""
        out = np.empty((len(texts), len(self.categories)), dtype=np.float32)
        for row, text in enumerate(texts):
            indices, weights = self.features(text)
            logits = self.coef[:, indices] @ weights + self.intercept
            out[row] = 1.0 / (1.0 + np.exp(-logits))
        return out

    def present(self, probabilities: np.ndarray) -> np.ndarray:
        """[N, C] bool: categories at or above their thresholds."""
        return probabilities >= self.thresholds


@lru_cache(maxsize=None)
def lexical_head() -> ClauseHead:
    """The shipped lexical head (model-independent: it reads the clause's words)."""
    with resources.as_file(resources.files("kvpage_cli.tasks").joinpath("heads", LEXICAL_HEAD)) as path:
        return ClauseHead.load(path)
