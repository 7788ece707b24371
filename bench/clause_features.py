"""The model's own view of each clause, for the hidden-state head and the zero-shot baseline.

For every clause of the chosen CUAD contracts, one pass of the model over today's zero-shot
prompt (the instructions listing the old categories, then the clause, then "Category:"), batched
on forks of the instructions' context, gives both:
- the mean of the clause prompt's value vectors in every layer (Engine.pooled_values: a linear
  map of each layer's hidden states), the features of the hidden-state head;
- the calibrated first-token scores of the old categories (minus those after a content-free
  "N/A" clause), today's zero-shot scoring.

    python bench/clause_features.py --model smollm2 --train 30 --out /tmp/features-smollm2.npz

Clauses are cut to --clause-chars characters (at a sentence end) to bound the cost on a CPU.
After every contract the rows so far are saved beside --out (OUT.partial.npz); a stopped run
started again with the same arguments goes on from there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuad  # noqa: E402

from kvpage_cli.tasks.chat import PromptBuilder  # noqa: E402
from kvpage_cli.tasks.prompts import render  # noqa: E402
from kvpage_cli.tasks.taxonomy import CATEGORIES  # noqa: E402
from kvpage_cli.tasks.zero_shot import ZERO_SHOT_CATEGORIES, shorten  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--train", type=int, default=30, help="training contracts (the first of the split's order)")
    parser.add_argument("--dev", type=int, default=cuad.DEV_CONTRACTS, help="development contracts")
    parser.add_argument("--clause-chars", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--contracts", default=None)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the engine")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from kvpage_cli.engine import Engine, EngineConfig

    engine = Engine.load(args.model, EngineConfig(threads=args.threads))
    prompts = PromptBuilder(engine.tokenizer)
    listing = "\n".join(f"- {name}: {desc}" for name, desc in ZERO_SHOT_CATEGORIES.items())
    head = engine.prefill(prompts.prefix(render("review_instructions", categories=listing)))
    firsts = [prompts.continuation(" " + name)[0] for name in ZERO_SHOT_CATEGORIES]

    def question(clause_id: str, heading: str, text: str) -> list[int]:
        return prompts.question(render("review_clause", clause_id=clause_id, heading=heading, clause=text),
                                answer_prefix=render("review_answer"))

    null_ctx = engine.fork(head)
    engine.append(null_ctx, question("N/A", "N/A", "N/A"))
    null = torch.log_softmax(null_ctx.last_logits, -1)[firsts]
    engine.release(null_ctx)

    train, dev = cuad.split(cuad.load_contracts(args.contracts))
    chosen = [("dev", c) for c in dev[:args.dev]] + [("train", c) for c in train[:args.train]]
    features, zero_shot, owner, split, labels, names = [], [], [], [], [], []
    partial = Path(args.out).with_suffix(".partial.npz")
    settings = {"model": args.model, "fingerprint": engine.fingerprint, "clause_chars": args.clause_chars}

    def save(path, compressed: bool = True) -> None:
        (np.savez_compressed if compressed else np.savez)(path, features=np.stack(features), zero_shot=np.stack(zero_shot),
                            labels=np.array(labels, dtype=bool), owner=np.array(owner), split=np.array(split),
                            contracts=np.array(names), zero_shot_categories=np.array(list(ZERO_SHOT_CATEGORIES)),
                            **{k: np.array(v) for k, v in settings.items()})

    if partial.exists():
        done = np.load(partial, allow_pickle=False)
        if all(done[k].item() == v for k, v in settings.items()):
            features, zero_shot = list(done["features"]), list(done["zero_shot"])
            labels, owner = done["labels"].tolist(), done["owner"].tolist()
            split, names = done["split"].tolist(), done["contracts"].tolist()
            print(f"going on after {len(names)} contracts from {partial}", file=sys.stderr)
    started, tokens = time.time(), 0
    for n, (part, contract) in enumerate(chosen):
        if n < len(names):
            assert names[n] == contract.name, f"{partial} was written for other contracts"
            continue
        doc, clauses = cuad.read(contract)
        found = cuad.clause_labels(clauses, cuad.expert_spans(doc.text, contract.labels))
        ids = [question(c.id, c.heading, shorten(c.text, args.clause_chars)) for c in clauses]
        forks = [engine.fork(head) for _ in clauses]
        pooled = engine.pooled_values(list(zip(forks, ids)), max_batch=args.batch)
        for fork, values, clause_labels in zip(forks, pooled, found):
            zero_shot.append((torch.log_softmax(fork.last_logits, -1)[firsts] - null).numpy())
            features.append(values.flatten().numpy().astype(np.float16))
            labels.append([c in clause_labels for c in CATEGORIES])
            owner.append(n)
            engine.release(fork)
        split.append(part)
        names.append(contract.name)
        tokens += sum(map(len, ids))
        save(partial, compressed=False)  # rewritten after every contract: not compressed again each time
        print(f"{n + 1}/{len(chosen)} {part} {len(clauses)} clauses, {tokens:,} tokens, "
              f"{tokens / (time.time() - started):.0f} tok/s", file=sys.stderr, flush=True)
    save(args.out)
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
