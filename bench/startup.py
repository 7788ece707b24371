"""What a short question costs from a cold process: `kvpage ask - QUESTION` over one sentence on
stdin, each run a new process, wall time and the process's peak RSS.

Two kvpage cases, run alternately: the model's card removed first (the load reads the model's
folder through transformers, as every load did before cards, and writes the card again), and with
its card (every later run). Beside them, llama.cpp (llama-cpp-python, where installed) answering
the same prompt from the same GGUF file in a new process. Medians of --repeats runs each.

    python bench/startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, write_result  # noqa: E402

QUESTION = "Where did the cat sit?"
TEXT = "The cat sat on the mat.\n"
LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=16, temperature=0.0)
print(out["choices"][0]["message"]["content"])
"""


def timed(command: list[str], env: dict, stdin: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process."""
    started = time.perf_counter()
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=env, text=True)
    child.stdin.write(stdin)
    child.stdin.close()
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)  # the child's own peak RSS (Popen.wait would not give it)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{command[:4]} failed ({code}): {stderr[-1000:]}")
    return seconds, usage.ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--home", default=None, help="KVPAGE_HOME (default: the engine's)")
    add_json_option(parser)
    args = parser.parse_args()
    from kvpage_cli.engine.home import default_home
    from kvpage_cli.engine.model.weights import ALIASES, gguf_file

    home = Path(args.home) if args.home else default_home()
    env = {**os.environ, "KVPAGE_HOME": str(home)}
    ask = [sys.executable, "-c", "from kvpage_cli.cli.script import main; main()", "ask", "-", QUESTION,
           "--max-new-tokens", "16", "--no-cache"]
    timed(ask, env, TEXT)  # the GGUF metadata folder and the native kernels, made once
    cases: dict[str, list[tuple[float, float]]] = {"kvpage, card removed first": [], "kvpage, with its card": []}
    gguf = gguf_file("smollm2", home)
    try:
        import llama_cpp  # noqa: F401

        cases["llama.cpp"] = []
    except ImportError:
        pass
    for _ in range(args.repeats):
        shutil.rmtree(home / "cards", ignore_errors=True)
        cases["kvpage, card removed first"].append(timed(ask, env, TEXT))
        cases["kvpage, with its card"].append(timed(ask, env, TEXT))
        if "llama.cpp" in cases:
            cases["llama.cpp"].append(timed([sys.executable, "-c", LLAMA_CPP, str(gguf), TEXT + QUESTION], env, ""))
    rows = {name: {"wall_s": statistics.median(r[0] for r in runs), "peak_rss_mib": statistics.median(r[1] for r in runs),
                   "runs": runs} for name, runs in cases.items()}
    base = rows["kvpage, with its card"]
    print(f"{ALIASES['smollm2'].description}; `kvpage ask -` over one sentence, 16 new tokens; medians of {args.repeats}")
    for name, row in rows.items():
        print(f"  {name:28s} {row['wall_s']:6.2f} s  {row['peak_rss_mib']:7.1f} MiB peak RSS"
              + ("" if row is base else f"   {row['wall_s'] / base['wall_s']:.2f}x the time with the card"))
    write_result("startup", args, {"repeats": args.repeats, "rows": rows}, args.json_path)


if __name__ == "__main__":
    main()
