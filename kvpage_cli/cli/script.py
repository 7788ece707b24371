"""The console script `kvpage`: the app imported with the garbage collector paused, and what the
imports made frozen.

Importing torch and the app makes a few hundred thousand objects that live as long as the
process. Left in the collector's generations, each full collection walks them all again, during
the imports and all through the command. Frozen (`gc.freeze`), they stay out of every collection;
objects made afterwards are collected as usual.

First of all, a command is handed to a server started by `kvpage serve` where one of the same
code answers (server.py): then none of this process's imports happen.
"""

from __future__ import annotations

import gc
import sys


def main() -> None:
    from .server import forward  # the standard library only: a server started by `kvpage serve` runs it

    code = forward(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    gc.disable()
    try:
        from .app import main as run
    finally:
        gc.freeze()
        gc.enable()
    run()
