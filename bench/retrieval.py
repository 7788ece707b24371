"""Retrieval benchmark (issue 12): questions over documents longer than the model's context, and
pass keys in long haystacks, answered by several systems at the same attended-token budget.

Systems (`--systems`, bench/retrieval_parts/systems.py):
  retrieval  (a) kvpage's retrieval mode: index the document once, select blocks per question
             (as `kvpage ask --mode retrieval` runs it).
  bm25       (b) the text baseline: the document cut into chunks of `--chunk-tokens` tokens, ranked
             by BM25 (bm25s) against the question, the best packed into `--budget` tokens and put in
             document order into the same prompt as `kvpage ask`, then an exact prefill and a
             greedy answer through kvpage's engine.
  exact      (c) the whole document in the `kvpage ask` prompt, where it fits the model's context
             (SmolLM2 8K, Gemma 3 270M 32K); the document is prefilled once and every question
             forks it (the in-process form of asking again over saved KV).

Parts (the first argument; one module each in bench/retrieval_parts/, `PART --help` lists its options):
  check      fetch the sources (pinned sdists from PyPI and a Debian package holding a 311-page PDF
             manual, checked by sha256; CUAD contracts) into the cache folder and verify every
             question's evidence against kvpage's ingest
  questions  the question set of bench/retrieval_questions.json, scored by its regexes
  recall     no answers: how often the BM25 packing of each question holds its evidence lines
             (the text baseline's retrieval alone, at the budget; quick, no decoding)
  windows    the window size and overlap retrieval indexes with: each document's first --prefix
             tokens indexed (every block attended in place), the next --continuation scored;
             their extra negative log-likelihood against an exact prefill, and indexing speed
             (three corpus contracts not in the question set, two Python standard library modules)
  select     no answers: retrieval mode's selection alone, for each set of `--signals` (lexical,
             bounds, keys and their combinations): how often the selected blocks hold the
             question's evidence, the selection's time and the K/V it read
  passkey    a 5-digit pass key in haystacks cut from the CUAD contracts of corpus/, at depths
             10/50/90% of 32K, 128K and 512K tokens

Reported per system: accuracy; how often all the question's evidence lines were among the text
attended; time to the first answer token for the first question over a document (including
whatever the system builds for the document: BM25 index, prefill; that part also apart) and for
the questions after it; KV read per question (blocks each attention step read, counted as they
are read, times the bytes of a block); tokens attended per question. Sources are read with
kvpage's own ingest (`kvpage_cli.ingest.load`) and cached outside the repository
(`--cache`, default ~/.cache/kvpage-bench); nothing downloaded is committed. The BM25 baseline
needs bm25s (`pip install -e ".[bench]"`): maintained, numpy only, scores every chunk at once.
Every part but check writes its summary and rows through common.write_result
(bench/results/retrieval-PART/, or --json PATH).

    python bench/retrieval.py check
    python bench/retrieval.py questions --model smollm2 --systems bm25 --budget 4096
    python bench/retrieval.py questions --model gemma3-270m --systems bm25,exact --sources tomli,cuad-11
    python bench/retrieval.py select --model smollm2 --saved-kv-mib 20000
    python bench/retrieval.py passkey --model gemma3-270m --systems bm25 --lengths 32768,131072,524288
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from retrieval_parts import check, passkey, questions, recall, select, windows  # noqa: E402

PARTS = {"check": check, "questions": questions, "recall": recall, "select": select, "windows": windows,
         "passkey": passkey}


def build_parser() -> argparse.ArgumentParser:
    """The command line: a subcommand per part, each with the options its module adds."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    for name, module in PARTS.items():
        part = parts.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(part)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    PARTS[args.part].run(args)


if __name__ == "__main__":
    main()
