"""The engine's packages import only downward: base, then native/, model/, kv/, attention/, then
the engine itself (engine, load, scheduler, device_step, device_select, index). A module that
reaches up a layer fails here."""

from __future__ import annotations

import ast

from .conftest import REPO

ENGINE = REPO / "kvpage_cli" / "engine"
# Each layer may import its own layer and those below it; kvpage_cli.errors is below them all.
LAYERS = ["base", "native", "model", "kv", "attention", "top"]
BASE = {"config", "events", "metrics", "home", "sampler", "hostreads"}
TOP = {"engine", "load", "scheduler", "device_step", "device_select", "index", "__init__"}


def layer_of(parts: tuple[str, ...]) -> str:
    """The layer of the engine module at `parts` (its path under engine/, without .py)."""
    head = parts[0]
    if head in LAYERS:
        return head
    if head in BASE:
        return "base"
    if head in TOP:
        return "top"
    raise AssertionError(f"engine/{'/'.join(parts)}.py is in no layer: add it to LAYERS, BASE or TOP")


def engine_imports(path) -> list[tuple[str, tuple[str, ...]]]:
    """(statement, engine module parts) of every import of an engine module in `path`, the
    relative ones resolved; functions' own imports included."""
    module = path.relative_to(ENGINE).with_suffix("").parts
    package = module[:-1]  # an __init__ module's package is its own folder: module[:-1] as well
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                if node.level - 1 > len(package):
                    continue  # above the engine (kvpage_cli.errors)
                target = base + tuple(node.module.split(".")) if node.module else base
            elif node.module and node.module.startswith("kvpage_cli.engine."):
                target = tuple(node.module.split(".")[2:])
            else:
                continue
            # `from . import native`: the names may be modules themselves
            targets = [target] if target else [(alias.name,) for alias in node.names]
            found += [(ast.unparse(node), t) for t in targets]
        elif isinstance(node, ast.Import):
            found += [(ast.unparse(node), tuple(a.name.split(".")[2:])) for a in node.names
                      if a.name.startswith("kvpage_cli.engine.")]
    return found


def test_every_engine_module_imports_only_its_layer_and_those_below():
    offenders = []
    modules = sorted(ENGINE.rglob("*.py"))
    assert len(modules) > 30
    for path in modules:
        own = LAYERS.index(layer_of(path.relative_to(ENGINE).with_suffix("").parts))
        for statement, target in engine_imports(path):
            if LAYERS.index(layer_of(target)) > own:
                offenders.append(f"{path.relative_to(REPO)}: {statement}")
    assert offenders == []


def test_the_check_finds_an_import_from_above(tmp_path, monkeypatch):
    """The test above can fail: a kv/ module importing attention/ is caught."""
    fake = tmp_path / "engine"
    (fake / "kv").mkdir(parents=True)
    (fake / "kv" / "store.py").write_text("from ..attention.policy import key_bound\nfrom ..config import X\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ENGINE"]), "ENGINE", fake)
    imports = engine_imports(fake / "kv" / "store.py")
    layers = [layer_of(target) for _, target in imports]
    assert layers == ["attention", "base"]
    assert LAYERS.index("attention") > LAYERS.index(layer_of(("kv", "store")))
