from pathlib import Path

from ledgerline.cli import EXIT_INVALID_INPUT, EXIT_NOT_FOUND, main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "items.csv"


def test_total_of_example(capsys, monkeypatch):
    monkeypatch.delenv("LEDGERLINE_VAT_RATE", raising=False)
    assert main(["total", str(EXAMPLE), "--date", "2025-04-01"]) == 0
    out = capsys.readouterr().out
    assert "Issued 2025-04-01, due 2025-05-01" in out
    assert out.splitlines()[-1].endswith("EUR 437.12")


def test_bad_row_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("sku,description,quantity,unit_price\nX,broken,-1,3.00\n", encoding="utf-8")
    assert main(["total", str(bad)]) == EXIT_INVALID_INPUT
    assert "row 2: quantity must be positive" in capsys.readouterr().err


def test_missing_file_exits_3(tmp_path):
    assert main(["total", str(tmp_path / "nope.csv")]) == EXIT_NOT_FOUND
