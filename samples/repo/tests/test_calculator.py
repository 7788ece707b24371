import datetime as dt
from decimal import Decimal

from ledgerline.calculator import compute_totals, line_net
from ledgerline.config import vat_rate_for
from ledgerline.models import Invoice, LineItem, invoice_number


def make_invoice(*lines):
    return Invoice("INV-2025-00001", "Test Customer", dt.date(2025, 4, 1), list(lines))


def test_bulk_discount_starts_at_fifty_units():
    assert line_net(LineItem("A", "a", 49, Decimal("2.50"))) == Decimal("122.50")
    assert line_net(LineItem("A", "a", 50, Decimal("2.50"))) == Decimal("112.50")


def test_reduced_rate_beats_override(monkeypatch):
    monkeypatch.setenv("LEDGERLINE_VAT_RATE", "0.21")
    assert vat_rate_for("books") == Decimal("0.05")
    assert vat_rate_for(None) == Decimal("0.21")
    assert vat_rate_for(None, Decimal("0.10")) == Decimal("0.10")


def test_vat_rounded_once_per_rate(monkeypatch):
    monkeypatch.delenv("LEDGERLINE_VAT_RATE", raising=False)
    # Three lines that each net 0.13 at 20%: rounding VAT per line would give 0.03 x 3 = 0.09;
    # rounding once per rate gives round(0.39 x 0.20) = round(0.078) = 0.08.
    lines = [LineItem(f"S{i}", "s", 1, Decimal("0.125")) for i in range(3)]
    totals = compute_totals(make_invoice(*lines))
    assert totals.subtotal == Decimal("0.39")  # each net rounds to 0.13
    assert totals.vat_by_rate == {Decimal("0.20"): Decimal("0.08")}


def test_example_invoice_total(monkeypatch):
    monkeypatch.delenv("LEDGERLINE_VAT_RATE", raising=False)
    invoice = make_invoice(
        LineItem("SKU-1001", "ribbon", 3, Decimal("19.99")),
        LineItem("SKU-2040", "wrap", 60, Decimal("2.50")),
        LineItem("BK-0007", "handbook", 2, Decimal("34.00"), "books"),
        LineItem("SKU-3312", "logger", 4, Decimal("27.45")),
    )
    totals = compute_totals(invoice)
    assert totals.subtotal == Decimal("372.77")
    assert totals.vat_total == Decimal("64.35")
    assert totals.total == Decimal("437.12")


def test_due_date_and_number():
    assert make_invoice().due_date == dt.date(2025, 5, 1)
    assert invoice_number(2025, 42) == "INV-2025-00042"
