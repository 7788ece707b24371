"""Task progress events, beside the engine's own (same callback)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReviewProgress:
    """`done` of `total` clauses reviewed; `clause_id` is the one just finished."""

    done: int
    total: int
    clause_id: str
