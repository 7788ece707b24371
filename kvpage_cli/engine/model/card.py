"""A model folder's card: what kvpage takes from its config and tokenizer, kept so that later
loads need no transformers.

Reading a folder through transformers (AutoConfig, AutoTokenizer) imports its configuration
classes, and they import torch.distributed and sympy, for a few numbers: a short `kvpage ask`
took 3.4 s and 524 MiB with them, 1.7 s and 434 MiB without (bench/startup.py). The first load
reads the folder with transformers as before and writes the card under `<home>/cards/`: the
ModelSpec, the rotary parameters (rope.py) and, for a tokenizer of transformers' TokenizersBackend
class that overrides none of the calls kvpage makes, its `tokenizers` backend with the special
tokens. Every load then wraps that backend in `Tokenizer`, which calls it as TokenizersBackend
does; other tokenizers stay transformers'. The card's key is the bytes of every config and
tokenizer file transformers reads and the versions of transformers and tokenizers, so an edited
file or an upgrade writes a new card. Chat templates are rendered by transformers the first time
each conversation is asked for and the text is kept beside the card (`Tokenizer.
apply_chat_template`): kvpage renders the same few conversations every time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import torch

from ..home import private_dir
from .rope import RopeParams
from .spec import LayerSpec, ModelSpec

CARD_FORMAT = 1
# What AutoConfig and AutoTokenizer read from a folder (those present are hashed into the key).
_READ_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
               "merges.txt")
# The calls kvpage and engine.tokenizer's users make: the card's Tokenizer makes them as
# TokenizersBackend does, so a subclass that overrides one of them gets no card tokenizer.
_CALLS = ("__call__", "_encode_plus", "encode", "decode", "_decode", "convert_ids_to_tokens", "get_vocab",
          "all_special_ids")


@dataclass(frozen=True)
class ModelCard:
    spec: ModelSpec
    rope: dict[str, RopeParams]
    tokenizer: Tokenizer | None  # None: the folder has no tokenizer, or one the card cannot stand for


def card_path(folder: Path, home: Path) -> Path:
    """Where the card of `folder`'s config and tokenizer files is kept."""
    digest = hashlib.sha256(f"{CARD_FORMAT}|{version('transformers')}|{version('tokenizers')}".encode())
    for name in _READ_FILES:
        path = folder / name
        if path.is_file():
            digest.update(f"|{name}|{path.stat().st_size}|".encode())
            digest.update(path.read_bytes())
    return home / "cards" / f"{digest.hexdigest()[:24]}.json"


def read_card(folder: Path, home: Path, load_transformers: Callable[[], Any]) -> ModelCard | None:
    """The card of `folder`, or None when there is none yet (or it is damaged).
    load_transformers: returns the folder's transformers tokenizer, for a chat template not rendered yet."""
    path = card_path(folder, home)
    try:
        saved = json.loads(path.read_text())
        if saved["format"] != CARD_FORMAT:
            return None
        spec = saved["spec"]
        spec = ModelSpec(**{**spec, "layers": tuple(LayerSpec(**layer) for layer in spec["layers"]),
                            "eos_token_ids": tuple(spec["eos_token_ids"])})
        rope = {k: RopeParams(inv_freq=torch.tensor(v["inv_freq"], dtype=torch.float32),
                              attention_scaling=float(v["attention_scaling"])) for k, v in saved["rope"].items()}
        info = saved["tokenizer"]
        tokenizer = None
        if info is not None:
            import tokenizers

            source = folder / "tokenizer.json" if info["backend"] == "tokenizer.json" else path.with_suffix(".tokenizer.json")
            tokenizer = Tokenizer(tokenizers.Tokenizer.from_file(str(source)), info,
                                  path.with_suffix(".templates.json"), load_transformers, fingerprint=path.stem)
    except Exception:  # none yet, or damaged (tokenizers raises Exception itself): read the folder again
        return None
    return ModelCard(spec, rope, tokenizer)


def write_card(folder: Path, home: Path, spec: ModelSpec, rope: dict[str, RopeParams], tokenizer) -> ModelCard:
    """Keeps what a load through transformers found (a read-only home: nothing is kept) and gives
    it back as later loads will read it, its Tokenizer over the same backend."""
    path = card_path(folder, home)
    info = None
    backend_text = None
    if tokenizer is not None and _plain_backend(tokenizer):
        backend_text = tokenizer.backend_tokenizer.to_str()
        try:
            import tokenizers

            same = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).to_str() == backend_text
        except Exception:  # no tokenizer.json, or one tokenizers cannot read: the card keeps the backend
            same = False
        info = {
            "backend": "tokenizer.json" if same else "card",
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "all_special_ids": [int(i) for i in tokenizer.all_special_ids],
            "special_tokens_map": dict(tokenizer.special_tokens_map),
            "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
            "split_special_tokens": bool(tokenizer.split_special_tokens),
            "clean_up": bool(tokenizer.clean_up_tokenization_spaces) and (
                type(tokenizer.backend_tokenizer.model).__name__ != "BPE"
                or bool(tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output)),
        }
        if info["clean_up"] or (tokenizer.chat_template is not None and info["chat_template"] is None):
            info = None  # word-piece clean-up, several named templates: left to transformers
    card = {"format": CARD_FORMAT, "spec": asdict(spec),
            "rope": {k: {"inv_freq": p.inv_freq.tolist(), "attention_scaling": p.attention_scaling} for k, p in rope.items()},
            "tokenizer": info}
    try:
        private_dir(path.parent)
        if info is not None and info["backend"] == "card":
            _replace(path.with_suffix(".tokenizer.json"), backend_text)
        _replace(path, json.dumps(card))  # float32 -> float (a double) -> float32: the same bits back
    except OSError:
        pass
    if info is None:
        return ModelCard(spec, rope, None)
    import tokenizers

    return ModelCard(spec, rope, Tokenizer(tokenizers.Tokenizer.from_str(backend_text), info,
                                           path.with_suffix(".templates.json"), lambda: tokenizer,
                                           fingerprint=path.stem))


def _plain_backend(tokenizer) -> bool:
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    return isinstance(tokenizer, TokenizersBackend) and all(
        getattr(type(tokenizer), name, None) is getattr(TokenizersBackend, name, None) for name in _CALLS)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Encoding(dict):
    """What calling a tokenizer gives: `input_ids` (and `attention_mask`, `offset_mapping` when
    asked), by key or by attribute, as transformers' BatchEncoding."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """A `tokenizers` backend called as transformers' TokenizersBackend calls it: encoding (special
    tokens added by the backend's post-processor; special-token strings split when asked), decoding,
    the vocabulary and the special tokens. Chat templates are rendered by transformers, once per
    conversation, and kept (`templates`)."""

    def __init__(self, backend, info: dict, templates: Path, load_transformers: Callable[[], Any],
                 fingerprint: str | None = None) -> None:
        """fingerprint: names what this tokenizer does (its card's key: the folder's tokenizer and
        config files, the versions of transformers and tokenizers), so that what it computed can be
        kept and found again (tasks/prepared.py); None: nothing it computes is kept."""
        self.backend_tokenizer = backend
        self.fingerprint = fingerprint
        self.bos_token_id: int | None = info["bos_token_id"]
        self.eos_token_id: int | None = info["eos_token_id"]
        self.all_special_ids: list[int] = list(info["all_special_ids"])
        self.special_tokens_map: dict[str, Any] = dict(info["special_tokens_map"])
        self.chat_template: str | None = info["chat_template"]
        self.split_special_tokens: bool = info["split_special_tokens"]
        self._templates_path = templates
        self._load_transformers = load_transformers

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, split_special_tokens: bool | None = None,
                 return_offsets_mapping: bool = False) -> Encoding:
        """One text, or a list of texts (then each key holds a list, one entry per text)."""
        batch = isinstance(text, (list, tuple))
        texts = list(text) if batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text to encode must be a str or a list of str")
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if self.backend_tokenizer.encode_special_tokens != split:
            self.backend_tokenizer.encode_special_tokens = split
        encoded = self.backend_tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        out = Encoding(input_ids=[list(e.ids) for e in encoded], attention_mask=[list(e.attention_mask) for e in encoded])
        if return_offsets_mapping:
            out["offset_mapping"] = [[tuple(o) for o in e.offsets] for e in encoded]
        return out if batch else Encoding({key: value[0] for key, value in out.items()})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs):
        """transformers' rendering of `conversation` (strings as content), kept after the first time."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        request = json.dumps([conversation, add_generation_prompt, kwargs], sort_keys=True)
        key = hashlib.sha256(f"{self.chat_template}\0{request}".encode()).hexdigest()
        try:
            kept = json.loads(self._templates_path.read_text())
        except (OSError, ValueError):
            kept = {}
        text = kept.get(key) if isinstance(kept, dict) else None
        if not isinstance(text, str) or "strftime_now" in self.chat_template:  # a template that writes the date
            text = self._load_transformers().apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
            kept = kept if isinstance(kept, dict) else {}
            kept[key] = text
            try:
                _replace(self._templates_path, json.dumps(kept))
            except OSError:  # a read-only home: rendered again next time
                pass
        return self(text, add_special_tokens=False).input_ids if tokenize else text
