"""Tax, currency and payment settings for ledgerline.

Every money setting is a Decimal so that arithmetic stays exact.
"""

from __future__ import annotations

import os
from decimal import Decimal

#: Standard VAT rate, applied to every line whose category has no reduced rate.
DEFAULT_VAT_RATE = Decimal("0.20")

#: Reduced VAT rates by product category (the ``category`` column of the input CSV).
REDUCED_VAT_RATES: dict[str, Decimal] = {
    "books": Decimal("0.05"),
    "food": Decimal("0.05"),
    "children_clothing": Decimal("0.00"),
}

#: Environment variable that overrides the standard rate when ``--vat-rate`` is not given.
VAT_RATE_ENV_VAR = "LEDGERLINE_VAT_RATE"

DEFAULT_CURRENCY = "EUR"

#: An invoice is due this many days after its issue date.
PAYMENT_TERMS_DAYS = 30

#: Lines with at least this many units get the bulk discount.
BULK_DISCOUNT_THRESHOLD = 50
BULK_DISCOUNT_RATE = Decimal("0.10")

INVOICE_NUMBER_FORMAT = "INV-{year}-{seq:05d}"


def _check_rate(rate: Decimal, source: str) -> Decimal:
    if not Decimal("0") <= rate < Decimal("1"):
        raise ValueError(f"VAT rate from {source} must be between 0 and 1, got {rate}")
    return rate


def standard_vat_rate(override: Decimal | None = None) -> Decimal:
    """The standard rate: ``override`` (from ``--vat-rate``), else the environment, else 20%."""
    if override is not None:
        return _check_rate(override, "--vat-rate")
    env = os.environ.get(VAT_RATE_ENV_VAR)
    if env:
        return _check_rate(Decimal(env), VAT_RATE_ENV_VAR)
    return DEFAULT_VAT_RATE


def vat_rate_for(category: str | None, override: Decimal | None = None) -> Decimal:
    """The VAT rate for one line.

    A reduced category rate always wins, even over ``--vat-rate`` and the environment variable:
    those only change the standard rate.
    """
    if category and category in REDUCED_VAT_RATES:
        return REDUCED_VAT_RATES[category]
    return standard_vat_rate(override)
