"""A quote found again in another rendering of the same text (a paragraph's runs, a page's glyphs):
every place it is, matched as Document.find_quote matches (spaces, curly quotes, dashes folded)."""

from __future__ import annotations

from ...ingest import Document


def find_all(text: str, quote: str) -> list[tuple[int, int]]:
    """Every (start, end) where `quote` is in `text`, in order (overlapping ones too)."""
    found: list[tuple[int, int]] = []
    at = 0
    while at < len(text):
        place = Document(source="", kind="text", text=text[at:], spans=[]).find_quote(quote)
        if place is None:
            break
        found.append((at + place[0], at + place[1]))
        at += place[0] + 1
    return found


def nth_place(text: str, quote: str, index: int, expected: int) -> tuple[int, int] | None:
    """The `index`-th place of `quote` in `text`, when `text` holds it exactly `expected` times (as
    many as the text it was quoted from): otherwise which one is meant is not known, and None."""
    found = find_all(text, quote)
    if len(found) != expected or not 0 <= index < len(found):
        return None
    return found[index]
