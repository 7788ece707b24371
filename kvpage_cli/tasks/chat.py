"""Prompt assembly: one shared document prefix, then questions that fork it.

With a chat template (instruction models) the document sits at the start of the user message
and each question completes that message, followed by the assistant turn; without one (base
models) the prompt is plain text. The prefix is tokenized once and prefilled once.

Documents and questions are untrusted: a contract may contain `<|im_end|>` or `<start_of_turn>`.
Only the chat template's own head and tail are encoded with special tokens recognised; every
other piece of text is encoded with special-token strings split into ordinary tokens, and the ids
are concatenated, so no special-token id can come from a document or a question.
"""

from __future__ import annotations

from .prompts import render

_MARK = "\u0000QUESTION\u0000"
_BREAK = "\u200b"  # zero-width space: the last resort that keeps a special-token string from matching


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (control tokens such as <|im_end|>, <bos>, <eos>)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


class PromptBuilder:
    def __init__(self, tokenizer) -> None:
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; kvpage's tasks need one")
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self._special_texts = sorted({tokenizer.convert_ids_to_tokens(i) for i in self.special_ids} - {None, ""},
                                     key=len, reverse=True)
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        system = render("system")
        if self.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": _MARK}],
                add_generation_prompt=True, tokenize=False,
            )
            head, tail = text.split(_MARK)
            self._head_ids = self._template_ids(head)
            self._tail_ids = self._template_ids(tail)
        else:
            bos = getattr(tokenizer, "bos_token_id", None)
            lead = list(tokenizer("", add_special_tokens=True).input_ids)
            self._head_ids = ([bos] if bos is not None and lead[:1] == [bos] else []) + self.text_ids(system + "\n\n")
            self._tail_ids = self.text_ids("\n\n")

    @property
    def head_ids(self) -> list[int]:
        """The template's tokens before the text of `prefix` (the system prompt's turn)."""
        return list(self._head_ids)

    def prefix(self, text: str) -> list[int]:
        """Token ids of the shared part: the system prompt and `text` (the document, instructions)."""
        return self._head_ids + self.text_ids(text)

    def prefix_spans(self, text: str) -> tuple[list[int], list[tuple[int, int] | None]]:
        """`prefix(text)` and, per token, the characters of `text` it came from (None for the
        template's own tokens)."""
        ids, offsets = self._split_encode_offsets(text)
        if not self.special_ids.isdisjoint(ids):  # see text_ids: no offsets for the last resort
            ids, offsets = self.text_ids(text), [None] * len(self.text_ids(text))
        return self._head_ids + ids, [None] * len(self._head_ids) + offsets

    def question(self, text: str, answer_prefix: str = "") -> list[int]:
        """Token ids that complete a prefix with a question and open the answer."""
        return self.text_ids(text) + self._tail_ids + (self.text_ids(answer_prefix) if answer_prefix else [])

    def continuation(self, text: str) -> list[int]:
        """Token ids of text that continues an answer (an option being scored, a next field)."""
        return self.text_ids(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text_ids(self, text: str) -> list[int]:
        """Ids of untrusted text: special-token strings in it become ordinary tokens, never control ids."""
        ids = self._split_encode(text)
        if self.special_ids.isdisjoint(ids):
            return ids
        # A tokenizer that ignores split_special_tokens: break every special-token string so that
        # it cannot match, at the cost of one invisible character.
        for special in self._special_texts:
            text = text.replace(special, special[:1] + _BREAK + special[1:])
        ids = self._split_encode(text)
        if not self.special_ids.isdisjoint(ids):
            raise ValueError("the tokenizer turns plain text into special tokens; it cannot be used safely")
        return ids

    def _split_encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def _split_encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    def _template_ids(self, text: str) -> list[int]:
        """The chat template's own text: its special tokens are meant."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
