"""`kvpage review` end to end at --batch 1 (one clause question at a time) and batched, in one run.

Each setting is a fresh `kvpage review FILE --json` process (the README's command, saved KV off
so every run computes everything); reported: wall seconds, the ratio to --batch 1, and whether
the findings and key terms are identical (the JSON without its statistics). --explain adds the
model's commentary, the one part of a review that decodes text.

    python bench/review_batch.py                                  # samples/contract.pdf, batch 1 and 16
    python bench/review_batch.py --batches 1,4,16,64 --explain --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run(path: str, batch: int, explain: bool, model: str) -> tuple[float, dict]:
    command = [str(Path(sys.executable).with_name("kvpage")), "review", path, "--json", "--no-cache",
               "--batch", str(batch), "--model", model] + (["--explain"] if explain else [])
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, "KVPAGE_DEBUG": "1"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout)
    return seconds, data


def comparable(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "stats"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", default="samples/contract.pdf")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--explain", action="store_true", help="also run every batch size with --explain")
    parser.add_argument("--only-explain", action="store_true", help="run every batch size with --explain only")
    add_json_option(parser)
    args = parser.parse_args()

    rows = []
    for explain in ([True] if args.only_explain else [False, True] if args.explain else [False]):
        base = None
        for batch in [int(b) for b in args.batches.split(",")]:
            seconds, data = run(args.file, batch, explain, args.model)
            if base is None:
                base = (seconds, comparable(data))
            stats = data["stats"]
            rows.append({"explain": "yes" if explain else "no", "batch": batch, "seconds": seconds,
                         "ratio_x": base[0] / seconds, "same": comparable(data) == base[1],
                         "findings": len(data["findings"]), "prefill_tokens": stats["prefill_tokens"],
                         "decode_tokens": stats["decode_tokens"], "uptime": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows, [("explain", "--explain"), ("batch", "--batch"), ("seconds", "wall s"),
                       ("ratio_x", "x batch 1"), ("same", "same findings"), ("findings", "findings"),
                       ("prefill_tokens", "prefill tok"), ("decode_tokens", "decode tok"), ("uptime", "load (1 min)")]))
    write_result("review_batch", args, rows, args.json_path)


if __name__ == "__main__":
    main()
