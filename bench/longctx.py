"""Long-context quality harness: what selective mode's policies lose against exact mode.

Synthetic tasks generated here, scored by string match, with haystacks cut from the CUAD
contracts in corpus/ (no other text):
  passkey      a 5-digit pass key in the haystack
  niah         one "special magic number" for a key
  multikey     four keys with a number each; asked for one
  multivalue   four numbers for one key; all four must come back
  vartrack     chains VAR A = 12345, VAR B = VAR A, ...; asked which variables hold the value
Each (task, length, depth) prompt is prefilled once in exact mode; then every configuration
decodes the answer from a fork of it: exact (the reference row), and each policy with a pool
of 1/8 and 1/16 of the context's blocks. Reported: accuracy, and agreement with exact mode of
the first token a selective decode step produces. (The first generated token comes from the
prompt's prefill, exact in both modes, so it always agrees; the second is the first that only
the policy's blocks decide.)

    python bench/longctx.py --model gemma3-270m --lengths 8192,16384,32768 --depths 10,50,90
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, corpus_text, table, write_result  # noqa: E402

TASKS = ("passkey", "niah", "multikey", "multivalue", "vartrack")
POLICIES = ("lru", "quest", "draft", "scores")
WORDS = ("apple", "river", "copper", "violet", "harbor", "lantern", "meadow", "falcon", "quartz", "saddle")


def make_task(task: str, rng: random.Random) -> tuple[list[str], str, list[str]]:
    """(needle sentences, question, expected strings)."""
    number = lambda: str(rng.randint(10000, 99999))  # noqa: E731
    if task == "passkey":
        key = number()
        return [f"The pass key is {key}. Remember it. {key} is the pass key."], "What is the pass key? The pass key is", [key]
    if task == "niah":
        word, value = rng.choice(WORDS), number()
        return ([f"One of the special magic numbers for {word} is: {value}."],
                f"What is the special magic number for {word}? The special magic number for {word} is", [value])
    if task == "multikey":
        words = rng.sample(WORDS, 4)
        values = [number() for _ in words]
        target = rng.randrange(4)
        needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
        return needles, (f"What is the special magic number for {words[target]}? "
                         f"The special magic number for {words[target]} is"), [values[target]]
    if task == "multivalue":
        word = rng.choice(WORDS)
        values = [number() for _ in range(4)]
        needles = [f"One of the special magic numbers for {word} is: {v}." for v in values]
        return needles, f"What are all the special magic numbers for {word}? They are", values
    if task == "vartrack":
        value = number()
        names = rng.sample(["QXK", "BMR", "ZTL", "HWP", "JDV", "NRC"], 4)
        needles = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
        return (needles, f"Which variables are assigned the value {value}? Answer: the variables assigned {value} are",
                names)
    raise ValueError(task)


def build_prompt(tokenizer, haystack_ids: list[int], task: str, length: int, depth: float, seed: int) -> tuple[list[int], list[str]]:
    """Token ids of `length` tokens: haystack with the needles inserted from `depth` (0-1) on."""
    rng = random.Random(seed)
    needles, question, expected = make_task(task, rng)
    head = tokenizer("Below is a long text with some important facts hidden in it. Memorize them.\n\n").input_ids
    tail = tokenizer(f"\n\n{question}", add_special_tokens=False).input_ids
    needle_ids = [tokenizer(" " + n + " ", add_special_tokens=False).input_ids for n in needles]
    budget = length - len(head) - len(tail) - sum(map(len, needle_ids))
    hay = (haystack_ids * (budget // len(haystack_ids) + 1))[:budget]
    body: list[int] = []
    last = 0
    for i, nid in enumerate(needle_ids):  # consecutive needles 2% of the haystack apart
        at = int(len(hay) * min(1.0, depth + i * 0.02))
        body += hay[last:at] + nid
        last = at
    return head + body + hay[last:] + tail, expected


def score(answer: str, expected: list[str]) -> float:
    """The share of expected strings the answer holds as words or numbers of their own (the key
    87324 is not found in "187324")."""
    found = [re.search(rf"(?<![0-9A-Za-z]){re.escape(e)}(?![0-9A-Za-z])", answer) for e in expected]
    return sum(f is not None for f in found) / len(expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--depths", default="10,50,90", help="needle depths in percent")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--fractions", default="8,16", help="pool = context blocks / N")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--home", default=None)
    parser.add_argument("--weights", default="auto", help="the engine's weight format (auto, float32, gguf, ...)")
    parser.add_argument("--activations", default="float32", help="the engine's activations (float32, int8)")
    add_json_option(parser)
    parser.add_argument("--log", default="longctx-cases.jsonl", help="per-case results; cases already there are skipped")
    args = parser.parse_args()

    from kvpage_cli.engine import Engine, EngineConfig

    # Selective mode keeps the per-block metadata every policy needs; exact rows switch selection off.
    engine = Engine.load(args.model, EngineConfig(mode="selective", policy="quest", home=args.home, pool_mib=1024,
                                                    weights=args.weights, activations=args.activations))
    tokenizer = engine.tokenizer
    haystack = tokenizer(corpus_text(), add_special_tokens=False).input_ids
    configs = [("exact", None, None)] + [(p, p, f) for f in map(int, args.fractions.split(",")) for p in filter(None, args.policies.split(","))]
    lengths = [int(n) for n in args.lengths.split(",")]
    tasks = args.tasks.split(",")
    depths = [int(d) for d in args.depths.split(",")]
    cases = [(t, n, d) for n in lengths for t in tasks for d in depths]
    log_path = Path(args.log)
    done = set()
    if log_path.exists():
        done = {(r["task"], r["length"], r["depth"]) for r in map(json.loads, open(log_path)) if r["config"] == "exact"}
    started = time.time()
    for index, (task, length, depth) in enumerate(cases):
        if (task, length, depth) in done:
            continue
        # the context is `length` tokens once the answer is decoded, so 32K fits Gemma's 32768
        ids, expected = build_prompt(tokenizer, haystack, task, length - args.new_tokens, depth / 100,
                                     seed=args.seed * 1000 + index)
        engine.set_selection(None)
        doc = engine.prefill(ids)
        blocks = doc.num_blocks
        case_rows = []
        for name, policy, fraction in configs:
            budget = max(4, -(-blocks // fraction)) if fraction else None
            engine.set_selection(policy, budget)
            tokens = list(engine.generate(engine.fork(doc), max_new_tokens=args.new_tokens))
            answer = tokenizer.decode(tokens)
            if name == "exact":
                exact_answer = answer
            case_rows.append({"task": task, "length": length, "depth": depth, "config": name, "fraction": fraction,
                              "score": score(answer, expected), "answer": answer, "tokens": tokens})
        print(f"[{time.time() - started:7.0f}s] {task} {length} depth {depth}%: exact answer {exact_answer!r} "
              f"expected {expected}", file=sys.stderr, flush=True)
        with open(log_path, "a") as log:  # one line per configuration, so a long run can be resumed
            for row in case_rows:
                log.write(json.dumps(row) + "\n")
        del doc

    def decoded(row: dict) -> list[int]:
        # logs written before tokens were kept have only the text: encode it again
        return row["tokens"] if "tokens" in row else tokenizer(row["answer"], add_special_tokens=False).input_ids

    logged = [r for r in map(json.loads, open(log_path))
              if r["length"] in lengths and r["task"] in tasks and r["depth"] in depths]
    exact_rows = {(r["task"], r["length"], r["depth"]): decoded(r) for r in logged if r["config"] == "exact"}
    results: dict[tuple, list] = {}
    for row in logged:
        reference = exact_rows[(row["task"], row["length"], row["depth"])]
        results.setdefault((row["config"], row["fraction"], row["length"]), []).append(
            (row["score"], decoded(row)[1:2] == reference[1:2]))

    rows = []
    for (name, fraction, length), values in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][1] or 0, kv[0][0])):
        rows.append({
            "length": length, "policy": name, "pool": f"1/{fraction}" if fraction else "all",
            "accuracy_pct": 100 * sum(v[0] for v in values) / len(values),
            "first_token_agree_pct": 100 * sum(v[1] for v in values) / len(values),
            "cases": len(values),
        })
    print(table(rows, [("length", "context"), ("policy", "policy"), ("pool", "pool"), ("accuracy_pct", "accuracy %"),
                       ("first_token_agree_pct", "1st decoded token = exact %"), ("cases", "cases")]))
    print(f"model {args.model}; tasks {args.tasks}; depths {args.depths}%; {args.new_tokens} new tokens; "
          f"wall {time.time() - started:.0f}s")
    write_result("longctx", args, {"rows": rows}, args.json_path)


if __name__ == "__main__":
    main()
