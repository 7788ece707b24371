"""The command lines of bench/retrieval.py that its docstring and the README give still parse, each
to its part and with the options it names (the parts are modules of bench/retrieval_parts/ now).
Nothing runs: only the parser is built."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import retrieval  # noqa: E402

DOCUMENTED = [line.strip() for line in retrieval.__doc__.splitlines() if line.strip().startswith("python bench/retrieval.py")]
README_COMMANDS = [  # as the README gives them (a FILE or folder stands for the user's own)
    "python bench/retrieval.py questions --model smollm2 --systems retrieval,bm25 --saved-kv-mib 40000",
    "python bench/retrieval.py questions --model gemma3-270m --systems retrieval,bm25,exact --sources "
    "tomli,itsdangerous,httpx,cuad-10,cuad-11,cuad-12,cuad-att,cuad-goosehead --saved-kv-mib 20000",
    "python bench/retrieval.py questions --model gemma3-270m --systems retrieval,bm25,exact --sources "
    "werkzeug,packaging,urllib3,gnuplot-manual --saved-kv-mib 20000 --log FILE",
    "python bench/retrieval.py passkey --model gemma3-270m --systems exact --lengths 32768 --depths "
    "10,20,30,40,50,60,70,80,90 --seed 1",
    "python bench/retrieval.py passkey --model smollm2 --systems retrieval,bm25 --lengths 131072 --depths "
    "10,20,30,40,50,60,70,80,90 --saved-kv-mib 20000 --order document",
    "python bench/retrieval.py passkey --model smollm2 --systems retrieval --lengths 8192,524288 --threads 1 "
    "--saved-kv-mib 40000",
    "python bench/retrieval.py passkey --lengths 8192 --systems exact --kv-dtype bfloat16",
    "python bench/retrieval.py passkey --model gemma3-270m --systems retrieval,bm25 --lengths 131072 "
    "--saved-kv-mib 30000 --home H",
    "python bench/retrieval.py windows",
]


@pytest.mark.parametrize("line", DOCUMENTED + README_COMMANDS)
def test_a_documented_retrieval_command_line_parses_to_its_part(line):
    words = shlex.split(line)[2:]
    args = retrieval.build_parser().parse_args(words)
    assert args.part == words[0]
    for option, value in zip(words[1::2], words[2::2]):  # every option the line gives is read as given
        if option.startswith("--") and not value.startswith("--"):
            parsed = getattr(args, option[2:].replace("-", "_"))
            assert parsed == value or str(parsed) == value or parsed == value.split(",") or parsed == float(value)


def test_a_part_refuses_an_option_or_system_it_does_not_have(capsys):
    with pytest.raises(SystemExit):
        retrieval.build_parser().parse_args(["questions", "--systems", "retrieval,nonsense"])
    assert "unknown systems: nonsense" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # windows runs no system over questions
        retrieval.build_parser().parse_args(["windows", "--systems", "bm25"])


def test_a_worker_killed_by_a_signal_is_named_in_the_row(tmp_path):
    """A benchmark's peer that dies on an illegal instruction (llama.cpp's AMX path on an Intel Xeon
    with AMX: SIGILL) is reported as such, not as "failed"."""
    from common import run_worker

    script = tmp_path / "worker.py"
    script.write_text("import os, signal, sys\nif '--worker' in sys.argv:\n    os.kill(os.getpid(), signal.SIGILL)\n")
    assert run_worker(script, []) == {"error": "killed by SIGILL"}
    script.write_text("import sys\nsys.exit(3)\n")
    assert run_worker(script, []) == {"error": "failed (exit 3)"}


def test_a_peer_installed_without_what_it_imports_is_named_not_left_out(tmp_path, monkeypatch):
    """llama-cpp-python installed with --no-deps imports diskcache, which is missing: its rows say
    so. A peer that is not installed at all is "not installed" (its rows are left out)."""
    from common import import_error, run_worker

    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import diskcache_that_is_not_here\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    row = run_worker(REPO / "bench" / "quant_models.py", ["llama.cpp", str(tmp_path / "none.gguf"), "--folder",
                                                         str(tmp_path)])
    assert row["system"] == "llama.cpp"
    assert "diskcache_that_is_not_here" in row["error"] and "not installed" not in row["error"]
    assert import_error("llama_cpp", ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")) == \
        "not installed"
