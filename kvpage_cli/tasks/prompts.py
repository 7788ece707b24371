"""Prompt templates: text files with $name placeholders, shipped as package data."""

from __future__ import annotations

import string
from functools import lru_cache
from importlib import resources

from ..errors import KvpageError


class PromptError(KvpageError):
    """A template is missing, or a placeholder in it was given no value."""


@lru_cache(maxsize=None)
def template(name: str) -> string.Template:
    """The template `name` (e.g. "review_clause" for prompts/review_clause.md)."""
    try:
        text = resources.files("kvpage_cli.prompts").joinpath(f"{name}.md").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptError(f"prompt template {name!r} is missing (prompts/{name}.md)") from None
    return string.Template(text)


def render(name: str, **values: object) -> str:
    """Fills template `name`; every $placeholder must get a value, and every value a placeholder."""
    tmpl = template(name)
    names = {m.group("named") or m.group("braced") for m in tmpl.pattern.finditer(tmpl.template)} - {None}
    missing = names - values.keys()
    if missing:
        raise PromptError(f"prompt {name!r} needs a value for ${', $'.join(sorted(missing))}")
    unused = values.keys() - names
    if unused:
        raise PromptError(f"prompt {name!r} has no placeholder for {', '.join(sorted(unused))}")
    return tmpl.substitute({k: str(v) for k, v in values.items()}).strip("\n")
