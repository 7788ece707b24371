"""`kvpage cache ls|rm|clear`: the saved document KV under KVPAGE_HOME/kv."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Column, Table

from ..engine import KVCache
from ..engine.config import DEFAULT_CACHE_MIB
from ..engine.kv.saved.disk import MIN_KEY_PREFIX
from ..errors import KvpageError
from .options import OUTPUT, RUN, Options, shared_options
from .output import Sink, check_out_path, choose_format
from .session import MIB, Session, document_label

app = typer.Typer(
    help="The saved KV of documents already read: a later `ask` or `review` of the same document "
         "loads it instead of computing its prefill again.\n\n"
         "Entries live under KVPAGE_HOME/kv (default ~/.cache/kvpage/kv), files readable by you only; "
         f"the least recently used are evicted past --cache-mib (default {DEFAULT_CACHE_MIB:,.0f}). `--no-cache` "
         "on ask or review neither reads nor writes it.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)

FORMATS = ("table", "text", "json")


def _open(opts: Options) -> KVCache:
    try:
        return KVCache.open(opts.home)
    except OSError as exc:
        raise KvpageError(f"the saved-KV cache is unavailable: {exc}") from None


def _busy(exc: OSError) -> KvpageError:
    return KvpageError(f"the saved-KV cache is unavailable: {exc}; try again later")


@app.command("ls")
@shared_options(OUTPUT, RUN)
def ls(*, opts: Options) -> None:
    """List the saved documents: label, model, tokens, size and when last used.

    Examples:

    ```
    kvpage cache ls
    kvpage cache ls --json | jq '.[] | select(.tokens > 4000)'
    ```
    """
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS)
    check_out_path(opts.out)
    sink = Sink(opts.out, opts.no_color)
    with Session(opts) as session:
        entries = _open(opts).list_entries()
        rows = [
            {"label": e.label or "(unnamed)", "model": e.model, "tokens": e.tokens, "mib": round(e.bytes / MIB, 1),
             "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)), "key": e.key[:12]}
            for e in entries
        ]
        if fmt == "json":
            sink.write(json.dumps(rows, indent=2) + "\n")
        elif fmt == "table" and rows:
            # The label is shown whole (folded onto more lines where it is long); a model given by its path
            # shows its file name here, the whole path in the text and JSON formats.
            table = Table(Column("label", overflow="fold"), Column("model", overflow="ellipsis", max_width=32),
                          "tokens", "MiB", "last used", "key")
            for r in rows:
                table.add_row(r["label"], Path(r["model"]).name or r["model"], f"{r['tokens']:,}", f"{r['mib']:.1f}",
                              r["last_used"], r["key"])
            sink.render(table)
        else:
            sink.write("".join(f"{r['label']}\t{r['model']}\t{r['tokens']}\t{r['mib']:.1f} MiB\t{r['last_used']}\t{r['key']}\n"
                               for r in rows))
        sink.commit()
        session.say(f"{len(entries)} saved document(s), {sum(e.bytes for e in entries) / MIB:.1f} MiB")


@app.command("rm")
@shared_options(RUN)
def rm(document: Annotated[str, typer.Argument(help="A label as `cache ls` shows it (e.g. the file's path), or the "
                                                     f"first {MIN_KEY_PREFIX}+ characters of its key.")],
       *, opts: Options) -> None:
    """Remove one saved document, by its label or the start of its key (8 characters or more).

    Examples:

    ```
    kvpage cache rm samples/contract.pdf
    kvpage cache rm 3f9a02c1
    ```
    """
    with Session(opts) as session:
        try:
            removed = _open(opts).remove(document_label(document) if Path(document).exists() else document,
                                         on_event=session.reporter)
        except OSError as exc:
            raise _busy(exc) from None
        if not removed:
            raise KvpageError(f"no saved document matches {document!r} (see 'kvpage cache ls')")
        session.say(f"removed {len(removed)} saved document(s), {sum(e.bytes for e in removed) / MIB:.1f} MiB")


@app.command("clear")
@shared_options(RUN)
def clear(*, opts: Options) -> None:
    """Remove every saved document.

    Example: `kvpage cache clear`
    """
    with Session(opts) as session:
        try:
            removed = _open(opts).clear(on_event=session.reporter)
        except OSError as exc:
            raise _busy(exc) from None
        session.say(f"removed {len(removed)} saved document(s), {sum(e.bytes for e in removed) / MIB:.1f} MiB")
