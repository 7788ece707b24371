"""The cost of writing a review as HTML, DOCX and PDF, beside the review's own time, in one run.

For each contract: one `kvpage review FILE --json --no-cache` process (the review as a user runs
it, everything computed; its wall time is the baseline), then each format written from that review
in this process, as the CLI writes it after the review (ingest is the CLI's and not counted):
html (review_html), docx (commented_docx: a new DOCX of a PDF's text, a commented copy of a DOCX),
pdf (highlighted_pdf, the file read and checked first). Reported per format: the median of
--repeats writes, its share of the review's time (the goal: under 5%), the output's size, and for
pdf how many quotes were highlighted.

    python bench/review_formats.py                                # the sample and two long CUAD contracts
    python bench/review_formats.py samples/contract.docx --repeats 5 --json bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import REPO, table, write_result  # noqa: E402

from kvpage_cli.ingest import load  # noqa: E402
from kvpage_cli.tasks.formats import docx as docx_format  # noqa: E402
from kvpage_cli.tasks.formats import pdf as pdf_format  # noqa: E402
from kvpage_cli.tasks.formats.html import review_html  # noqa: E402
from kvpage_cli.tasks.schema import ReviewResult  # noqa: E402

DEFAULT_FILES = ["samples/contract.pdf", "corpus/cuad/11-promotion-long/contract.pdf",
                 "corpus/cuad/10-collaboration-long/contract.pdf"]  # 12, 60 and 85 pages


def review(path: str, model: str) -> tuple[float, dict]:
    command = [str(Path(sys.executable).with_name("kvpage")), "review", path, "--json", "--no-cache", "--model", model]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, "KVPAGE_DEBUG": "1"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout)


def writers(path: str, result: ReviewResult, doc) -> dict:
    """Each format's writer, as the CLI calls it after the review (reading the file it copies included)."""
    def html():
        return review_html(result, doc).encode("utf-8"), {}

    def docx():
        source = None
        if doc.kind == "docx":
            source = Path(path).read_bytes()
            docx_format.check_source(source, doc)
        return docx_format.commented_docx(result, doc, source), {}

    def pdf():
        source = Path(path).read_bytes()
        highlighted = pdf_format.highlighted_pdf(result, doc, source)
        return highlighted.data, {"highlighted": len(highlighted.placed), "not_located": len(highlighted.unplaced)}

    return {"html": html, "docx": docx} | ({"pdf": pdf} if doc.kind == "pdf" else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    rows, target = [], args.json_path
    for path in args.files:
        review_seconds, data = review(path, args.model)
        result = ReviewResult.from_dict(data)
        doc = load(path)
        for fmt, write in writers(path, result, doc).items():
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                output, extra = write()
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            rows.append({"document": path, "pages_or_paragraphs": len({(s.page, s.paragraph) for s in doc.spans}),
                         "findings": len(result.findings), "mode": result.mode, "review_s": round(review_seconds, 2),
                         "format": fmt, "write_ms": round(1000 * seconds, 1),
                         "share_pct": round(100 * seconds / review_seconds, 3),
                         "bytes": len(output), "input_bytes": Path(path).stat().st_size, **extra,
                         "load_1min": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        # written after every contract: a long run stopped early keeps what it measured
        target = write_result("review_formats", args, {"rows": rows}, target)
    print(table(rows, [("document", "document"), ("findings", "findings"), ("mode", "mode"), ("review_s", "review s"),
                       ("format", "format"), ("write_ms", "write ms"), ("share_pct", "% of review"), ("bytes", "bytes"),
                       ("input_bytes", "input bytes")]))


if __name__ == "__main__":
    main()
