"""Invoice arithmetic: line nets, bulk discount, VAT and totals."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from ledgerline.config import BULK_DISCOUNT_RATE, BULK_DISCOUNT_THRESHOLD, vat_rate_for
from ledgerline.models import Invoice, LineItem
from ledgerline.money import round_currency


@dataclass(frozen=True)
class Totals:
    subtotal: Decimal
    vat_by_rate: dict[Decimal, Decimal]
    vat_total: Decimal
    total: Decimal


def line_net(line: LineItem) -> Decimal:
    """Quantity times unit price, less the bulk discount, rounded to cents."""
    gross = line.unit_price * line.quantity
    if line.quantity >= BULK_DISCOUNT_THRESHOLD:
        gross = gross * (Decimal("1") - BULK_DISCOUNT_RATE)
    return round_currency(gross)


def compute_totals(invoice: Invoice, vat_override: Decimal | None = None) -> Totals:
    """Sum the line nets and add VAT.

    VAT is computed on the sum of the nets of all lines that share a rate and rounded once
    per rate, not once per line (changed in 0.3.0).
    """
    nets_by_rate: dict[Decimal, Decimal] = {}
    subtotal = Decimal("0.00")
    for line in invoice.lines:
        net = line_net(line)
        rate = vat_rate_for(line.category, vat_override)
        nets_by_rate[rate] = nets_by_rate.get(rate, Decimal("0.00")) + net
        subtotal += net
    vat_by_rate = {
        rate: round_currency(net * rate) for rate, net in sorted(nets_by_rate.items())
    }
    vat_total = sum(vat_by_rate.values(), Decimal("0.00"))
    return Totals(subtotal, vat_by_rate, vat_total, subtotal + vat_total)
