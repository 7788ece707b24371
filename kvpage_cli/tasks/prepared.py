"""A document prepared for retrieval, saved beside its index: the prompt's tokens with the
characters of the document each holds, and its passages' search terms.

Over a saved index, tokenizing a long document and stemming its passages' words were most of
what a run computed besides the question (152K tokens of packaging on 2 cores: 0.25-0.3 s and
0.1-0.2 s of `kvpage find`'s 1.5 s), the same at every run over an unchanged document. They are
kept as one record in the saved-KV cache (`KVCache.write`, layout "record"), listed, evicted and
removed with the document's windows (the record carries the index's seed and label), under a key
over everything they are computed from: the tokenizer (its card's fingerprint), the prompt's head
tokens, the rendered prompt and the document's text, and how terms are made (TERMS_VERSION, the
passage size). A changed document, tokenizer or template gives another key; a tokenizer without
a fingerprint (one a library user passed in) keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.kv.saved.disk import BadSegment, KVCache

TERMS_VERSION = 1
"""How a passage's search terms are made (retrieval.search_terms, the stemmer, the stopwords):
raised when that changes, so that terms saved before are not found."""


@dataclass
class Prepared:
    """A document's prompt tokens (`PromptBuilder.prefix_spans` of its rendered prompt), per token
    the characters of doc.text it holds (None for the template's own words), and per passage of
    its index its search terms (None until the index is built)."""

    ids: list[int]
    chars: list[tuple[int, int] | None]
    terms: list[list[str]] | None = None


def prepared_key(fingerprint: str, head_ids: list[int], prompt: str, text: str, unit_blocks: int) -> str:
    """The record's key: the tokenizer's fingerprint, the template's head tokens, the rendered
    prompt, the document's text (its characters' places) and how its terms are made."""
    digest = hashlib.sha256(f"kvpage-prepared|{TERMS_VERSION}|{fingerprint}|{unit_blocks}|".encode())
    digest.update(np.asarray(head_ids, dtype="<i4").tobytes())
    for part in (prompt, text):
        digest.update(hashlib.sha256(part.encode("utf-8", "surrogatepass")).digest())
    return digest.hexdigest()


def load_prepared(cache: KVCache | None, key: str | None) -> Prepared | None:
    """The record saved under `key`, or None (no cache or key, none saved, or one that fails its
    checks: that one is discarded and the document prepared again)."""
    if cache is None or key is None:
        return None
    try:
        if key not in cache.present([key]):
            return None
        header, payload = cache.read_record(key)
        return _decode(header, payload)
    except FileNotFoundError:
        return None
    except (BadSegment, KeyError, TypeError, ValueError):
        _quietly(cache.discard, key)
        return None
    except (OSError, sqlite3.Error):
        return None


def save_prepared(cache: KVCache, key: str, prepared: Prepared, seed: str, label: str, model: str) -> None:
    """Saves `prepared` under `key` on the cache's writer thread (a failure only means it is
    computed again next time). seed: the document's index's (`kvpage cache ls` shows the record
    with its windows, as one document)."""
    ids = np.asarray(prepared.ids, dtype="<i4")
    chars = np.asarray([c if c is not None else (-1, -1) for c in prepared.chars], dtype="<i4").reshape(-1, 2)
    terms = json.dumps(prepared.terms, ensure_ascii=False, separators=(",", ":")).encode()
    header = {"key": key, "parent": "", "root": seed[:64], "seed": seed, "start": 0, "end": 0, "layout": "record",
              "tokens": len(ids), "terms_bytes": len(terms)}
    parts = [torch.from_numpy(ids), torch.from_numpy(chars), torch.frombuffer(bytearray(terms), dtype=torch.uint8)]

    def write() -> None:
        _quietly(cache.write, header, parts, label, model)

    cache.submit(write)


def _decode(header: dict, payload: memoryview) -> Prepared:
    """A record's payload: ids int32 [n], chars int32 [n, 2] (-1: none), terms as JSON."""
    count = int(header["tokens"])
    raw = np.frombuffer(payload, dtype=np.uint8)
    if len(raw) != 12 * count + int(header["terms_bytes"]):
        raise ValueError("a record of another size")
    ids = raw[:4 * count].view("<i4").tolist()
    # from one flat list: a list per token (reshape(-1, 2).tolist()) wakes the garbage collector
    # again and again, 0.15 s for 152K tokens against 0.02 s
    flat = raw[4 * count:12 * count].view("<i4").tolist()
    chars = [None if start < 0 else (start, end) for start, end in zip(flat[::2], flat[1::2])]
    terms = json.loads(bytes(raw[12 * count:]).decode())
    if terms is not None and not (isinstance(terms, list) and all(isinstance(t, list) for t in terms)):
        raise ValueError("terms of another kind")
    return Prepared(ids, chars, terms)


def _quietly(work, *args) -> None:
    try:
        work(*args)
    except (OSError, sqlite3.Error):
        pass
