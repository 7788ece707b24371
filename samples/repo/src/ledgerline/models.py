"""Data classes for invoice lines and invoices."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal

from ledgerline.config import DEFAULT_CURRENCY, INVOICE_NUMBER_FORMAT, PAYMENT_TERMS_DAYS


@dataclass(frozen=True)
class LineItem:
    sku: str
    description: str
    quantity: int
    unit_price: Decimal
    category: str | None = None


@dataclass
class Invoice:
    number: str
    customer: str
    issue_date: dt.date
    lines: list[LineItem] = field(default_factory=list)
    currency: str = DEFAULT_CURRENCY

    @property
    def due_date(self) -> dt.date:
        return self.issue_date + dt.timedelta(days=PAYMENT_TERMS_DAYS)


def invoice_number(year: int, seq: int) -> str:
    """``invoice_number(2025, 42) == "INV-2025-00042"``."""
    if seq < 1:
        raise ValueError("invoice sequence numbers start at 1")
    return INVOICE_NUMBER_FORMAT.format(year=year, seq=seq)
