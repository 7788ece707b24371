"""`kvpage serve`: keep kvpage imported in one process so that later commands start at once (server.py)."""

from __future__ import annotations

import os
import sys

import typer

from ..errors import KvpageError
from .progress import message
from .server import NO_SERVER_ENV, Server, socket_path, stop
from .session import stderr_console


def serve(
    stop_server: bool = typer.Option(False, "--stop", help="Stop the server that answers for this KVPAGE_HOME."),
) -> None:
    """Keep kvpage imported in one process, so that later `kvpage` commands skip the imports.

    A short command spends most of its time importing torch and kvpage (1.4-1.8 s of a 3-4 s
    `kvpage find` on a 2-core machine). `kvpage serve` imports them once and waits on a Unix
    socket in KVPAGE_HOME (or ~/.cache/kvpage). Every `kvpage` command of the same user and home
    then hands itself to the server: its arguments, folder, environment, stdin, stdout and stderr;
    the server forks a child that runs it exactly as its own process would (the model loaded, the
    saved KV read, the output written by that child) and the command exits with the child's exit
    code. Ctrl-C reaches the child. A command of other code (an edited or upgraded install)
    runs in its own process as before, as does every command with KVPAGE_NO_SERVER=1 set.

    The server runs until Ctrl-C or `kvpage serve --stop` (either also ends the commands it is
    still running), and writes a line to its stderr for each command it runs.

    Examples:

    ```
    kvpage serve &
    kvpage find ~/src/werkzeug "maximum size of a form upload"
    kvpage serve --stop
    ```
    """
    console = stderr_console()
    path = socket_path()
    if stop_server:
        pid = stop(path)
        if pid is None:
            message(console, "error", f"no server answers at {path}", "bold red")
            raise typer.Exit(1)
        message(console, "serve", f"stopped the server (pid {pid})", "bold")
        return
    if os.environ.get(NO_SERVER_ENV):
        message(console, "warning", f"{NO_SERVER_ENV} is set here: commands with it set do not use the server",
                "yellow")

    def log(text: str) -> None:
        message(console, "serve", text, "bold")

    try:
        Server(path, log).serve()
    except KvpageError as exc:
        message(console, "error", str(exc), "bold red")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        log("stopped (Ctrl-C)")
        sys.exit(130)
