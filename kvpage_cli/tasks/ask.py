"""Ask: questions over a document (a file, a repository, stdin); answers stream as they are decoded.

The document is prefilled once; every question forks it and the answers are decoded together in
one batch. An instruction model gets the question in its chat template; a base model gets text
to continue ("Question: ... Answer:"), never an instruction it would echo.

Under every answer, its evidence (tasks/evidence.py): the spans of the document that carried the
model's attention while it wrote the answer. The questions are read first, apart from the
answers, and a copy of each question's context is kept; once the answers are decoded, each is
read again after that copy with every row's queries kept (one scoring pass, off the decode path),
and their attention over the document's tokens ranks its lines.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from ..engine import Engine
from ..engine.attention.evidence import token_mass
from ..engine.config import BLOCK_TOKENS
from ..engine.engine import Request
from ..engine.events import EventCallback
from ..engine.kv.context import Context
from ..engine.kv.saved.disk import KVCache
from ..errors import ContextTooLongError
from ..ingest import Document
from . import evidence as evidence_spans
from .chat import PromptBuilder
from .length import refuse_if_too_long
from .prepared import Prepared, load_prepared, prepared_key, save_prepared
from .prompts import render
from .retrieval import INDEX_TOKENS, UNIT_BLOCKS, Retriever, Selection, question_budget
from .schema import Evidence

_KINDS = {"pdf": "a PDF document", "docx": "a Word document", "text": "a text file", "repo": "a code repository"}


class Asker:
    """Questions over one document. `answers()` yields (question index, text) pieces as they are decoded."""

    def __init__(self, engine: Engine, doc: Document, questions: str | list[str], max_new_tokens: int = 256,
                 temperature: float = 0.0, on_event: EventCallback | None = None, label: str | None = None,
                 max_batch: int | None = None, retrieval_tokens: int | None = None, evidence: bool = True,
                 lazy: bool = True, index_tokens: int = INDEX_TOKENS, mode: str | None = None) -> None:
        """evidence: find each answer's evidence (`evidence`, after the answers). lazy, index_tokens:
        retrieval mode indexes only the windows a question's best passages lie in, up to
        index_tokens of windows a question (Retriever.select_lazily); not lazy: the whole document
        first. mode: the engine's config mode unless given ("retrieval": an index whatever the
        document's length, as `kvpage find` reads one)."""
        questions = [questions] if isinstance(questions, str) else list(questions)
        if not questions or any(not q.strip() for q in questions):
            raise ValueError("the question is empty")
        self.engine = engine
        self.doc = doc
        self.questions = [q.strip() for q in questions]
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.on_event = on_event
        self.label = label
        self.max_batch = max_batch
        self.retrieval_tokens = retrieval_tokens or engine.config.retrieval_tokens  # retrieval: tokens a question reads
        self.mode = mode or engine.config.mode
        if self.mode == "exact":  # before tokenizing; retrieval (and selective's) reads any length
            refuse_if_too_long(doc.text, engine.tokenizer, engine.max_context)
        self.prompts = PromptBuilder(engine.tokenizer)
        text = doc.text.strip()
        document = render("document", kind=_KINDS.get(doc.kind, doc.kind), source=doc.name, text=text)
        # a document prepared before (tasks/prepared.py): its tokens read back, not computed
        fingerprint = getattr(engine.tokenizer, "fingerprint", None)
        self._prepared_key = prepared_key(fingerprint, self.prompts.head_ids, document, doc.text,
                                          UNIT_BLOCKS) if fingerprint else None
        self._prepared = load_prepared(self._saved_kv(), self._prepared_key)
        if self._prepared is not None:
            self.prefix_ids, self._chars = self._prepared.ids, self._prepared.chars
        else:
            self.prefix_ids, chars = self.prompts.prefix_spans(document)
            # per prompt token, the characters of doc.text it holds (None: the template's own words)
            start, shift = document.find(text), doc.text.find(text) - document.find(text)
            self._chars = [(c[0] + shift, c[1] + shift) if c is not None and c[1] > start and c[0] < start + len(text)
                           else None for c in chars]
        # A chat model's question follows the document's end ("</document>") after a blank line, as
        # in a review's prompt; a base model's with none, as measured over bench/retrieval.py's 46
        # questions of eight sources (`questions --model gemma3-270m --systems retrieval,bm25`): with
        # the blank line 7 and 9 right against 10 and 10 (empty answers, the model writing a next
        # question at once, 4 and 8 against 2 and 1), pass keys at 128K and 19 depths 10 against 12;
        # SmolLM2 took it, 6 right against 5 (retrieval mode, the same questions).
        if self.prompts.chat:
            self.question_ids = [self.prompts.question("\n\n" + render("ask", question=q)) for q in self.questions]
        else:  # text to continue: "Question: ...", a blank line, "Answer:"
            self.question_ids = [self.prompts.question(render("ask_base", question=q), answer_prefix=BASE_TURNS[1])
                                 for q in self.questions]
        longest = max(len(ids) for ids in self.question_ids)
        needed = len(self.prefix_ids) + longest + max_new_tokens
        if self.mode == "auto":  # the whole document when it fits, else the blocks each question needs
            self.mode = "retrieval" if needed > engine.max_context else "exact"
        elif self.mode == "selective" and needed > engine.max_context:
            self.mode = "retrieval"  # the blocks each question needs; the engine's decode steps still select
        if self.mode != "retrieval" and needed > engine.max_context:
            raise ContextTooLongError(
                needed, engine.max_context,
                f"the document is {len(self.prefix_ids)} tokens; use --mode auto or retrieval (reads the blocks each "
                "question needs), ask about a smaller part of it, or lower --max-new-tokens",
            )
        if self.mode == "retrieval":
            room = (engine.max_context - longest - max_new_tokens - BLOCK_TOKENS) // BLOCK_TOKENS * BLOCK_TOKENS
            if room < 2 * BLOCK_TOKENS:
                raise ContextTooLongError(needed, engine.max_context,
                                          "the question and --max-new-tokens leave no room for the document")
        self.cached_tokens = 0
        self.complete = [False] * len(self.questions)
        self.selections: list[Selection | None] = [None] * len(self.questions)
        self.sources: list[list[dict]] = [[] for _ in self.questions]
        self.retriever: Retriever | None = None
        self.find_evidence = evidence
        self.lazy = lazy
        self.index_tokens = index_tokens
        self.evidence: list[list[Evidence]] = [[] for _ in self.questions]
        # per question, the document tokens its answer read ((start, end) in doc.text) and the
        # attention the answer paid each [tokens] (what the evidence is ranked from)
        self.attention: list[tuple[list[tuple[int, int]], torch.Tensor] | None] = [None] * len(self.questions)
        self.indexed: list[int | None] = [None] * len(self.questions)  # retrieval: document tokens indexed at the answer

    @property
    def question(self) -> str:
        return self.questions[0]

    @property
    def document_tokens(self) -> int:
        return len(self.prefix_ids)

    def answer(self) -> Iterator[str]:
        """The first question's answer, piece by piece (one question: `kvpage ask PATH QUESTION`)."""
        for index, piece in self.answers():
            if index == 0:
                yield piece

    def answers(self) -> Iterator[tuple[int, str]]:
        """Prefills the document, then decodes every answer together, yielding (question index,
        new text) as it comes; an answer ends at the model's end token, at max_new_tokens, or when
        it starts to loop or writes a turn of the prompt's (`AnswerText`). With evidence on, the
        answers are complete (`complete`) once their evidence is found, after the last one ends."""
        engine = self.engine
        stop = engine.stop_ids
        if self.mode == "retrieval":
            requests, places = self._retrieval_requests(stop)
        else:
            doc_ctx = engine.prefill(self.prefix_ids, on_event=self.on_event, label=self.label)
            self.cached_tokens = doc_ctx.cached_prefix
            requests = [Request(engine.fork(doc_ctx), ids, self.max_new_tokens, self.temperature, stop=stop, tag=i)
                        for i, ids in enumerate(self.question_ids)]
            places = [list(range(len(self.prefix_ids)))] * len(requests)
            engine.release(doc_ctx)  # the forks hold the document's blocks now
        # the questions first, apart from the answers (the same rows either way): each answer's
        # evidence is read after a copy of the context its question left
        engine.append_many([r.ctx for r in requests], [r.token_ids for r in requests], on_event=self.on_event,
                           max_batch=self.max_batch)
        asked = [engine.fork(r.ctx) if self.find_evidence else None for r in requests]
        for r in requests:
            r.token_ids = []
        texts = [AnswerText(self.prompts.decode, self.turns) for _ in requests]
        for request, token in engine.run(requests, max_batch=self.max_batch, on_event=self.on_event):
            i = request.tag
            if token in stop:
                continue
            piece, looped = texts[i].add(token)
            if looped:
                request.done = True  # leaves the batch at the end of this step
            if piece:
                yield i, piece
            if request.done and not self.find_evidence:
                self.complete[i] = True
        for i, request in enumerate(requests):
            piece = texts[i].finish()
            if piece:
                yield i, piece
            engine.release(request.ctx)
        for i, ctx in enumerate(asked):
            if ctx is not None:
                self.evidence[i] = self._evidence(i, ctx, texts[i].kept_tokens(), places[i])
                engine.release(ctx)
            self.complete[i] = True

    @property
    def turns(self) -> tuple[str, ...]:
        """The lines that end an answer (AnswerText): a base model's next "Question:", its cue
        again or the document's end (BASE_TURNS); any model's start of a question of its own or
        of a heading of the prompt's (PROMPT_TURNS)."""
        return (BASE_TURNS if not self.prompts.chat else ()) + PROMPT_TURNS

    def _evidence(self, i: int, ctx: Context, tokens: list[int], places: list[int | None]) -> list[Evidence]:
        """The answer's evidence: `tokens` (the answer as shown) read again after `ctx` (the
        context its question left) with their queries kept, their attention summed over the
        document's tokens (places: per position of ctx, its prompt token, None for tokens not
        from the prompt) and ranked (tasks/evidence.py). An empty answer's are the question's
        own tokens read again: the lines its reading of the question attended, as `kvpage find`
        ranks them (SmolLM2 began two of bench/retrieval.py's 27 answers with a turn of the
        prompt's, "Question:", and said nothing else)."""
        if not self.prompts.decode(tokens).strip():
            tokens = self.question_ids[i]
        queries = self.engine.append_with_queries(ctx, tokens)
        self.attention[i] = self.document_tokens_of(places, token_mass(self.engine, ctx, queries))
        return evidence_spans.rank(self.doc, *self.attention[i], self.questions[i])

    # -- retrieval ---------------------------------------------------------------------------------

    def index(self) -> Retriever:
        """Indexes the document (once): its head prefilled, the rest window by window (lazy: the
        saved windows mapped, the others as questions need them). Its tokens and its passages'
        terms are saved beside the index where they were computed (tasks/prepared.py)."""
        if self.retriever is None:
            prepared = self._prepared
            self.retriever = Retriever.build(self.engine, self.doc, self.prefix_ids, self._chars, self.on_event,
                                             self.label, lazy=self.lazy, terms=prepared and prepared.terms)
            self.cached_tokens = self.retriever.index.head.cached_prefix
            cache = self._saved_kv()
            if cache is not None and self._prepared_key and (prepared is None or prepared.terms != self.retriever.terms):
                self._prepared = Prepared(self.prefix_ids, self._chars, self.retriever.terms)
                save_prepared(cache, self._prepared_key, self._prepared, self.retriever.index.seed, self.label or "",
                              self.engine.name)
        return self.retriever

    def _saved_kv(self) -> KVCache | None:
        """The engine's saved-KV cache, None when it is off or cannot be used (the engine warns
        of that when it prefills)."""
        try:
            return self.engine.kv_cache
        except OSError:
            return None

    def budget(self) -> int:
        """Blocks a question may read (retrieval.question_budget)."""
        longest = max(len(ids) for ids in self.question_ids) + len(self.retriever.tail)
        fixed = len(self.retriever.index.head.tokens) + longest + self.max_new_tokens
        return question_budget(self.engine, fixed, self.retrieval_tokens)

    def _retrieval_requests(self, stop) -> tuple[list[Request], list[list[int | None]]]:
        """A request per question over the blocks selected for it, and per request, for each
        position of its context, the prompt token there (None: the question's own)."""
        requests, places = [], []
        for i in range(len(self.questions)):
            ctx, tokens, place = self.retrieval_context(i)
            requests.append(Request(ctx, tokens, self.max_new_tokens, self.temperature, stop=stop, tag=i))
            places.append(place)
        return requests, places

    def retrieval_context(self, i: int) -> tuple[Context, list[int], list[int | None]]:
        """Question i's context in retrieval mode: the head and the blocks selected for it, moved
        after it in reading order (a lazy index first indexes the windows they lie in); the
        tokens to read after them (the blocks read again, the document's last tokens and the
        template's end, the question); and per position of the context with those, the prompt
        token there (None: the question's own)."""
        retriever = self.index()
        budget = self.budget()
        index = retriever.index
        head = len(index.head.tokens)
        question, ids = self.questions[i], self.question_ids[i]
        asked = retriever.tail + ids
        if index.missing:
            selection = retriever.select_lazily(question, asked, budget, self.index_tokens, self.on_event)
        else:
            selection = retriever.select(question, asked, budget)
        self.selections[i] = selection
        self.sources[i] = retriever.sources(selection)
        self.indexed[i] = index.indexed_tokens
        again = self._read_again(selection)
        order = reading_order(selection, again)
        ctx = index.assemble(order)
        tokens = [t for b in again for t in index.tokens[index.blocks[b].first:index.blocks[b].first + BLOCK_TOKENS]]
        place = list(range(head))
        for b in order + again:
            place += range(head + index.blocks[b].first, head + index.blocks[b].first + BLOCK_TOKENS)
        place += range(head + len(index.tokens), head + len(index.tokens) + len(retriever.tail))
        return ctx, tokens + asked, place + [None] * len(ids)

    def document_tokens_of(self, places: list[int | None], mass: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """The document's tokens among a context's positions (places: per position, its prompt
        token, as `retrieval_context` gives them) and their entries of `mass` [positions]."""
        chars, masses = [], []
        for position, prompt_index in enumerate(places):
            if prompt_index is not None and self._chars[prompt_index] is not None:
                chars.append(self._chars[prompt_index])
                masses.append(float(mass[position]))
        return chars, torch.tensor(masses)

    def _read_again(self, selection: Selection) -> list[int]:
        """Blocks computed again right before the question, the best passage last: for a model with
        sliding-window layers, whose index keeps nothing of those layers, so that they read the
        passages that matched best (as they read the last tokens before a question in exact mode)
        and not only the question. Gemma 3 270M found 0 of 3 pass keys in an 8K haystack without
        this, though its full-attention layers read the needle's block, and 3 of 3 with it
        (`bench/retrieval.py passkey --model gemma3-270m --systems retrieval --lengths 8192`).
        READ_AGAIN_TOKENS of them, more than Gemma 3's 512-token window holds: over bench/retrieval.py's
        46 questions of 8 sources (`questions --model gemma3-270m`), 10 right against 6 with 512
        tokens read again, as many as the BM25 text baseline, the first answer token 1.0 s after
        a question against 0.6 s. Passages that follow one another in the document are read in
        its order (a sentence cut by a passage's end reads whole)."""
        sliding = any(layer.window for layer in self.engine.spec.layers)
        return read_again(selection, READ_AGAIN_TOKENS if sliding else 0)


def read_again(selection: Selection, tokens: int) -> list[int]:
    """The best passages that fit `tokens`, in the order they are read (Asker._read_again); only
    selected ones (a budget of fewer passages than Selection.best names reads no more)."""
    rank: dict[int, int] = {}
    selected = set(selection.blocks)
    for n, passage in enumerate(p for p in selection.best if selected.issuperset(p)):
        if (len(rank) + len(passage)) * BLOCK_TOKENS > tokens:
            break
        rank.update((b, n) for b in passage)
    runs = sorted(_runs(sorted(rank)), key=lambda run: -min(rank[b] for b in run))  # the best nearest the question
    return [b for run in runs for b in run]


def reading_order(selection: Selection, again: list[int]) -> list[int]:
    """The order a question reads its selected blocks in (less those read again): document order,
    but the passage that matched best last, right before the question, where a small model reads
    best, with the passages that adjoin it in the document (a sentence cut by a passage's end
    reads whole). Pass keys in a 128K haystack at nine depths, SmolLM2, 4,096 tokens a question
    (`bench/retrieval.py passkey --lengths 131072 --depths 10,20,...,90`, and `--order document`):
    9 of 9 found this way, 4 of 9 in document order (the BM25 text baseline: 9 and 7). Passages
    read again (`Asker._read_again`) already come last, the best nearest the question."""
    rest = sorted(set(selection.blocks) - set(again))
    if again or not selection.best:
        return rest
    runs = _runs(rest)
    best = next((run for run in runs if selection.best[0][0] in run), None)
    return rest if best is None else [b for run in runs if run is not best for b in run] + best


def _runs(blocks: list[int]) -> list[list[int]]:
    """Sorted block indices cut where they stop following one another."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and b == runs[-1][-1] + 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


READ_AGAIN_TOKENS = 1024  # at most this many of a question's best tokens are computed again (Asker._read_again)
LOOP_TOKENS = 32  # a block repeated back to back over at least this many tokens is a loop
SENTENCE_TOKENS = 8  # a sentence of at least this many tokens said twice in a row is a loop
HOLD_WORDS = 3  # a sentence is held back while this many of an answer's last tokens repeat earlier ones (AnswerText)


BASE_TURNS = ("Question:", "Answer:", "Q:", "</document>")
"""The turns of a base model's prompt (prompts/ask_base.md, then the answer's cue), their short
form and the document's end (prompts/document.md): a line of the answer that starts with one of
them is the model writing the next question, or the prompt again (Gemma 3 270M answered "Who are
the parties?" with "Q: What is the purpose of this document?", and a question over tomli's
sources with the end of the document, "</document>Question: ...")."""

PROMPT_TURNS = ("Question:", "<document>", "</document>", "Here is a document to analyse", "==> ")
"""Lines any model's answer ends before: a question of its own, and the headings of the prompt's
own text (prompts/document.md, and a repository's "==> path <==" file headings): the model
writing the prompt again, not answering."""

INLINE_TURNS = ("Question:", "Answer:")
"""Turns that end an answer where they follow a sentence's end inside a line too ("... is 0.21.
Question: What is ..."): after "." "!" or "?" and a space, where a sentence of the answer would
not start with them."""


class AnswerText:
    """One answer's text as its tokens come, without white space before or after it. What it
    shows is never taken back: a tail of tokens that repeats earlier ones (`repeating_tail`) is
    held until it stops repeating (then shown) or becomes a loop (`loop_start`: then cut, so a
    loop's second copy is neither streamed nor kept), and while HOLD_WORDS or more of them
    repeat, the sentence they are in is held too (a loop's first copy can start and end inside a
    sentence; the answer then ends with the last sentence that ended, where that was not yet
    shown), and a sentence that starts with the words an earlier one started with is held until
    it ends (`_sentence_said_before`). Repeats are judged on the tokens' text less its
    white space, so a sentence said again with its line broken elsewhere is the same sentence
    (SmolLM2 over a repository's reStructuredText repeated "The function is defined as
    `select_autoescape` when enabled." eight times, its copies wrapped at different words).
    With `turns`, a line starting with one of them ends the answer before it (the line is not
    shown); a last line that may still become one is held until it cannot."""

    def __init__(self, decode, turns: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.turns = turns
        self.tokens: list[int] = []
        self.words: list[str | int] = []  # per token that is not white space: its text less white space
        self.at: list[int] = []  # the index in `tokens` of each of `words`
        self.starts: list[int] = []  # the indices in `words` where sentences start
        self.space = ""  # the white space since the last of `words`
        self.shown = ""
        self.ended = False

    def add(self, token: int) -> tuple[str, bool]:
        """The new text to show, and whether the answer ends here (it started to loop, or a turn)."""
        self.tokens.append(token)
        text = self.decode([token])
        word = token if "\ufffd" in text else "".join(text.split())  # part of a character: the token itself
        if word == "":
            self.space += text
        else:
            space = self.space + text[:len(text) - len(text.lstrip())]
            if not self.words or "\n" in space or (space and _ends_sentence(self.words[-1])):
                self.starts.append(len(self.words))
            self.words.append(word)
            self.at.append(len(self.tokens) - 1)
            self.space = text[len(text.rstrip()):] if isinstance(word, str) else ""
        loop = loop_start(self.words)
        if loop is not None:
            del self.tokens[self.at[loop]:]
            piece, self.ended = self._show(len(self.tokens), last=True, whole=True), True
            return piece, True
        held = repeating_tail(self.words)
        count = self.at[-held] if held else len(self.tokens)
        start = self._sentence_said_before()
        if start is not None:
            count = min(count, self.at[start])
        return self._show(count, last=False, whole=held >= HOLD_WORDS), self.ended

    def _sentence_said_before(self) -> int | None:
        """Where the sentence in progress starts (in `words`), while its first words (two at most)
        are those an earlier sentence started with: it is held until it ends, as it may be a
        loop's next copy that does not repeat to the end ("The document provides X. The document
        also provides X. The document also ..." loops with a period that cuts after "also")."""
        if not self.starts or _ends_sentence(self.words[-1]):
            return None
        start = self.starts[-1]
        head = self.words[start:start + 2]
        if any(self.words[earlier:earlier + len(head)] == head for earlier in self.starts[:-1]):
            return start
        return None

    def finish(self) -> str:
        """What is still held, once the answer has ended (nothing after a loop or a turn)."""
        return "" if self.ended else self._show(len(self.tokens), last=True)

    def kept_tokens(self) -> list[int]:
        """The fewest first tokens whose text holds all that was shown: the answer's own tokens,
        less a loop's copies, a turn and what followed it (call after `finish`)."""
        wanted = len(self.shown)
        if not wanted:
            return []
        lo, hi = 1, len(self.tokens)
        while lo < hi:  # the text grows with the tokens
            mid = (lo + hi) // 2
            if len(self.decode(self.tokens[:mid]).strip()) >= wanted:
                hi = mid
            else:
                lo = mid + 1
        return self.tokens[:lo]

    def _show(self, count: int, last: bool, whole: bool = False) -> str:
        """The text of the first `count` tokens not yet shown; `whole`: less the sentence it
        breaks off in, after one that ended and where that is not yet shown (a loop's first copy
        can start and end inside a sentence: "... and [is defined as X when enabled. The function]")."""
        text = self.decode(self.tokens[:count])
        if not last and text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return ""
        if self.turns:
            text, self.ended = _before_turn(text, self.turns, last)
        text = text.strip()  # an answer neither starts nor ends with white space (a last line break is held)
        end = _sentences_end(text) if whole else -1
        if end >= len(self.shown) and (end > 0 or not last):  # a loop of one broken sentence keeps its first copy
            text = text[:end].rstrip()  # a cut at a line break leaves no white space at the end
        piece = text[len(self.shown):]
        if piece:
            self.shown = text
        return piece


def _ends_sentence(word: str | int) -> bool:
    """Whether a token's text (less its white space) ends a sentence, as `_sentences_end` sees one."""
    return isinstance(word, str) and re.search(r"[.!?:;][\"')\]`*]*$", word) is not None


def _sentences_end(text: str) -> int:
    """The length of `text` up to the end of its last whole sentence or line (0 if none ends)."""
    ends = [m.end() for m in re.finditer(r"[.!?:;][\"')\]`*]*(?=\s|$)|\n", text.rstrip())]
    return ends[-1] if ends else 0


def _before_turn(text: str, turns: tuple[str, ...], last: bool) -> tuple[str, bool]:
    """(The text before the first line that starts with a turn, or before an inline turn
    (INLINE_TURNS after a sentence's end inside a line), True) if there is one; else (the text,
    without an end that could still become one unless `last`, False)."""
    inline = [t for t in INLINE_TURNS if t in turns]
    after_sentence = re.compile(r"(?<=[.!?])[ \t]+(?:" + "|".join(map(re.escape, inline)) + ")") if inline else None
    start = 0
    while True:
        end = text.find("\n", start)
        stop = len(text) if end < 0 else end
        line = text[start:stop].lstrip(" \t")
        if any(line.startswith(turn) for turn in turns):
            return text[:start], True
        found = after_sentence.search(text, start, stop) if after_sentence is not None else None
        if found is not None:
            return text[:found.start()], True
        if end < 0:
            if not last and any(turn.startswith(line) for turn in turns):
                return text[:start], False
            tail = re.search(r"(?<=[.!?])[ \t]+(\S*)$", line) if inline and not last else None
            if tail is not None and any(t.startswith(tail.group(1)) for t in inline):
                return text[:len(text) - len(tail.group(0))], False
            return text, False
        start = end + 1


def repeating_tail(tokens: list) -> int:
    """How many of the last tokens repeat, in order, the tokens some fixed distance before them:
    the part of an answer that may be the start of a loop's next copy."""
    n = len(tokens)
    longest = 0
    for period in range(1, n):
        length = 0
        while length < n - period and tokens[n - 1 - length] == tokens[n - 1 - length - period]:
            length += 1
        longest = max(longest, length)
    return longest


def loop_start(tokens: list) -> int | None:
    """Where the answer starts looping (the index after the loop's first copy), or None.

    A loop is any block of p tokens that ends the answer and repeats back to back, at least twice
    and over at least LOOP_TOKENS tokens in all ("the the the ...", or a whole line said again and
    again), whatever p is; or, where the tokens are text (AnswerText's), a sentence of at least
    SENTENCE_TOKENS said twice in a row ("It is a legal and technical analysis of a document. It
    is a legal and technical analysis of a document.", SmolLM2 on a landscape PDF)."""
    n = len(tokens)
    last = tokens[-1] if tokens else None
    sentence = isinstance(last, str) and last[-1:] in (".", "!", "?")
    for period in range(1, n // 2 + 1):
        if tokens[n - 1 - period] != last:
            continue
        repeats = 1
        while (repeats + 1) * period <= n and tokens[n - (repeats + 1) * period:n - repeats * period] == tokens[n - period:]:
            repeats += 1
        if repeats >= 2 and (repeats * period >= LOOP_TOKENS or (sentence and period >= SENTENCE_TOKENS)):
            return n - (repeats - 1) * period
    return None
