"""Documents too long for the model's context, refused before they are tokenized.

Tokenizing costs time and memory in proportion to the text; a document of hundreds of megabytes
would be tokenized whole only to learn that it does not fit. No token of a vocabulary spells more
characters than its longest entry, so a text longer than the context times that length cannot
fit whatever its tokens; the check leaves a margin for normalizers that merge characters.
"""

from __future__ import annotations

from functools import lru_cache

from ..errors import ContextTooLongError

NORMALIZER_MARGIN = 4  # a normalizer (NFC, NFKC) may merge a few characters into one


@lru_cache(maxsize=8)
def longest_token_chars(tokenizer) -> int:
    """The characters of the vocabulary's longest entry: no token decodes to more (byte-level
    entries spell one character per byte, SentencePiece's "<0x0A>" stands for one)."""
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1)


def refuse_if_too_long(text: str, tokenizer, limit: int) -> None:
    """Raises ContextTooLongError when `text` cannot fit in `limit` tokens, without tokenizing it."""
    if tokenizer is None or len(text) <= limit * NORMALIZER_MARGIN:  # fits whatever the vocabulary
        return
    longest = longest_token_chars(tokenizer)
    if len(text) > limit * longest * NORMALIZER_MARGIN:
        raise ContextTooLongError(limit, limit, f"the document alone is {len(text):,} characters, and no token of "
                                                f"this model spells more than {longest}", more_than=True)
