"""Command line: ``ledgerline total FILE``.

Exit codes: 0 success, 2 invalid input (a bad CSV row or VAT rate), 3 input file not found.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

from ledgerline.calculator import compute_totals, line_net
from ledgerline.config import DEFAULT_CURRENCY
from ledgerline.csv_io import InvalidLineError, read_lines
from ledgerline.models import Invoice, invoice_number
from ledgerline.money import format_amount

EXIT_OK, EXIT_INVALID_INPUT, EXIT_NOT_FOUND = 0, 2, 3
DEBUG_LOG = "ledgerline-debug.log"

log = logging.getLogger("ledgerline.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ledgerline", description="Invoice calculator.")
    sub = parser.add_subparsers(dest="command", required=True)
    total = sub.add_parser("total", help="print an invoice summary for a CSV of lines")
    total.add_argument("file", type=Path)
    total.add_argument("--customer", default="Customer")
    total.add_argument("--vat-rate", help="standard VAT rate for this run, e.g. 0.21")
    total.add_argument("--currency", default=DEFAULT_CURRENCY)
    total.add_argument("--date", type=dt.date.fromisoformat, default=None)
    total.add_argument("--seq", type=int, default=1)
    total.add_argument("--debug", action="store_true", help=f"write {DEBUG_LOG}")
    return parser


def render(invoice: Invoice, vat_override: Decimal | None) -> str:
    totals = compute_totals(invoice, vat_override)
    cur = invoice.currency
    out = [
        f"Invoice {invoice.number} for {invoice.customer}",
        f"Issued {invoice.issue_date.isoformat()}, due {invoice.due_date.isoformat()}",
    ]
    for line in invoice.lines:
        out.append(f"{line.sku:<10} {line.description:<32} {line.quantity:>5} x "
                   f"{line.unit_price:<8} {line_net(line):>8}")
    out.append(f"{'Subtotal':<56}{format_amount(totals.subtotal, cur):>14}")
    for rate, vat in totals.vat_by_rate.items():
        label = f"VAT {rate * 100:.0f}%"
        out.append(f"{label:<56}{format_amount(vat, cur):>14}")
    out.append(f"{'Total':<56}{format_amount(totals.total, cur):>14}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        logging.basicConfig(filename=DEBUG_LOG, level=logging.DEBUG,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        vat_override = Decimal(args.vat_rate) if args.vat_rate else None
        log.info("reading %s", args.file)
        lines = read_lines(args.file)
        issue = args.date or dt.date.today()
        invoice = Invoice(invoice_number(issue.year, args.seq), args.customer, issue, lines,
                          args.currency)
        print(render(invoice, vat_override))
    except FileNotFoundError:
        print(f"ledgerline: no such file: {args.file}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except (InvalidLineError, InvalidOperation, ValueError) as exc:
        print(f"ledgerline: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
