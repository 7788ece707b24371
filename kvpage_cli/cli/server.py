"""`kvpage serve`: one process that keeps kvpage imported, so that later commands skip the imports.

Importing torch and kvpage is most of a short command's time (1.4-1.8 s of `kvpage find`'s 3-4 s
on a 2-core machine). `kvpage serve` imports them once and listens on a Unix socket in the kvpage
home (SOCKET_NAME in KVPAGE_HOME or ~/.cache/kvpage; the home is private, and the server also
checks each caller's user id). Every `kvpage` command first looks for that socket (`forward`,
which imports nothing but the standard library): where a server of the same code answers, the
command hands it its arguments, working folder, environment, umask and its stdin, stdout and
stderr themselves (the file descriptors, passed over the socket), and the server forks a child
that runs the command on them as its own process would, then sends back the child's exit status,
which the command exits with. Ctrl-C and other signals the command gets are passed on to the
child; a command killed outright has its child ended (SIGTERM).

Nothing else is shared. Each command is a child forked from a parent that has imported kvpage and
run nothing: no model loaded, no OpenMP parallel region (libgomp's thread pool does not survive
a fork: a child of a parent that ran one hangs in its first one), so a command loads its model,
reads the saved KV and writes its output as a fresh process does. A server whose code differs
from the command's (a changed checkout or install, another Python: `fingerprint`) refuses it,
and the command runs in its own process; so does every command where the socket is missing or
stale, or with KVPAGE_NO_SERVER set.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

SOCKET_NAME = "server.sock"
NO_SERVER_ENV = "KVPAGE_NO_SERVER"  # set (to anything): commands never use a server
_HEADER = struct.Struct("!I")
_PACKAGES = ("torch", "typer", "rich", "numpy")  # what the server imported beside kvpage: an upgrade is new code
_PASSED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # what a command passes on to its child
_REPLY_SECONDS = 60.0  # a server that took the descriptors but says nothing is broken, not busy


def socket_path(env: dict | None = None) -> Path:
    """The socket in the home the engine uses (KVPAGE_HOME, `~` expanded as engine/load.py does,
    else engine/home.py's default_home, said again here: importing kvpage_cli.engine imports torch)."""
    env = os.environ if env is None else env
    home = Path(env["KVPAGE_HOME"]).expanduser() if env.get("KVPAGE_HOME") else Path.home() / ".cache" / "kvpage"
    return home / SOCKET_NAME


def fingerprint() -> str:
    """What makes code the same: the interpreter, and the size and modification time of every
    Python file of kvpage and of the main packages it imports (an edit, a reinstall, an upgrade
    changes it). Stats about a hundred files: a millisecond."""
    digest = hashlib.sha256(f"{sys.executable}\0{sys.version}\0".encode())
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        stat = os.stat(origin) if origin else None
        digest.update(f"{name}\0{origin}\0{stat and stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def _send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> dict | None:
    """One message, or None where the other end closed first."""
    head = _exactly(sock, _HEADER.size)
    if head is None:
        return None
    body = _exactly(sock, _HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# -- the command's side: standard library only, before anything of kvpage is imported -------------

def forward(argv: list[str]) -> int | None:
    """Runs `kvpage ARGV` in a server's child where a server of this code answers: its exit code.
    None where there is no server to run it (run the command here)."""
    if os.environ.get(NO_SERVER_ENV) or (argv and argv[0] == "serve") or "RANK" in os.environ:
        return None
    path = socket_path()
    if not path.exists():
        return None
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:  # a closed stdin, stdout or stderr cannot be passed on
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:  # a server that ended without removing its socket
        sock.close()
        return None
    with sock:
        umask = os.umask(0)
        os.umask(umask)
        streams = [[getattr(s, "encoding", None), getattr(s, "errors", None)]
                   for s in (sys.stdin, sys.stdout, sys.stderr)]
        request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask,
                   "streams": streams, "fingerprint": fingerprint()}
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        # a Ctrl-C before the child's pid is known waits, then goes to the child (or, refused, to this process)
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, _PASSED)
        try:
            socket.send_fds(sock, [b"k"], [0, 1, 2])
            _send(sock, request)
            sock.settimeout(_REPLY_SECONDS)
            reply = _receive(sock)
        except (OSError, ValueError):
            reply = None
        if reply is None or "refused" in reply:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
            if reply is None:
                print(f"kvpage: error: the server at {path} took the command but did not answer; "
                      f"stop it (kvpage serve --stop) or set {NO_SERVER_ENV}=1", file=sys.stderr)
                return 1
            return None  # other code: run it here
        pid = reply["pid"]
        previous = {sig: signal.signal(sig, lambda sig, _frame: _pass_on(pid, sig)) for sig in _PASSED}
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        try:
            sock.settimeout(None)
            done = _receive(sock)  # a signal passed on meanwhile: recv resumes (PEP 475)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if done is None:
            print(f"kvpage: error: the server at {path} ended before the command did", file=sys.stderr)
            return 1
        return int(done["exit"])


def _pass_on(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- the server's side ---------------------------------------------------------------------------

class Server:
    """Accepts commands on the socket and runs each in a forked child (`serve`)."""

    def __init__(self, path: Path, log) -> None:
        self.path = path
        self.log = log  # one line per event, to the server's stderr
        self.code = fingerprint()
        self.children: dict[int, tuple[socket.socket, list[str], float]] = {}
        self.listener: socket.socket | None = None

    def serve(self) -> None:
        self.listener = _listen(self.path)
        self.inode = self.path.stat().st_ino
        self.log(f"pid {os.getpid()}, listening on {self.path}; Ctrl-C or `kvpage serve --stop` stops it")
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        signal.set_wakeup_fd(wake_write.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, "accept")
        selector.register(wake_read, selectors.EVENT_READ, "wake")
        self.selector = selector
        self.private = [self.listener, wake_read, wake_write]  # closed in every child
        self.stopping = False
        try:
            while not self.stopping:
                for key, _ in selector.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while wake_read.recv(512):
                                pass
                        except BlockingIOError:
                            pass
                    else:  # a command's socket: readable only when its caller is gone
                        self._caller_gone(key.data, key.fileobj)
                self._reap()
        finally:
            signal.set_wakeup_fd(-1)
            for pid in list(self.children):
                _pass_on(pid, signal.SIGTERM)
            self._remove_socket()
            self.listener.close()

    def _remove_socket(self) -> None:
        try:  # only the socket this server made (another may have replaced a stale one)
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()
        except FileNotFoundError:
            pass

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            self.log(f"refused a connection of user {uid}")
            conn.close()
            return
        conn.settimeout(10.0)
        try:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            request = _receive(conn)
        except (OSError, ValueError) as exc:
            self.log(f"a broken request ({exc})")
            conn.close()
            return
        if request is None:
            conn.close()
            return
        if request.get("stop"):
            _send(conn, {"stopping": os.getpid()})
            conn.close()
            self.log("stopped by `kvpage serve --stop`")
            self.stopping = True
            return
        if request.get("fingerprint") != self.code or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            _send(conn, {"refused": "other code"})
            conn.close()
            self.log("refused a command of other code (it runs in its own process)")
            return
        argv = request["argv"]
        # signals for the child wait until it stands on the command's descriptors (_child unblocks them)
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, _PASSED)
        pid = os.fork()
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        else:
            try:
                signal.set_wakeup_fd(-1)
                for fd in [*self.private, *(c for c, _, _ in self.children.values())]:
                    os.close(fd.fileno())
                os.close(self.selector.fileno())
            except BaseException:  # never back into the server's loop
                os._exit(1)
            _child(conn, fds, request, unblocked)  # never returns
        for fd in fds:
            os.close(fd)
        _send(conn, {"pid": pid})
        conn.setblocking(False)
        self.children[pid] = (conn, argv, time.perf_counter())
        self.selector.register(conn, selectors.EVENT_READ, pid)
        self.log(f"started `kvpage {_shown(argv)}` (pid {pid})")

    def _caller_gone(self, pid: int, conn: socket.socket) -> None:
        try:
            if conn.recv(1):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self.selector.unregister(conn)
        _pass_on(pid, signal.SIGTERM)
        self.log(f"the caller of pid {pid} is gone: sent it SIGTERM")

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            conn, argv, started = entry
            code = os.waitstatus_to_exitcode(status)
            how = f"killed by signal {-code}, " if code < 0 else ""
            code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
            try:
                self.selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.setblocking(True)
                _send(conn, {"exit": code})
            except OSError:
                pass
            conn.close()
            self.log(f"`kvpage {_shown(argv)}` {how}exited {code} after {time.perf_counter() - started:.2f} s")


def _shown(argv: list[str]) -> str:
    text = " ".join(argv)
    return text if len(text) <= 120 else text[:117] + "..."


def _listen(path: Path) -> socket.socket:
    from .. import errors
    from ..engine.home import private_dir

    private_dir(path.parent)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: its server is gone
        else:
            raise errors.KvpageError(f"a server already answers at {path} (`kvpage serve --stop` stops it)")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket itself 0600
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(16)
    return listener


def _child(conn: socket.socket, fds: list[int], request: dict, unblocked: set) -> None:
    """In the forked child: become the command's process and run it; exits, never returns."""
    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin, sys.stdout, sys.stderr = opened = [
            open(fd, mode, buffering=1 if mode == "w" and os.isatty(fd) else -1, encoding=enc or None,
                 errors=err or None, closefd=False)
            for fd, mode, (enc, err) in zip((0, 1, 2), ("r", "w", "w"), request["streams"])]
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = opened
        sys.argv = ["kvpage", *request["argv"]]
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)  # a Ctrl-C already sent arrives now
        from .app import main

        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except KeyboardInterrupt:  # escaped the command's own handling (it came while the arguments were read)
            print("kvpage: interrupted: stopped before the end", file=sys.stderr)
            code = 130
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command has ended: a late Ctrl-C changes nothing
        import atexit

        atexit._run_exitfuncs()  # what a process's exit runs
    except KeyboardInterrupt:  # Ctrl-C before the command began
        os.write(2, b"kvpage: interrupted: stopped before the command began\n")
        code = 130
    except BaseException:  # before the command ran: said on the command's stderr
        import traceback

        os.write(2, f"kvpage: error: the server could not run the command: {traceback.format_exc()}".encode())
    finally:
        # what a process's exit flushes: the streams in sys (a progress display may have left its own
        # proxies there, which write into the real ones), then the real ones
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def stop(path: Path) -> int | None:
    """Asks the server at `path` to stop: its pid, or None where none answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    with sock:
        sock.settimeout(10.0)
        socket.send_fds(sock, [b"k"], [])
        _send(sock, {"stop": True})
        reply = _receive(sock)
    return None if reply is None else reply.get("stopping")

