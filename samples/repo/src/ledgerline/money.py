"""Money helpers. Amounts are always Decimals, never floats."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")


def to_decimal(value: str | int | Decimal) -> Decimal:
    """Parse an amount from CSV text. Floats are refused: 2.675 is not exactly 2.675."""
    if isinstance(value, float):
        raise TypeError("pass amounts as str or Decimal, not float")
    return Decimal(str(value).strip())


def round_currency(amount: Decimal) -> Decimal:
    """Round to whole cents, halves away from zero (2.675 -> 2.68, -2.675 -> -2.68).

    Python's built-in round() rounds halves to even (banker's rounding), which tax
    authorities do not accept on invoices, so it must not be used for money here.
    """
    return amount.quantize(CENT, rounding=ROUND_HALF_UP)


def format_amount(amount: Decimal, currency: str = "EUR") -> str:
    """``EUR 1,234.50``: currency code, thousands separators, two decimals."""
    return f"{currency} {round_currency(amount):,.2f}"
