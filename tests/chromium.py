"""Headless Chromium driven over its DevTools pipe (no extra package): load a page, collect its
console messages and network requests, evaluate JavaScript in it, take a screenshot.

Chromium reads DevTools commands from fd 3 and writes replies and events to fd 4, each a JSON
object ended by a NUL byte (--remote-debugging-pipe)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars",
         "--mute-audio", "--host-resolver-rules=MAP * ~NOTFOUND"]


def chromium_binary() -> str:
    """The system Chromium; a test that needs it fails (never skips) where it is missing."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("chromium is not installed: .ci/run installs it (apt-get install chromium)")


class Browser:
    """One headless Chromium with one page."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        self.profile = tempfile.mkdtemp(prefix="kvpage-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # the child's fd 3 reads our commands, its fd 4 writes to us
            read, write = os.dup(to_child_r), os.dup(from_child_w)  # above 4: neither is overwritten
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.process = subprocess.Popen(
            [chromium_binary(), *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=True)
        self.send("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def send(self, method: str, session: bool = False, timeout: float = 60.0, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, path: Path) -> None:
        """Loads the file and waits for its load event."""
        self.send("Page.navigate", session=True, url=path.resolve().as_uri())
        deadline = time.monotonic() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read(deadline))

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors (a CSP violation is one)."""
        errors = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                errors.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
                errors.append(params["entry"].get("text", ""))
        return errors

    def requests(self) -> list[str]:
        """Every URL the page asked for."""
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        params = {"format": "png"}
        if full_page:
            height = self.evaluate("document.documentElement.scrollHeight")
            width = self.evaluate("document.documentElement.clientWidth")
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.send("Page.captureScreenshot", session=True, **params)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
