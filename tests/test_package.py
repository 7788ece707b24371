"""The distribution: what the wheel holds, and which packages may import the CLI libraries."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest

from .conftest import REPO

UI_LIBRARIES = {"typer", "rich", "tqdm", "click"}
UI_FREE = ["kvpage_cli/engine", "kvpage_cli/tasks", "kvpage_cli/ingest", "kvpage_kernels"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Builds the wheel from a copy of the sources (the working tree gets no build/ or egg-info)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for license_file in REPO.glob("LICEN[CS]E*"):
        shutil.copy(license_file, src / license_file.name)
    for folder in ("kvpage_cli", "kvpage_kernels", "prompts"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    if _setuptools_version() >= (69,):
        # the installed setuptools can build it: no isolated environment, no package index
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)]
    elif importlib.util.find_spec("build") is not None:
        command = [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)]
    else:
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    [built] = dist.glob("kvpage-*.whl")
    return zipfile.ZipFile(built)


def _setuptools_version() -> tuple[int, ...]:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def test_wheel_ships_prompts_kernels_and_native_sources(wheel):
    wheel = set(wheel.namelist())
    prompts = {name for name in wheel if name.startswith("kvpage_cli/prompts/") and name.endswith(".md")}
    shipped = {p.relative_to(REPO).as_posix().replace("prompts/", "kvpage_cli/prompts/", 1)
               for p in (REPO / "prompts").glob("*.md")}
    assert shipped and shipped <= prompts
    assert "kvpage_kernels/__init__.py" in wheel
    assert {f"kvpage_kernels/{p.name}" for p in (REPO / "kvpage_kernels").glob("*.py")} <= wheel
    assert "kvpage_cli/engine/native/attention.c" in wheel
    assert "kvpage_cli/prompts/playbook.toml" in wheel  # the review's default playbook
    assert "kvpage_cli/tasks/heads/clauses-lexical.npz" in wheel  # its trained clause head
    assert "kvpage_cli/cli/app.py" in wheel
    assert not any(name.startswith("kernels/") for name in wheel)  # would shadow the `kernels` package
    assert not any(name.startswith(("tests/", "samples/", "corpus/")) for name in wheel)


def test_nothing_at_the_checkouts_root_shadows_an_installed_package():
    """Tests, benchmarks and `python -m` run from the repository root, which is then first on
    sys.path: a folder there named like an installed package (transformers imports Hugging Face's
    `kernels` when it is installed) would be imported in its place."""
    installed = {name for name, dists in importlib.metadata.packages_distributions().items()
                 if "kvpage" not in dists}
    assert "torch" in installed  # the map is read, not empty
    here = {p.stem if p.suffix == ".py" else p.name for p in REPO.iterdir()
            if (p.is_dir() and not p.name.startswith(".")) or p.suffix == ".py"}
    assert here & installed == set()


def test_wheel_declares_the_console_script(wheel):
    [entry_points] = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    assert "kvpage = kvpage_cli.cli.script:main" in wheel.read(entry_points).decode()


def test_the_console_script_runs_a_command_with_the_collector_back_on():
    """The script pauses the garbage collector for the imports only: the command runs (here its
    help) and, when it starts, collection is on again with the imports' objects frozen."""
    probe = ("import gc, sys; import kvpage_cli.cli.app as app; "
             "app.main = lambda: print('collector', gc.isenabled(), gc.get_freeze_count() > 10000) or app.app(); "
             "from kvpage_cli.cli.script import main; main()")
    done = subprocess.run([sys.executable, "-c", probe, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "collector True True" in done.stdout
    assert "review" in done.stdout and "ask" in done.stdout


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", UI_FREE)
def test_engine_tasks_ingest_and_kernels_never_import_ui_libraries(package):
    """Every import statement, including those inside functions."""
    offenders = {str(path.relative_to(REPO)): sorted(_imports(path) & UI_LIBRARIES)
                 for path in (REPO / package).rglob("*.py")}
    assert {path: libs for path, libs in offenders.items() if libs} == {}


def test_only_the_cli_imports_typer_and_rich():
    outside = [path for path in (REPO / "kvpage_cli").rglob("*.py")
               if "cli" not in path.relative_to(REPO / "kvpage_cli").parts[:1]]
    assert outside
    assert {str(p.relative_to(REPO)) for p in outside if _imports(p) & {"typer", "rich", "click"}} == set()


def test_importing_the_library_loads_no_ui_library():
    """In a fresh interpreter: what importing the engine, tasks, ingest and kernels adds to
    sys.modules, beyond what their own dependencies (torch, transformers...) bring."""
    code = """
import sys
import numpy, torch
try:
    import triton
except ImportError:
    pass
before = set(sys.modules)
import kvpage_cli.engine, kvpage_cli.tasks, kvpage_cli.ingest, kvpage_kernels
added = {name.split(".")[0] for name in set(sys.modules) - before}
print(sorted(added & {"typer", "rich", "tqdm", "click"}))
print(sorted({name.split(".")[0] for name in sys.modules} & {"typer", "rich"}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    added, present = result.stdout.split("\n")[:2]
    assert added == "[]"
    assert present == "[]"


def test_the_distribution_declares_what_the_code_imports_and_nothing_else():
    """Every third-party import of the package is a declared dependency (or an extra's), and every
    declared dependency is imported. The model packages are the user's to install (see ALIASES)."""
    import re
    import tomllib

    from kvpage_cli.engine.model.weights import ALIASES

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = {name: reqs for name, reqs in project["optional-dependencies"].items() if name != "test"}
    declared = {normal(re.match(r"[A-Za-z0-9_.-]+", req).group()) for req in project["dependencies"]}
    optional = {normal(re.match(r"[A-Za-z0-9_.-]+", req).group()) for reqs in extras.values() for req in reqs}
    imported = set()
    for folder in ("kvpage_cli", "kvpage_kernels"):
        for path in (REPO / folder).rglob("*.py"):
            imported |= _imports(path)
    imported -= set(sys.stdlib_module_names) | {"kvpage_cli", "kvpage_kernels"}
    distributions = importlib.metadata.packages_distributions()
    models = {normal(alias.package) for alias in ALIASES.values()}
    missing = {}
    used = set()
    for module in sorted(imported):
        names = {normal(d) for d in distributions.get(module, [module])}
        used |= names
        if not names & (declared | optional | models):
            missing[module] = sorted(names)
    assert missing == {}
    assert declared - used == set()
