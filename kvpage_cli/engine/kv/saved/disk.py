"""The saved-KV cache on disk: segment files, their index, the lock, eviction.

A segment file holds the K and V of its blocks in every layer (for sliding-window layers, the
blocks still in their window at the segment's end: what a prefill resumed there needs); it is
stored under its chain key (keys.py).

Layout under `<home>/kv/` (folders 0700, files 0600):

    index.sqlite                        one row per segment: key, parent, root, tokens, bytes, label, last use
    lock                                file lock: held while segments are renamed into place, rows
                                        change or segments are evicted
    segments/<key[:2]>/<key>.kvb        a segment: fixed header, JSON header, payload, crc32 of all before it
    segments/<key[:2]>/<key>-r<i>of<n>.kvb   with tensor parallelism over n ranks: rank i's share of a
                                        segment (its KV heads); one index row per file, one entry
    segments/<key[:2]>/.<key>.<pid>.<random>.tmp    a segment being written

Safety: a segment is written to a temporary file, fsynced and renamed into place, and its index
row is added after the rename; only indexed segments are read. On load the size, checksum, format
version, seed, key and shapes are checked; a bad file is deleted (with a warning) and its tokens
are recomputed. The total size is kept under the limit by evicting the least recently used
segments together with the segments that continue them (and the other ranks' shares of them).
Leftovers of processes that died are swept when the cache is opened and temporary files again at
every write. The lock is waited for at most LOCK_TIMEOUT_S (with a warning after LOCK_NOTICE_S): a
process stuck while holding it makes the others run without the cache, not hang. One prefill stops
saving after a failed write.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sqlite3
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from filelock import FileLock, Timeout

from ...config import DEFAULT_CACHE_MIB
from ...events import EngineWarning, EventCallback, emit
from ...home import default_home, fsync_dir, private_dir, writer_gone
from .keys import KV_FORMAT_VERSION

MIN_KEY_PREFIX = 8
"""Hex digits of a key that `KVCache.remove` (and `kvpage cache rm`) needs to name an entry."""

LOCK_NOTICE_S = 2.0
"""Waiting longer than this for the cache's lock is reported (an EngineWarning)."""

LOCK_TIMEOUT_S = 30.0
"""After this long without the lock, the cache is given up for the operation (CacheBusy)."""

_MAGIC = b"KVPAGE\x00S"
_FIXED = struct.Struct("<8sIIQ")  # magic, format version, header bytes, payload bytes
_TRAILER = struct.Struct("<I")  # crc32 of everything before it
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    key TEXT PRIMARY KEY, parent TEXT NOT NULL, root TEXT NOT NULL, seed TEXT NOT NULL, model TEXT NOT NULL,
    start INTEGER NOT NULL, "end" INTEGER NOT NULL, bytes INTEGER NOT NULL, label TEXT NOT NULL,
    created REAL NOT NULL, last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS segments_parent ON segments(parent);
"""

_SHARES = "key = ? OR (key >= ? AND key < ?)"
"""The index rows of a segment: its chain key (one process) or its ranks' shares `<key>-<part>`
(tensor parallel), as a range of the primary key ("-" sorts just before "."); see `_shares`."""


def _shares(key: str) -> tuple[str, str, str]:
    return key, key + "-", key + "."


class BadSegment(Exception):
    """A segment file that must not be used; the message says why."""


class CacheBusy(OSError):
    """Another process held the cache's lock for LOCK_TIMEOUT_S (stuck, or stopped with Ctrl-Z)."""


@dataclass(frozen=True)
class CacheEntry:
    """One document in the cache, as `kvpage cache ls` shows it.

    key: names the entry for `KVCache.remove` (the chain key of its first segment; a prefix of 8+
    hex digits is enough). label: what the caller named the document when it was saved (e.g. its
    path; "" when unnamed). model: the model's name. tokens: the longest saved prefix. bytes: on
    disk. last_used: seconds since the epoch."""

    key: str
    label: str
    model: str
    tokens: int
    bytes: int
    segments: int
    last_used: float


@dataclass
class Segment:
    """A segment read back and checked: its header and, per store group, K/V
    [layers, 2, blocks, Hkv, 64, D] of the logical blocks listed in `header["groups"][g]["blocks"]`."""

    header: dict
    groups: list[torch.Tensor]


@dataclass
class MappedBlocks:
    """A saved window of a library (retrieval mode), memory-mapped: block j's K/V for every layer
    of the full-attention groups, [layers, 2, Hkv, 64, D] per group, read from disk only when
    used, and checked against its own checksum the first time it is."""

    header: dict
    payload: torch.Tensor  # uint8, the mapped payload
    dtype: torch.dtype
    checked: set[int | str]  # blocks (and "bounds") whose checksum passed

    @property
    def num_blocks(self) -> int:
        return len(self.header["block_crcs"])

    def bounds(self) -> torch.Tensor | None:
        """The blocks' key bounds saved with them (bfloat16 [blocks, layers, 2, Hkv, D]), or None
        when the window was saved without them. Raises BadSegment when their bytes are damaged."""
        shape = self.header.get("bounds_shape")
        if not shape:
            return None
        raw = self.payload[self.header["block_bytes"] * self.num_blocks:]
        if "bounds" not in self.checked:
            if zlib.crc32(raw.numpy()) != self.header["bounds_crc"]:
                raise BadSegment("corrupt (its key bounds fail their checksum)")
            self.checked.add("bounds")
        return raw.view(torch.bfloat16).view(*shape)

    def block(self, j: int) -> list[torch.Tensor]:
        """Per group, K/V [layers, 2, Hkv, 64, D] of block j. Raises BadSegment when its bytes are damaged."""
        size = self.header["block_bytes"]
        raw = self.payload[j * size:(j + 1) * size]
        if j not in self.checked:
            if zlib.crc32(raw.numpy()) != self.header["block_crcs"][j]:
                raise BadSegment(f"corrupt (block {j} fails its checksum)")
            self.checked.add(j)
        parts, offset = [], 0
        shape = tuple(self.header["block_shape"])
        element = torch.empty(0, dtype=self.dtype).element_size()
        for layers in self.header["group_layers"]:
            count = layers * 2 * math.prod(shape) * element
            parts.append(raw[offset:offset + count].view(self.dtype).view(layers, 2, *shape))
            offset += count
        return parts


class KVCache:
    """The saved-KV cache in one folder (normally `<home>/kv`), shared safely between processes.

    For the CLI:

        cache = KVCache.open(home)           # or engine.kv_cache
        for entry in cache.list_entries(): ...
        cache.remove("contract.pdf")         # by label, or by key prefix
        cache.clear()
        KVCache.open(home, cache_mib=512).trim()   # evict down to a new limit now

    The engine saves and restores through `CachedPrefill` (Engine.prefill does it when
    `EngineConfig.kv_cache` is on).
    """

    def __init__(self, folder: str | Path, limit_bytes: int = int(DEFAULT_CACHE_MIB * 2**20), part: str = "") -> None:
        """part: with tensor parallelism, this rank's share of every segment ("r0of2"): the chain keys
        are the same on every rank, each rank reads and writes its own files `<key>-<part>.kvb`, and
        the ranks' files of one document make one entry. "" for the whole KV of one process."""
        self.folder = Path(folder)
        self.limit_bytes = int(limit_bytes)
        self.part = part
        self.segments_dir = self.folder / "segments"
        self.index_path = self.folder / "index.sqlite"
        _make_private_dir(self.folder)
        _make_private_dir(self.segments_dir)
        self._thread_lock = threading.RLock()
        self._file_lock = FileLock(str(self.folder / "lock"), mode=0o600)
        self._writer: ThreadPoolExecutor | None = None
        try:
            try:
                self._create_index()  # sqlite's own locking makes this safe without the file lock
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError):  # read-only, locked, ...: not damage
                    raise
                with self._locked():
                    try:
                        self._create_index()  # another process may have replaced it meanwhile
                    except sqlite3.DatabaseError as again:
                        if isinstance(again, sqlite3.OperationalError):
                            raise
                        # A damaged index: start a new one (the segments it named are orphans, swept below).
                        self.index_path.unlink(missing_ok=True)
                        self._create_index()
        except sqlite3.Error as exc:
            raise OSError(f"cannot use {self.index_path}: {exc}") from exc
        self._sweep_if_free()

    def _create_index(self) -> None:
        if not self.index_path.exists():
            os.close(os.open(self.index_path, os.O_RDWR | os.O_CREAT, 0o600))  # sqlite keeps the mode for its journal
        with self._db() as db:
            db.executescript(_SCHEMA)

    @classmethod
    def open(cls, home: str | Path | None = None, cache_mib: float = DEFAULT_CACHE_MIB) -> "KVCache":
        """The cache of a kvpage home folder (None: ~/.cache/kvpage), limited to `cache_mib` MiB."""
        home = Path(home).expanduser() if home is not None else default_home()
        return cls(home / "kv", int(cache_mib * 2**20))

    # -- what the CLI uses -----------------------------------------------------------------------

    def list_entries(self) -> list[CacheEntry]:
        """Every document in the cache, most recently used first."""
        with self._db() as db:
            rows = db.execute('SELECT key, root, label, model, seed, start, "end", bytes, last_used FROM segments').fetchall()
        return [entry for entry, _ in self._group(rows)]

    def remove(self, what: str, on_event: EventCallback | None = None) -> list[CacheEntry]:
        """Removes the entries whose label is `what` or whose key starts with `what` (at least
        MIN_KEY_PREFIX hex digits); returns them. Raises CacheBusy if the lock stays taken."""
        with self._locked(on_event), self._db() as db:
            rows = db.execute('SELECT key, root, label, model, seed, start, "end", bytes, last_used FROM segments').fetchall()
            matched = [(entry, keys) for entry, keys in self._group(rows)
                       if entry.label == what or (len(what) >= MIN_KEY_PREFIX and entry.key.startswith(what.lower()))]
            for _, keys in matched:
                self._delete(db, keys)
        return [entry for entry, _ in matched]

    def clear(self, on_event: EventCallback | None = None) -> list[CacheEntry]:
        """Removes every entry; returns them. Raises CacheBusy if the lock stays taken."""
        with self._locked(on_event), self._db() as db:
            rows = db.execute('SELECT key, root, label, model, seed, start, "end", bytes, last_used FROM segments').fetchall()
            entries = self._group(rows)
            self._delete(db, [row[0] for row in rows])
            self._sweep(db)
        return [entry for entry, _ in entries]

    def trim(self, on_event: EventCallback | None = None) -> None:
        """Evicts least recently used segments until the cache is under its limit (saving a
        segment does this too; call it after lowering the limit)."""
        with self._locked(on_event), self._db() as db:
            self._evict(db)

    @property
    def total_bytes(self) -> int:
        with self._db() as db:
            return int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM segments").fetchone()[0])

    # -- what CachedPrefill uses -----------------------------------------------------------------

    def present(self, keys: Iterable[str]) -> set[str]:
        """Which of `keys` have a segment."""
        keys = list(keys)
        stems = {self._stem(key): key for key in keys}
        found: set[str] = set()
        with self._db() as db:
            for first in range(0, len(keys), 500):
                some = list(stems)[first:first + 500]
                marks = ",".join("?" * len(some))
                found.update(stems[row[0]] for row in db.execute(f"SELECT key FROM segments WHERE key IN ({marks})", some))
        return found

    def read(self, key: str, seed: str) -> Segment:
        """Reads and checks the segment saved under `key`. Raises BadSegment (the file must be
        discarded) or FileNotFoundError (it was evicted meanwhile)."""
        header, payload = self._read_checked(key)
        try:
            if header["seed"] != seed:
                raise BadSegment("written for another model or engine setting")
            if header["key"] != key:
                raise BadSegment("saved under another key")
            dtype = _DTYPES[header["dtype"]]
            flat = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
            groups, offset = [], 0
            shape = tuple(header["block_shape"])
            for group in header["groups"]:
                dims = (group["layers"], 2, len(group["blocks"]), *shape)
                nbytes = math.prod(dims) * torch.empty(0, dtype=dtype).element_size()
                groups.append(flat[offset:offset + nbytes].view(dtype).view(dims))
                offset += nbytes
            if offset != len(payload):
                raise BadSegment("inconsistent (payload size)")
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise BadSegment(f"unreadable ({exc})") from None
        return Segment(header, groups)

    def read_record(self, key: str) -> tuple[dict, memoryview]:
        """Reads and checks a record saved under `key` with `write` (header["layout"] "record":
        not KV, but what a document's KV is computed from, tasks/prepared.py): its header and
        payload. Raises BadSegment (the file must be discarded) or FileNotFoundError."""
        header, payload = self._read_checked(key)
        if header.get("key") != key:
            raise BadSegment("saved under another key")
        if header.get("layout") != "record":
            raise BadSegment("not a record")
        return header, payload

    def _read_checked(self, key: str) -> tuple[dict, memoryview]:
        """The header and payload of the file saved under `key`, its size, format version and
        checksum checked. Raises BadSegment or FileNotFoundError."""
        path = self.path(key)
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < _FIXED.size + _TRAILER.size:
                raise BadSegment("truncated")
            buffer = bytearray(size)
            view = memoryview(buffer)
            got = 0
            while got < size:
                count = file.readinto(view[got:])
                if not count:
                    break
                got += count
        if got < size:
            raise BadSegment("truncated")
        magic, version, header_bytes, payload_bytes = _FIXED.unpack_from(buffer, 0)
        if magic != _MAGIC:
            raise BadSegment("not a kvpage KV file")
        if version != KV_FORMAT_VERSION:
            raise BadSegment(f"of KV format version {version}, not {KV_FORMAT_VERSION}")
        expected = _FIXED.size + header_bytes + payload_bytes + _TRAILER.size
        if size != expected:
            raise BadSegment("truncated" if size < expected else f"{size - expected} bytes too long")
        (crc,) = _TRAILER.unpack_from(buffer, size - _TRAILER.size)
        if zlib.crc32(view[:size - _TRAILER.size]) != crc:
            raise BadSegment("corrupt (checksum mismatch)")
        try:
            header = json.loads(bytes(view[_FIXED.size:_FIXED.size + header_bytes]))
            if not isinstance(header, dict):
                raise ValueError("the header is not an object")
        except ValueError as exc:
            raise BadSegment(f"unreadable ({exc})") from None
        return header, view[_FIXED.size + header_bytes:size - _TRAILER.size]

    def write(self, header: dict, groups: list[torch.Tensor], label: str, model: str, on_wait=None) -> None:
        """Saves a segment atomically under header["key"] and indexes it, then evicts beyond the limit.
        `on_wait()` is called when the lock is slow to come (see _locked); CacheBusy when it never does.

        header: key, parent ("" for the first segment), root, seed, start, end, dtype, block_shape,
        groups [{window, layers, blocks}]; groups: per store group, K/V [layers, 2, blocks, Hkv, 64, D]."""
        key = self._stem(header["key"])
        parent = self._stem(header["parent"]) if header["parent"] else ""
        path = self._file(key)
        _make_private_dir(path.parent)
        header_json = json.dumps(header, separators=(",", ":")).encode()
        header_json += b" " * (-(_FIXED.size + len(header_json)) % 64)  # the payload starts 64-byte aligned
        payloads = [g.contiguous().view(torch.uint8).reshape(-1).numpy() for g in groups]
        payload_bytes = sum(p.nbytes for p in payloads)
        fixed = _FIXED.pack(_MAGIC, KV_FORMAT_VERSION, len(header_json), payload_bytes)
        crc = zlib.crc32(header_json, zlib.crc32(fixed))
        for payload in payloads:
            crc = zlib.crc32(payload, crc)
        tmp = path.parent / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(fixed)
                file.write(header_json)
                for payload in payloads:
                    file.write(memoryview(payload))
                file.write(_TRAILER.pack(crc))
                file.flush()
                os.fsync(file.fileno())
            with self._locked(on_wait=on_wait), self._db() as db:
                self._commit(tmp, path)
                now = time.time()
                size = _FIXED.size + len(header_json) + payload_bytes + _TRAILER.size
                db.execute(
                    'INSERT OR REPLACE INTO segments (key, parent, root, seed, model, start, "end", bytes, label, created, '
                    "last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (key, parent, header["root"], header["seed"], model, header["start"], header["end"], size,
                     label, now, now),
                )
                self._sweep_temporary()
                self._evict(db)
        finally:
            tmp.unlink(missing_ok=True)

    def write_blocks(self, header: dict, blocks: list[list[torch.Tensor]], label: str, model: str,
                     bounds: torch.Tensor | None = None) -> None:
        """Saves a library window (retrieval mode): per block, per full-attention group, K/V
        [layers, 2, Hkv, 64, D], block after block so that each block is one contiguous range
        with its own checksum (read on its own later, through a memory map); then, when given, the
        blocks' key bounds (bfloat16 [blocks, layers, 2, Hkv, D]) with one checksum of their own."""
        rows = [torch.cat([g.contiguous().view(torch.uint8).reshape(-1) for g in groups]) for groups in blocks]
        header = dict(header, layout="blocks", block_bytes=rows[0].numel() if rows else 0,
                      block_crcs=[zlib.crc32(r.numpy()) for r in rows])
        payload = [torch.cat(rows)] if rows else []
        if bounds is not None and rows:
            raw = bounds.contiguous().view(torch.uint8).reshape(-1)
            header.update(bounds_shape=list(bounds.shape), bounds_crc=zlib.crc32(raw.numpy()))
            payload.append(raw)
        self.write(header, payload, label, model)

    def map_blocks(self, key: str, seed: str) -> MappedBlocks:
        """The library window saved under `key`, memory-mapped (see MappedBlocks); its header and
        size are checked now, each block's bytes when first read. Raises BadSegment or
        FileNotFoundError (evicted meanwhile)."""
        path = self.path(key)
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            fixed = file.read(_FIXED.size)
            if len(fixed) < _FIXED.size:
                raise BadSegment("truncated")
            magic, version, header_bytes, payload_bytes = _FIXED.unpack(fixed)
            if magic != _MAGIC:
                raise BadSegment("not a kvpage KV file")
            if version != KV_FORMAT_VERSION:
                raise BadSegment(f"of KV format version {version}, not {KV_FORMAT_VERSION}")
            if size != _FIXED.size + header_bytes + payload_bytes + _TRAILER.size:
                raise BadSegment("truncated or too long")
            try:
                header = json.loads(file.read(header_bytes))
                bounds_bytes = 2 * math.prod(header.get("bounds_shape", [0]))
                ok = (header["seed"] == seed and header["key"] == key and header.get("layout") == "blocks"
                      and header["block_bytes"] * len(header["block_crcs"]) + bounds_bytes == payload_bytes)
                dtype = _DTYPES[header["dtype"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise BadSegment(f"unreadable ({exc})") from None
            if not ok:
                raise BadSegment("written for another model, key or layout")
        start = _FIXED.size + header_bytes
        mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        return MappedBlocks(header, mapped[start:start + payload_bytes], dtype, set())

    def _commit(self, tmp: Path, path: Path) -> None:
        """The rename that makes a written segment visible (a separate step so tests can fail it)."""
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def touch(self, keys: list[str], label: str, on_event: EventCallback | None = None) -> None:
        """Marks segments as used now (every rank's share: they are evicted together); gives unnamed
        ones `label`."""
        if not keys:
            return
        now = time.time()
        with self._locked(on_event), self._db() as db:
            db.executemany(f"UPDATE segments SET last_used = ? WHERE {_SHARES}", [(now, *_shares(k)) for k in keys])
            if label:
                db.executemany(f"UPDATE segments SET label = ? WHERE ({_SHARES}) AND label = ''",
                               [(label, *_shares(k)) for k in keys])

    def discard(self, key: str, on_event: EventCallback | None = None) -> None:
        """Deletes this process's share of a segment that failed its checks (the segments after it,
        and the other ranks' shares, stay: they are valid)."""
        with self._locked(on_event), self._db() as db:
            db.execute("DELETE FROM segments WHERE key = ?", (self._stem(key),))
            self.path(key).unlink(missing_ok=True)

    def submit(self, work) -> Future:
        """Runs `work()` on the cache's writer thread (segments are saved while prefill goes on)."""
        with self._thread_lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpage-kv-writer")
        return self._writer.submit(work)

    def close(self) -> None:
        """Waits for the writes submitted and stops the writer thread."""
        with self._thread_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def path(self, key: str) -> Path:
        """The file of this process's share of the segment saved under chain key `key`."""
        return self._file(self._stem(key))

    def _stem(self, key: str) -> str:
        """The index key and file name of this process's share of segment `key`."""
        return f"{key}-{self.part}" if self.part else key

    def _file(self, stem: str) -> Path:
        return self.segments_dir / stem[:2] / f"{stem}.kvb"

    # -- internals -------------------------------------------------------------------------------

    @contextmanager
    def _locked(self, on_event: EventCallback | None = None, on_wait=None) -> Iterator[None]:
        """Excludes other threads of this process and other processes. Past LOCK_NOTICE_S it says
        so (an EngineWarning to `on_event`, or `on_wait()` on a thread that must not emit); past
        LOCK_TIMEOUT_S it raises CacheBusy."""
        timeout, notice = LOCK_TIMEOUT_S, min(LOCK_NOTICE_S, LOCK_TIMEOUT_S)
        started = time.monotonic()
        if not self._acquire(notice):
            if on_wait is not None:
                on_wait()
            emit(on_event, EngineWarning(self.waiting_message()))
            if not self._acquire(max(0.0, timeout - (time.monotonic() - started))):
                raise CacheBusy(f"another kvpage process held the lock of {self.folder} for {timeout:.0f} s")
        try:
            yield
        finally:
            self._file_lock.release()
            self._thread_lock.release()

    def waiting_message(self) -> str:
        return (f"waiting for the saved-KV cache in {self.folder}: another kvpage process holds its lock "
                f"(giving up on it after {LOCK_TIMEOUT_S:.0f} s)")

    def _acquire(self, timeout: float) -> bool:
        """Both locks within `timeout` seconds, or neither."""
        started = time.monotonic()
        if not self._thread_lock.acquire(timeout=timeout):
            return False
        try:
            self._file_lock.acquire(timeout=max(0.0, timeout - (time.monotonic() - started)), poll_interval=0.02)
        except Timeout:
            self._thread_lock.release()
            return False
        return True

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """One transaction on the index: committed when the block ends normally, else rolled back."""
        db = sqlite3.connect(str(self.index_path), timeout=LOCK_TIMEOUT_S)
        try:
            yield db
            db.commit()
        except BaseException:
            db.rollback()
            raise
        finally:
            db.close()

    def _group(self, rows) -> list[tuple[CacheEntry, list[str]]]:
        """Rows -> entries: segments saved under one label for one model (a document: its prefix, or
        its retrieval index's windows and head, whose chains start from other seeds), else under
        one chain root for one model setting (the ranks of a tensor-parallel run share the chain, so
        their files make one entry)."""
        groups: dict[tuple, list] = {}
        for row in rows:
            key, root, label, model, seed = row[:5]
            groups.setdefault((label, model) if label else (root, model, seed), []).append(row)
        entries = []
        for group, members in groups.items():
            model = group[1]
            first = min(members, key=lambda r: r[5])
            entry = CacheEntry(
                key=first[1], label=first[2], model=model, tokens=max(r[6] for r in members),
                bytes=sum(r[7] for r in members), segments=len({r[0].split("-", 1)[0] for r in members}),
                last_used=max(r[8] for r in members),
            )
            entries.append((entry, [r[0] for r in members]))
        entries.sort(key=lambda e: -e[0].last_used)
        return entries

    def _delete(self, db: sqlite3.Connection, keys: Iterable[str]) -> int:
        """Deletes segments (index keys), every rank's share of them and every segment that
        continues them; returns the bytes freed."""
        freed = 0
        todo = list(keys)
        seen: set[str] = set()
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            base = key.split("-", 1)[0]
            shares = db.execute(f"SELECT key, bytes FROM segments WHERE {_SHARES}", _shares(base)).fetchall()
            for stem, size in shares + [(key, 0)]:
                if stem in seen:
                    continue
                seen.add(stem)
                todo.extend(r[0] for r in db.execute("SELECT key FROM segments WHERE parent = ?", (stem,)))
                db.execute("DELETE FROM segments WHERE key = ?", (stem,))
                self._file(stem).unlink(missing_ok=True)
                freed += size
        return freed

    def _evict(self, db: sqlite3.Connection) -> None:
        total = int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM segments").fetchone()[0])
        if total <= self.limit_bytes:
            return
        # Oldest first; among equals the longest prefix first, so a chain is cut from its end.
        order = db.execute('SELECT key FROM segments ORDER BY last_used ASC, "end" DESC').fetchall()
        for (key,) in order:
            if total <= self.limit_bytes:
                break
            total -= self._delete(db, [key])

    def _sweep_if_free(self) -> None:
        """Sweeps now if no other process holds the lock (opening the cache never waits for it)."""
        if not self._acquire(0.0):
            return
        try:
            with self._db() as db:
                self._sweep(db)
        except sqlite3.Error:
            pass  # the next open or clear sweeps
        finally:
            self._file_lock.release()
            self._thread_lock.release()

    def _sweep(self, db: sqlite3.Connection) -> None:
        """Removes leftovers of processes that died: temporary files, files without a row, rows without a file."""
        known = {row[0] for row in db.execute("SELECT key FROM segments")}
        self._sweep_temporary()
        for path in self.segments_dir.glob("*/*.kvb"):
            if path.name[:-4] not in known:
                path.unlink(missing_ok=True)
        for key in known:
            if not self._file(key).exists():
                db.execute("DELETE FROM segments WHERE key = ?", (key,))

    def _sweep_temporary(self) -> None:
        """Removes the temporary files of writers that are gone (under the lock)."""
        for path in self.segments_dir.glob("*/.*.tmp"):
            if writer_gone(path, _writer_pid(path)):
                path.unlink(missing_ok=True)


def _make_private_dir(path: Path) -> None:
    private_dir(path)
    if (path.stat().st_mode & 0o777) != 0o700:  # documents' KV: made private even if it existed
        os.chmod(path, 0o700)



def _writer_pid(tmp: Path) -> int | None:
    """The pid in a temporary file's name (.<key>.<pid>.<random>.tmp)."""
    parts = tmp.name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
