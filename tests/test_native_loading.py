"""Loading the compiled CPU kernels: only a library this user built, from a folder no one else can
write to; anything else (or a library that does not load) is one warning and the torch backend."""

from __future__ import annotations

import os
import shutil

import pytest

from kvpage_cli.engine import Engine, EngineConfig, EngineWarning
from kvpage_cli.engine import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None
                                and shutil.which("clang") is None, reason="needs a C compiler")

PLANTED = b"\x7fELF a library someone else put here"


@pytest.fixture(autouse=True)
def no_loaded_library(monkeypatch, native_library):
    """Each test loads the library afresh (a loaded one is kept for the process); a build copies
    the one this session compiled (the same sources and flags) and counts itself."""
    builds = []

    def copy_built(compiler, texts, out):
        assert texts == native.sources()
        builds.append(out)
        shutil.copyfile(native_library, out)

    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_compile", copy_built)
    return builds


def load_engine(model, home):
    warnings = []
    engine = Engine.load(model, EngineConfig(home=str(home)),
                         on_event=lambda e: warnings.append(e.message) if isinstance(e, EngineWarning) else None)
    return engine, warnings


def plant(home, folder_mode: int = 0o700):
    """A file where the library is kept, with the hash of itself beside it (whoever can write the
    one can write the other)."""
    target = native.library_path(home)
    target.parent.mkdir(parents=True, mode=0o700)
    os.chmod(target.parent, folder_mode)
    target.write_bytes(PLANTED)
    target.with_name(target.name + ".sha256").write_text(native._sha256(target) + "\n")
    return target


def test_a_new_home_and_its_native_folder_are_private(tiny_models, tmp_path, no_loaded_library):
    home = tmp_path / "new" / "home"
    engine, warnings = load_engine(tiny_models["llama"], home)
    assert engine.backend.name == "native" and warnings == [] and len(no_loaded_library) == 1
    for folder in (home, home / "native"):
        assert folder.stat().st_mode & 0o777 == 0o700
    target = native.library_path(home)
    assert target.with_name(target.name + ".sha256").read_text().strip() == native._sha256(target)


def test_a_library_in_a_group_writable_folder_is_refused(tiny_models, tmp_path):
    target = plant(tmp_path, folder_mode=0o770)
    engine, warnings = load_engine(tiny_models["llama"], tmp_path)
    assert engine.backend.name == "torch"
    assert len(warnings) == 1 and "native" in warnings[0] and "writable by other users" in warnings[0]
    assert target.read_bytes() == PLANTED  # neither loaded nor replaced


def test_a_library_owned_by_another_user_is_refused(tiny_models, tmp_path, monkeypatch):
    target = plant(tmp_path)
    if os.geteuid() == 0:
        os.chown(target, 12345, 12345)  # root can give it away for real
    else:
        monkeypatch.setattr(native.os, "getuid", lambda: os.geteuid() + 1)
    engine, warnings = load_engine(tiny_models["llama"], tmp_path)
    assert engine.backend.name == "torch"
    assert len(warnings) == 1 and "belongs to another user" in warnings[0]
    assert target.read_bytes() == PLANTED


def test_a_library_that_fails_to_load_falls_back_to_torch(tiny_models, tmp_path, monkeypatch):
    def cannot_load(path, *args, **kwargs):
        raise OSError(f"{path}: failed to map segment from shared object")  # a noexec home

    monkeypatch.setattr(native.ctypes, "CDLL", cannot_load)
    engine, warnings = load_engine(tiny_models["llama"], tmp_path)
    assert engine.backend.name == "torch"
    assert len(warnings) == 1 and "could not be loaded" in warnings[0] and "torch" in warnings[0]


def test_a_library_that_is_not_the_one_built_here_is_rebuilt(tiny_models, tmp_path, no_loaded_library, native_library):
    load_engine(tiny_models["llama"], tmp_path)
    native._LIB = None
    load_engine(tiny_models["llama"], tmp_path)
    assert len(no_loaded_library) == 1  # built once, then loaded as it is
    target = native.library_path(tmp_path)
    # same owner, private folder, but not what was built: its hash differs (a new file: the loaded
    # library's pages are mapped from the old one)
    (tmp_path / "other.so").write_bytes(PLANTED)
    os.replace(tmp_path / "other.so", target)
    native._LIB = None
    engine, warnings = load_engine(tiny_models["llama"], tmp_path)
    assert engine.backend.name == "native" and warnings == [] and len(no_loaded_library) == 2
    assert target.read_bytes() == native_library.read_bytes()
