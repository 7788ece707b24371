"""ledgerline: a small command-line invoice calculator."""

from ledgerline.calculator import Totals, compute_totals, line_net
from ledgerline.models import Invoice, LineItem
from ledgerline.money import format_amount, round_currency

__version__ = "0.3.0"

__all__ = [
    "Invoice",
    "LineItem",
    "Totals",
    "compute_totals",
    "format_amount",
    "line_net",
    "round_currency",
]
