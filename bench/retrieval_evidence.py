"""Evidence under answers (issue 47), measured over bench/retrieval.py's question set: whether the
top-1 and top-3 evidence spans `kvpage ask` prints hold the question's key facts (every regex
of the question matches the spans' text, as an answer is judged) and its evidence quotes (every
quote of the question set lies inside one of the spans).

Beside kvpage's ranking (`tasks.evidence.DEFAULT_SIGNAL`) the same answer's attention is ranked
by each signal alone (attention, lexical: the question's BM25 over the lines of the blocks read),
and the text baseline: BM25's best spans of the same kind (lines, sentences) over the whole
document, no model at all. `bench/retrieval.py questions --systems retrieval` adds these columns;
`--evidence-dump PATH` also writes each answer's attention per document token (JSON lines) so
that rankings can be compared again without the model (`python bench/retrieval_evidence.py
rerank PATH...`, which writes bench/results/retrieval-rerank). `lazy` replays a lazy index's
choices without the model: the passages each question reads and the tokens of new windows it
would compute, for other window sizes and budgets.
`find` times `kvpage find` over a saved index in process, and with `--commands N` as a user runs
it, each run a new process: in its own process and handed to a `kvpage serve`, alternately.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from statistics import mean, median

import torch

SIGNAL_COLUMNS = ("fused", "attention", "lexical")


def holds_facts(texts: list[str], regexes: list[str]) -> bool:
    """Every key fact's regex matches the spans' text (joined), case-insensitive."""
    joined = "\n".join(texts)
    return bool(texts) and all(re.search(rx, joined, re.IGNORECASE) for rx in regexes)


def holds_quotes(spans: list[tuple[int, int]], wanted: list[tuple[int, int]]) -> bool:
    """Every evidence quote (character range) lies inside one of the spans."""
    return bool(spans) and all(any(a <= s and e <= b for a, b in spans) for s, e in wanted)


def hits(doc, evidence: list, q: dict, prefix: str) -> dict:
    """The four hit flags of one ranking's spans (Evidence objects or dicts), best first."""
    def get(e, key):
        return e[key] if isinstance(e, dict) else getattr(e, key)

    out = {}
    for k in (1, 3):
        top = evidence[:k]
        out[f"{prefix}_top{k}_facts"] = holds_facts([get(e, "text") for e in top], q["regexes"])
        out[f"{prefix}_top{k}_quotes"] = holds_quotes([(get(e, "start"), get(e, "end")) for e in top],
                                                       q["evidence_ranges"])
    return out


def bm25_whole(doc, question: str, state: dict) -> list:
    """The text baseline: BM25 over every unit of the document (the units kvpage's evidence is
    made of), its best three spans grown as kvpage grows its spans."""
    from kvpage_cli.tasks import evidence

    if "units" not in state:
        state["units"] = evidence.units_of(doc, [(0, len(doc.text))])
    units = state["units"]
    lexical = evidence.lexical_scores(doc, units, question)
    return evidence.spans(doc, units, lexical, lexical.clamp_min(0), min_share=0.0)


def measure(doc, q: dict, asker, state: dict, dump: Path | None = None) -> dict:
    """The evidence columns of one answered question (asker: the Asker that answered it)."""
    from kvpage_cli.tasks import evidence

    row = {"evidence": [e.to_dict() for e in asker.evidence[0]]}
    row.update(hits(doc, asker.evidence[0], q, "ev"))
    if asker.attention[0] is not None:
        chars, mass = asker.attention[0]
        ranked = evidence.signals(doc, chars, mass, q["question"])
        for signal in SIGNAL_COLUMNS:
            row.update(hits(doc, ranked.spans(doc, signal), q, f"ev_{signal}"))
        if dump is not None:
            with open(dump, "a") as f:
                f.write(json.dumps({"id": q["id"], "source": q["source"], "question": q["question"],
                                    "chars": chars, "mass": [round(m, 6) for m in mass.tolist()]}) + "\n")
    row.update(hits(doc, bm25_whole(doc, q["question"], state), q, "bm25_spans"))
    return row


SUMMARY = [("ev", "kvpage"), ("ev_attention", "attention alone"), ("ev_lexical", "lexical in blocks"),
           ("ev_fused", "fused"), ("bm25_spans", "BM25 whole doc")]


def summary(rows: list[dict]) -> list[dict]:
    """Per ranking, the share of questions whose top-1 / top-3 spans hold the key facts and the
    quotes; beside them, the share of answers that are right."""
    ran = [r for r in rows if any(k.endswith("_top1_facts") for k in r)]
    out = []
    for prefix, name in SUMMARY:
        mine = [r for r in ran if f"{prefix}_top1_facts" in r]
        if not mine:
            continue
        out.append({"ranking": name, "questions": len(mine),
                    **{f"{k}_{what}_pct": 100 * mean(r[f"{prefix}_top{k}_{what}"] for r in mine)
                       for k in (1, 3) for what in ("facts", "quotes")}})
    answered = [r for r in ran if "right" in r]
    if answered:
        out.append({"ranking": "answer text (right)", "questions": len(answered),
                    "1_facts_pct": 100 * mean(r["right"] for r in answered)})
    return out


COLUMNS = [("ranking", "spans ranked by"), ("questions", "questions"), ("1_facts_pct", "top-1 facts %"),
           ("3_facts_pct", "top-3 facts %"), ("1_quotes_pct", "top-1 quotes %"), ("3_quotes_pct", "top-3 quotes %")]


def rerank(dumps: list[Path], question_set: dict, cache: Path, grow: float | None = None) -> list[dict]:
    """The rankings again from dumps (no model): per question, each signal's hits."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from retrieval_parts.sources import evidence_ranges, fetch_source

    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import evidence

    if grow is not None:
        evidence.GROW_SHARE = grow
    questions = {q["id"]: q for q in question_set["questions"]}
    docs, states, rows = {}, {}, []
    for item in (json.loads(line) for dump in dumps for line in open(dump)):
        q = questions[item["id"]]
        if q["source"] not in docs:
            docs[q["source"]] = load(str(fetch_source(q["source"], question_set["sources"][q["source"]], cache)))
            states[q["source"]] = {}
        doc = docs[q["source"]]
        q = {**q, "evidence_ranges": evidence_ranges(doc, q["evidence"])}
        ranked = evidence.signals(doc, [tuple(c) for c in item["chars"]], torch.tensor(item["mass"]), q["question"])
        row = {"id": q["id"]}
        for signal in SIGNAL_COLUMNS:
            row.update(hits(doc, ranked.spans(doc, signal), q, f"ev_{signal}"))
        row.update(hits(doc, bm25_whole(doc, q["question"], states[q["source"]]), q, "bm25_spans"))
        rows.append(row)
    return rows


def baseline(question_set: dict, cache: Path) -> list[dict]:
    """The text baseline alone over every question (no model): BM25's best spans of the whole document."""
    from retrieval_parts.sources import evidence_ranges, fetch_source

    from kvpage_cli.ingest import load

    docs, states, rows = {}, {}, []
    for q in question_set["questions"]:
        if q["source"] not in docs:
            docs[q["source"]] = load(str(fetch_source(q["source"], question_set["sources"][q["source"]], cache)))
            states[q["source"]] = {}
        doc = docs[q["source"]]
        q = {**q, "evidence_ranges": evidence_ranges(doc, q["evidence"])}
        rows.append({"id": q["id"], **hits(doc, bm25_whole(doc, q["question"], states[q["source"]]), q, "bm25_spans")})
    return rows


def find_latency(model: str, home: str | None, question_set: dict, cache: Path, source: str, limit: int) -> list[dict]:
    """`kvpage find`'s latency, in process (the model loaded once, as a server would hold it; the
    command adds its load): per question, a first find (which indexes the windows it needs where
    the saved index lacks them) and a second one over the saved index, each from the document's
    text (tokenizing it, ranking its passages, mapping the saved windows, computing the question);
    beside them, BM25's spans over the whole document (the text baseline, no model) in the same run."""
    import time

    from retrieval_parts.sources import fetch_source

    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks.find import Finder

    engine = Engine.load(model, EngineConfig(home=home, kv_cache=True, cache_mib=20000))
    doc = load(str(fetch_source(source, question_set["sources"][source], cache)))
    rows = []
    for q in [q for q in question_set["questions"] if q["source"] == source][:limit]:
        row = {"id": q["id"]}
        for run in ("first", "lookup"):
            before = engine.stats().prefill_tokens
            started = time.perf_counter()
            finder = Finder(engine, doc)
            finder.find(q["question"])
            row[f"{run}_s"] = time.perf_counter() - started
            row[f"{run}_prefill_tokens"] = engine.stats().prefill_tokens - before
            row["document_tokens"] = finder.total_tokens
            row["indexed_tokens"] = finder.indexed_tokens
            finder.release()
        started = time.perf_counter()
        bm25_whole(doc, q["question"], {})
        row["bm25_spans_s"] = time.perf_counter() - started
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def find_commands(home: str, question_set: dict, cache: Path, source: str, limit: int, repeats: int) -> list[dict]:
    """`kvpage find SOURCE QUESTION -n 3 -q` as a user runs it, each run a new process over the
    saved index in `home`: in a process of its own (KVPAGE_NO_SERVER=1) and handed to a `kvpage
    serve` started here for `home`, alternately, `repeats` times per question; wall seconds, and
    whether the two printed the same bytes."""
    import os
    import signal
    import subprocess
    import time

    from retrieval_parts.sources import fetch_source

    kvpage = str(Path(sys.executable).with_name("kvpage"))
    env = dict(os.environ, KVPAGE_HOME=home)
    env.pop("KVPAGE_NO_SERVER", None)
    folder = str(fetch_source(source, question_set["sources"][source], cache))
    log = Path(home) / "bench-serve.log"
    with open(log, "w") as sink:
        server = subprocess.Popen([kvpage, "serve"], env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
    while "listening on" not in log.read_text():
        if server.poll() is not None:
            raise SystemExit(f"kvpage serve failed: {log.read_text()}")
        time.sleep(0.1)
    rows = []
    try:
        for q in [q for q in question_set["questions"] if q["source"] == source][:limit]:
            row, outputs = {"id": q["id"], "own_s": [], "served_s": []}, set()
            for _ in range(repeats):
                for case, extra in (("own", {"KVPAGE_NO_SERVER": "1"}), ("served", {})):
                    started = time.perf_counter()
                    done = subprocess.run([kvpage, "find", folder, q["question"], "-n", "3", "-q"],
                                          env={**env, **extra}, capture_output=True, check=True)
                    row[f"{case}_s"].append(round(time.perf_counter() - started, 3))
                    outputs.add(done.stdout)
            row["same_output"] = len(outputs) == 1
            row["own_median_s"] = median(row["own_s"])
            row["served_median_s"] = median(row["served_s"])
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    served = log.read_text().count("exited 0")
    if served != len(rows) * repeats:
        raise SystemExit(f"the server ran {served} finds, not {len(rows) * repeats}: {log.read_text()}")
    return rows


def lazy_windows(model: str, question_set: dict, cache: Path, configs: list[tuple[int, int, int]]) -> list[dict]:
    """A lazy index's choices replayed without the model (only the prompt's head is computed): per
    (window, overlap, index_tokens), each source's questions asked in the set's order, the
    passages `select_lazily` chooses, whether they hold the question's evidence, and the tokens of
    windows not indexed by the questions before it (what it would compute: its wait)."""
    from statistics import median

    from retrieval_parts.sources import evidence_attended, evidence_ranges, fetch_source

    import kvpage_cli.tasks.retrieval as retrieval
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.index import RetrievalIndex
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import Asker

    RetrievalIndex.ensure = lambda self, windows, on_event=None: 0  # nothing computed: choices only
    engine = Engine.load(model, EngineConfig(kv_cache=False))
    by_source: dict[str, list[dict]] = {}
    for q in question_set["questions"]:
        by_source.setdefault(q["source"], []).append(q)
    docs = {s: load(str(fetch_source(s, question_set["sources"][s], cache))) for s in by_source}
    rows = []
    for window, overlap, index_tokens in configs:
        retrieval.default_window = lambda max_context, w=window, o=overlap: (w, o)
        held, first, later = 0, [], []
        for source, questions in by_source.items():
            retriever, indexed = None, set()
            for n, q in enumerate(questions):
                asker = Asker(engine, docs[source], q["question"], max_new_tokens=48, retrieval_tokens=4096)
                asker.mode = "retrieval"
                asker.retriever = retriever
                retriever = asker.index()
                index = retriever.index
                selection = retriever.select_lazily(q["question"], retriever.tail + asker.question_ids[0],
                                                    asker.budget(), index_tokens)
                windows = {index.window_of(b) for b in selection.blocks}
                (first if n == 0 else later).append(sum(index.window_cost(w) for w in windows - indexed))
                indexed |= windows
                wanted = evidence_ranges(docs[source], q["evidence"])
                held += evidence_attended(wanted, [retriever.char_spans[b] for b in selection.blocks])
        rows.append({"window": window, "overlap": overlap, "index_tokens": index_tokens,
                     "evidence": f"{held} of {sum(map(len, by_source.values()))}",
                     "first_tokens": median(first), "later_tokens": median(later)})
    return rows


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import table, write_result
    from retrieval_parts.sources import DEFAULT_CACHE, load_question_set

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("rerank", "baseline", "find", "lazy"))
    parser.add_argument("dump", nargs="*", help="rerank: --evidence-dump files of `bench/retrieval.py questions`")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--home", default=None, help="find: KVPAGE_HOME whose saved-KV cache holds the index")
    parser.add_argument("--source", default="packaging", help="find: the question set's source")
    parser.add_argument("--limit", type=int, default=3, help="find: questions")
    parser.add_argument("--commands", type=int, default=0,
                        help="find: also time the command as new processes, own and served, this many times each")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE))
    parser.add_argument("--grow", type=float, default=None, help="GROW_SHARE to rank with")
    parser.add_argument("--configs", default="2048,512,10240;1024,256,10240;2048,512,5120",
                        help="lazy: window,overlap,index_tokens sets (';' between them)")
    args = parser.parse_args()
    if args.part == "lazy":
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
        rows = lazy_windows(args.model, load_question_set(), Path(args.cache).expanduser(), configs)
        print(table(rows, [("window", "window"), ("overlap", "overlap"), ("index_tokens", "index tokens / question"),
                           ("evidence", "passages holding the evidence"),
                           ("first_tokens", "1st question's new window tokens (median)"),
                           ("later_tokens", "later questions' (median)")]))
        write_result("retrieval-lazy", args, {"rows": rows})
        raise SystemExit(0)
    if args.part == "find":
        from common import peak_rss_mib

        rows = find_latency(args.model, args.home, load_question_set(), Path(args.cache).expanduser(), args.source,
                            args.limit)
        print(table(rows, [("id", "question"), ("document_tokens", "document tokens"),
                           ("indexed_tokens", "indexed tokens"), ("first_s", "first find s"),
                           ("first_prefill_tokens", "its prefill tok"), ("lookup_s", "find over the saved index s"),
                           ("lookup_prefill_tokens", "its prefill tok"), ("bm25_spans_s", "BM25 spans s")]))
        print(f"model {args.model}; source {args.source}; peak RSS {peak_rss_mib():.0f} MiB")
        result = {"rows": rows, "source": args.source, "peak_rss_mib": peak_rss_mib()}
        if args.commands:
            if not args.home:
                raise SystemExit("--commands needs --home (the saved index the commands read)")
            commands = find_commands(args.home, load_question_set(), Path(args.cache).expanduser(), args.source,
                                     args.limit, args.commands)
            print(table(commands, [("id", "question"), ("own_median_s", "`kvpage find`, own process s (median)"),
                                   ("served_median_s", "handed to `kvpage serve` s (median)"),
                                   ("same_output", "same output")]))
            result["commands"] = commands
        write_result("retrieval-find", args, result)
        raise SystemExit(0)
    if args.part == "baseline":
        rows = baseline(load_question_set(), Path(args.cache).expanduser())
        print(table(summary(rows), COLUMNS))
        raise SystemExit(0)
    if not args.dump:
        raise SystemExit("rerank needs the dumps of `bench/retrieval.py questions --evidence-dump PATH`")
    rows = rerank([Path(d) for d in args.dump], load_question_set(), Path(args.cache).expanduser(), args.grow)
    print(table(summary(rows), COLUMNS))
    write_result("retrieval-rerank", args, {"rows": rows, "summary": summary(rows)})
