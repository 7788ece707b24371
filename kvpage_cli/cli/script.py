"""The console script `kvpage`: the app imported with the garbage collector paused, and what the
imports made frozen.

Importing torch and the app makes a few hundred thousand objects that live as long as the
process. Left in the collector's generations, each full collection walks them all again, during
the imports and all through the command. Frozen (`gc.freeze`), they stay out of every collection;
objects made afterwards are collected as usual.
"""

from __future__ import annotations

import gc


def main() -> None:
    gc.disable()
    try:
        from .app import main as run
    finally:
        gc.freeze()
        gc.enable()
    run()
