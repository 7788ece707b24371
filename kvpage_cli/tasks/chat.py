"""Prompt assembly: one shared document prefix, then questions that fork it.

With a chat template (instruction models) the document sits at the start of the user message
and each question completes that message, followed by the assistant turn; without one (base
models) the prompt is plain text. The prefix is tokenized once and prefilled once.
"""

from __future__ import annotations

from .prompts import render

_MARK = "\u0000QUESTION\u0000"


class PromptBuilder:
    def __init__(self, tokenizer) -> None:
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; kvpage's tasks need one")
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        system = render("system")
        if self.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": _MARK}],
                add_generation_prompt=True, tokenize=False,
            )
            self._head, self._tail = text.split(_MARK)
        else:
            self._head, self._tail = system + "\n\n", "\n\n"

    def prefix(self, text: str) -> list[int]:
        """Token ids of the shared part: the system prompt and `text` (the document, instructions)."""
        if self.chat:
            return self._encode(self._head + text, special=False)
        return self._encode(self._head + text, special=True)

    def question(self, text: str, answer_prefix: str = "") -> list[int]:
        """Token ids that complete a prefix with a question and open the answer."""
        return self._encode(text + self._tail + answer_prefix, special=False)

    def continuation(self, text: str) -> list[int]:
        """Token ids of text that continues an answer (an option being scored, a next field)."""
        return self._encode(text, special=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special).input_ids)
