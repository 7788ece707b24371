from decimal import Decimal

import pytest

from ledgerline.money import format_amount, round_currency, to_decimal


def test_round_half_up():
    # round(2.675, 2) gives 2.67 in Python; invoices need 2.68.
    assert round_currency(Decimal("2.675")) == Decimal("2.68")
    assert round_currency(Decimal("2.665")) == Decimal("2.67")
    assert round_currency(Decimal("-2.675")) == Decimal("-2.68")


def test_format_amount_uses_thousands_separator():
    assert format_amount(Decimal("1234.5")) == "EUR 1,234.50"
    assert format_amount(Decimal("0.005"), "USD") == "USD 0.01"


def test_to_decimal_refuses_floats():
    assert to_decimal(" 19.99 ") == Decimal("19.99")
    with pytest.raises(TypeError):
        to_decimal(19.99)
