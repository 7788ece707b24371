"""`kvpage serve`: a command handed to a server runs as its own process would (cli/server.py).

Each test starts a real server (`kvpage serve` in a process of its own, over a home of the test's)
and runs the console script as a shell does; the same command with KVPAGE_NO_SERVER=1 runs in its
own process, for comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from kvpage_cli.cli import server as server_module
from kvpage_cli.cli.server import NO_SERVER_ENV, SOCKET_NAME

from .conftest import with_native_library
from .test_cli import kvpage_process

OWN = {NO_SERVER_ENV: "1"}


def fact_document(path: Path) -> Path:
    filler = "The committee met on a Tuesday and read the minutes of the previous meeting aloud. " * 6
    paragraphs = [f"Section {n}. {filler}" for n in range(12)]
    paragraphs[7] = "Section 7. The vault's combination is 4417-9023, kept by the harbour master. " + filler
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def start_server(home: Path, log: Path) -> subprocess.Popen:
    before = log.read_text().count("listening on") if log.exists() else 0
    with open(log, "a") as sink:
        process = kvpage_process(["serve"], home, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + 180
    while log.read_text().count("listening on") == before:  # the imports come first
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return process


def wait_for(log: Path, text: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path, native_library):
    home = with_native_library(tmp_path / "home", native_library)
    log = tmp_path / "serve.log"
    process = start_server(home, log)
    yield home, log, process
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def run(args: list[str], home: Path, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    process = kvpage_process(args, home, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or {})
    stdout, stderr = process.communicate(stdin, timeout=600)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def test_a_served_command_prints_what_its_own_process_prints(served, tiny_cli_model, tmp_path):
    home, log, _ = served
    doc = fact_document(tmp_path / "minutes.txt")
    find = ["find", str(doc), "What is the vault's combination?", "--model", str(tiny_cli_model), "--json", "-n", "3"]
    first = run(find, home, OWN)  # indexes the document; the two runs below read the saved index
    assert first.returncode == 0, first.stderr
    assert "started `kvpage find" not in log.read_text()  # KVPAGE_NO_SERVER: its own process
    own, by_server = run(find, home, OWN), run(find, home)
    assert by_server.returncode == own.returncode == 0, by_server.stderr
    assert json.loads(by_server.stdout) == json.loads(own.stdout)
    assert json.loads(own.stdout)["prefill_tokens"] < json.loads(first.stdout)["prefill_tokens"]
    assert log.read_text().count("started `kvpage find") == 1
    wait_for(log, "exited 0")

    # stdin, handed over as it is
    text = doc.read_text()
    ask_stdin = ["find", "-", "Who keeps the combination?", "--model", str(tiny_cli_model), "-n", "2"]
    own, by_server = run(ask_stdin, home, OWN, stdin=text), run(ask_stdin, home, stdin=text)
    assert by_server.returncode == own.returncode == 0, by_server.stderr
    assert by_server.stdout == own.stdout and "-:" in own.stdout
    assert log.read_text().count("started `kvpage find - ") == 1

    # an error: the same line on stderr and the same exit code
    missing = ["find", str(tmp_path / "absent.txt"), "anything", "--model", str(tiny_cli_model)]
    own, by_server = run(missing, home, OWN), run(missing, home)
    assert by_server.returncode == own.returncode == 1
    assert by_server.stderr == own.stderr and "does not exist" in own.stderr and by_server.stdout == ""
    wait_for(log, "exited 1")


def test_ctrl_c_reaches_the_served_command_and_a_killed_caller_ends_it(served, tiny_cli_model):
    home, log, _ = served
    args = ["ask", "-", "What is the combination?", "--model", str(tiny_cli_model)]
    waiting = kvpage_process(args, home, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # reads stdin until it closes: it waits there
    wait_for(log, "started `kvpage ask")
    waiting.send_signal(signal.SIGINT)  # while the child starts, or reads stdin (left open)
    waiting.wait(timeout=120)
    stderr = waiting.stderr.read()
    waiting.stdin.close()
    assert waiting.returncode == 130 and "kvpage: interrupted:" in stderr, stderr
    wait_for(log, "exited 130")

    killed = kvpage_process(args, home, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while log.read_text().count("started `kvpage ask") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed.kill()
    killed.wait(timeout=60)
    wait_for(log, "exited 143")  # the server ended the caller's child (SIGTERM)


def test_a_command_of_other_code_runs_in_its_own_process(served, monkeypatch):
    home, log, _ = served
    monkeypatch.setenv("KVPAGE_HOME", str(home))
    monkeypatch.setattr(server_module, "fingerprint", lambda: "an edited checkout")
    assert server_module.forward(["--version"]) is None  # the caller runs it itself
    wait_for(log, "refused a command of other code")
    monkeypatch.setenv(NO_SERVER_ENV, "1")
    assert server_module.forward(["--version"]) is None
    assert log.read_text().count("refused") == 1  # never asked


def test_one_server_a_home_stop_stops_it_and_a_stale_socket_is_replaced(served, tmp_path):
    home, log, process = served
    second = run(["serve"], home)
    assert second.returncode == 1 and "a server already answers at" in second.stderr
    stopped = run(["serve", "--stop"], home)
    assert stopped.returncode == 0 and f"pid {process.pid}" in stopped.stderr
    assert process.wait(timeout=60) == 0 and not (home / SOCKET_NAME).exists()
    again = run(["serve", "--stop"], home)
    assert again.returncode == 1 and "no server answers" in again.stderr

    process = start_server(home, log)
    os.kill(process.pid, signal.SIGKILL)  # gone without removing its socket
    process.wait(timeout=60)
    assert (home / SOCKET_NAME).exists()
    version = run(["--version"], home)  # nobody answers: the command runs in its own process
    assert version.returncode == 0 and version.stdout.startswith("kvpage ")
    process = start_server(home, log)  # takes the stale socket's place
    assert run(["serve", "--stop"], home).returncode == 0
    assert process.wait(timeout=60) == 0


def test_the_socket_lies_in_the_home_the_engine_uses():
    """KVPAGE_HOME with a `~` is the home the engine expands it to (engine/load.py), not a folder
    named "~" under wherever the command ran; unset, the engine's default home."""
    from kvpage_cli.engine.home import default_home

    assert server_module.socket_path({"KVPAGE_HOME": "~/kv-test"}) == Path.home() / "kv-test" / SOCKET_NAME
    assert server_module.socket_path({}) == default_home() / SOCKET_NAME
