"""Reading invoice lines from CSV."""

from __future__ import annotations

import csv
from decimal import InvalidOperation
from pathlib import Path

from ledgerline.models import LineItem
from ledgerline.money import to_decimal

REQUIRED_COLUMNS = ("sku", "description", "quantity", "unit_price")


class InvalidLineError(ValueError):
    """A CSV row that cannot be turned into a LineItem. ``row`` counts the header as row 1."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(f"row {row}: {message}")
        self.row = row


def read_lines(path: Path) -> list[LineItem]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InvalidLineError(1, f"missing column(s): {', '.join(missing)}")
        lines = []
        for row_no, row in enumerate(reader, start=2):
            try:
                quantity = int(row["quantity"])
                unit_price = to_decimal(row["unit_price"])
            except (ValueError, InvalidOperation) as exc:
                raise InvalidLineError(row_no, f"bad number ({exc})") from None
            if quantity <= 0:
                raise InvalidLineError(row_no, "quantity must be positive")
            if unit_price < 0:
                raise InvalidLineError(row_no, "unit_price must not be negative")
            category = (row.get("category") or "").strip() or None
            lines.append(LineItem(row["sku"].strip(), row["description"].strip(),
                                  quantity, unit_price, category))
        return lines
