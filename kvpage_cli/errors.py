"""Errors a user can cause. The CLI turns each into one line and a non-zero exit code."""


class KvpageError(Exception):
    """Base of every error kvpage reports to a user as one line (exit code 1)."""

    exit_code = 1


class UsageError(KvpageError):
    """The command line asks for something that cannot work (exit code 2)."""

    exit_code = 2


class ModelError(KvpageError):
    """A model is missing, unreadable or of an unsupported architecture."""


class ContextTooLongError(KvpageError):
    """The prompt does not fit in the model's context (or the configured limit)."""

    def __init__(self, num_tokens: int, limit: int, hint: str = "", more_than: bool = False):
        self.num_tokens = num_tokens
        self.limit = limit
        self.more_than = more_than  # refused before tokenizing: num_tokens is a lower bound
        message = (f"the input is {'more than ' if more_than else ''}{num_tokens} tokens "
                   f"but the context limit is {limit} tokens")
        super().__init__(message + (f"; {hint}" if hint else ""))


class IngestError(KvpageError):
    """A document could not be read into text."""
