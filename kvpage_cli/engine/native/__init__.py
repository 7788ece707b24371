"""The native CPU kernels: compiled once per machine from native/*.c, loaded with ctypes, their
functions bound from the prototypes of native/kvpage.h (the interface is said there once).

Compilation needs a C compiler (`cc`, `gcc` or `clang`); without one the engine falls back to
the torch backend. The shared library is cached under `<home>/native/`, keyed by the source,
the compiler flags and the machine, and written atomically with its SHA-256 beside it. Loading
runs the library's code as the user, so it is loaded only from a folder that this user owns and
no one else can write to, and only when its hash is the one written when it was built; a
library that fails to load (a noexec home, a missing libgomp) is NativeUnavailable too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import torch
from filelock import FileLock

from ..config import BLOCK_TOKENS, TILE_MIN_ROWS
from ..home import private_dir

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c11",
          "-ffp-contract=off",  # no fused multiply-adds the source does not ask for: torch's bits
          f"-DBLOCK_TOKENS={BLOCK_TOKENS}", f"-DTILE_MIN_ROWS={TILE_MIN_ROWS}"]
HEADER = "kvpage.h"  # the library's interface: every kvp_* prototype, bound from here (`prototypes`)
# the .c files in the order they are compiled, the slowest first (5-7 s each for attention_*.c on a Zen 4)
_SOURCES = (HEADER, "formats.h", "attention_item.h", "attention_bf16.c", "attention_int8.c", "attention_f32.c",
            "prefill.c", "kquants.c", "rows.c", "int8.c", "formats.c", "linear.c", "attention.c", "tiles.c", "layer.c",
            "amx.c")
_LIB: ctypes.CDLL | None = None


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built here (no compiler, or compilation failed)."""


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def load(home: Path) -> ctypes.CDLL:
    """The loaded kernel library, building it first if this machine has no cached build."""
    global _LIB
    if _LIB is not None:
        return _LIB
    texts = sources()
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable("no C compiler found (cc, gcc or clang)")
    lib = _open_verified(library_path(home, texts), home, lambda out: _compile(compiler, texts, out))
    for name, (restype, argtypes) in prototypes(texts[HEADER].decode()).items():
        try:
            function = getattr(lib, name)
        except AttributeError:  # built only where the CPU has it (kvp_amx_configure)
            continue
        function.restype, function.argtypes = restype, argtypes
    _LIB = lib
    return lib


_C_TYPES = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "void": None}
_PROTOTYPE = re.compile(r"^(\w+)\s+(kvp_\w+)\(([^)]*)\);", re.M)


def prototypes(header: str) -> dict[str, tuple]:
    """Each kvp_* function the header declares: (restype, argtypes) for ctypes. Pointers of any
    type are c_void_p; a type outside int, int32_t, int64_t, float and void is an error here, so
    that a new kind of parameter cannot be bound wrong."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    found = {}
    for restype, name, params in _PROTOTYPE.findall(text):
        argtypes = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            if words == ["void"]:
                continue
            if "*" in words:
                argtypes.append(ctypes.c_void_p)
                continue
            kind = " ".join(w for w in words[:-1] if w != "const")
            if kind not in _C_TYPES or _C_TYPES[kind] is None:
                raise ValueError(f"{name}: no ctypes type for parameter {param.strip()!r} in {HEADER}")
            argtypes.append(_C_TYPES[kind])
        if restype not in _C_TYPES:
            raise ValueError(f"{name}: no ctypes type for its result {restype!r} in {HEADER}")
        found[name] = (_C_TYPES[restype], argtypes)
    missed = set(re.findall(r"\b(kvp_\w+)\(", text)) - set(found)
    if missed:  # declared in another form (a pointer result, a line break before the name)
        raise ValueError(f"{HEADER}: cannot read the prototypes of {', '.join(sorted(missed))}")
    return found


def sources() -> dict[str, bytes]:
    folder = resources.files("kvpage_cli.engine.native")
    return {name: folder.joinpath(name).read_bytes() for name in _SOURCES}


def library_path(home: Path, texts: dict[str, bytes] | None = None) -> Path:
    """Where the library built from these sources, with these flags, for this machine is kept."""
    texts = texts if texts is not None else sources()
    key = hashlib.sha256(b"".join(texts.values()) + " ".join(_FLAGS).encode() + platform.machine().encode()
                         + _cpu_flags()).hexdigest()[:16]
    return home / "native" / f"kvpage_attention-{key}.so"


def _compile(compiler: str, texts: dict[str, bytes], out: Path) -> None:
    """Each source file compiled by its own compiler process, as many at once as there are cores
    (in _SOURCES' order: the slowest first), then linked."""
    paths = []
    for name, text in texts.items():
        paths.append(out.with_name(name))
        paths[-1].write_bytes(text)
    units = [path for path in paths if path.suffix == ".c"]  # the headers beside them are included
    objects = [unit.with_suffix(".o") for unit in units]
    jobs = [[compiler, *_FLAGS, "-c", str(unit), "-o", str(obj)] for unit, obj in zip(units, objects)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda argv: subprocess.run(argv, capture_output=True, text=True), jobs))
    result = next((r for r in results if r.returncode != 0), None)
    if result is None:
        result = subprocess.run([compiler, *_FLAGS, *map(str, objects), "-o", str(out), "-lm"], capture_output=True,
                                text=True)
    if result.returncode != 0:
        raise NativeUnavailable(f"compiling the native kernels failed: {result.stderr.strip()[:300]}")


def _open_verified(target: Path, home: Path, build) -> ctypes.CDLL:
    """Loads the library at `target`, building it first (`build(path)` writes one) when it is
    missing or not the one built here. Raises NativeUnavailable when its folder or the library
    itself could have been written by someone else, or when it does not load."""
    private_dir(target.parent)
    _check_private(target.parent, home)
    digest_file = target.with_name(target.name + ".sha256")
    if not _hash_matches(target, digest_file):
        with FileLock(str(target) + ".lock", mode=0o600):
            if not _hash_matches(target, digest_file):
                with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                    out = Path(tmp) / target.name
                    build(out)
                    (Path(tmp) / digest_file.name).write_text(_sha256(out) + "\n")
                    os.replace(out, target)
                    os.replace(Path(tmp) / digest_file.name, digest_file)
    _check_private(target, home)
    if not _hash_matches(target, digest_file):
        raise NativeUnavailable(f"{target} changed after it was built; not loading it")
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:  # a noexec home, a missing libgomp, a library for another machine
        raise NativeUnavailable(f"{target.name} could not be loaded: {exc}") from None


def _check_private(path: Path, home: Path) -> None:
    """Raises NativeUnavailable unless `path` and every folder above it up to `home` belong to this
    user and no one else can write to them: otherwise another user could have planted the library
    (a shared KVPAGE_HOME) and it would run as this one."""
    if not hasattr(os, "getuid"):
        return
    uid = os.getuid()
    home = Path(home).absolute()
    current = Path(path).absolute()
    while True:
        info = current.stat() if current == home else current.lstat()  # the home may be a link the user made
        if stat.S_ISLNK(info.st_mode):
            raise NativeUnavailable(f"{current} is a symbolic link; not loading a library through it")
        if info.st_uid != uid:
            raise NativeUnavailable(f"{current} belongs to another user (uid {info.st_uid}); not loading a library from it")
        if info.st_mode & 0o022:
            raise NativeUnavailable(f"{current} is writable by other users; not loading a library from it "
                                    f"(chmod go-w {current} to use the native kernels)")
        if current == home or current == current.parent or home not in current.parents:
            return
        current = current.parent


def _hash_matches(target: Path, digest_file: Path) -> bool:
    try:
        return digest_file.read_text().strip() == _sha256(target)
    except OSError:  # either is missing
        return False


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


KV_KINDS = {"float32": 0, "bfloat16": 1, "int8": 2}  # the kernel's element kinds


def decode_states(lib: ctypes.CDLL, q: torch.Tensor, k_addr: torch.Tensor, v_addr: torch.Tensor, plan, window: int,
                  scale: float, states: torch.Tensor, lse: torch.Tensor, kv_dtype: str, tiles: int = 0) -> None:
    """Per-pair states of decode queries (see `DecodePlan`). q: [Nq, Hq, D] fp32 contiguous;
    k_addr, v_addr: [capacity, Hkv] int64 address tables of blocks of kv_dtype ("float32",
    "bfloat16", or "int8" with the scale rows of store.py); states: [P, Hq, D] and lse: [P, Hq]
    fp32 (written). tiles > 0: bfloat16 blocks that four queries or more read go to AMX tiles where
    they apply (a batch's generated tokens; other bits than alone), up to `tiles` consecutive
    blocks that those queries read whole in one pass (its state on the first block's pairs; the
    others' lse -inf, their outputs unwritten, which merge_pairs skips); 1 keeps each block's own
    state."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_addr.shape[1]
    rc = lib.kvp_decode_states(
        KV_KINDS[kv_dtype], q.data_ptr(), k_addr.data_ptr(), v_addr.data_ptr(), plan.item_ids.numel(), plan.item_ids.data_ptr(),
        plan.item_pos.data_ptr(), plan.item_off.data_ptr(), plan.pair_query.data_ptr(), plan.q_pos.data_ptr(),
        plan.q_end.data_ptr(), num_heads, num_kv_heads, head_dim, window, scale, states.data_ptr(), lse.data_ptr(),
        int(tiles))
    if rc != 0:
        raise ValueError(f"native decode attention does not support {num_heads} heads over {num_kv_heads} KV heads of dim {head_dim}")


def write_rows(lib: ctypes.CDLL, kv_dtype: str, x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor,
               offsets: torch.Tensor) -> None:
    """Rows x [N, Hkv, D] (fp32) into blocks of `kv_dtype` (KV_KINDS; store.py's layout): row r's
    head h at the block head table[ids[r], h] (int64 [capacity, Hkv], store.head_addresses), row
    offsets[r] (int32 [N]); the bits torch's conversion (store.encode_rows for int8) gives."""
    x = x.float().contiguous()
    assert table.dtype == torch.int64 and table.is_contiguous() and table.shape[1] == x.shape[1]
    assert ids.dtype == torch.int64 and offsets.dtype == torch.int32 and ids.numel() == offsets.numel() == x.shape[0]
    lib.kvp_write_rows(KV_KINDS[kv_dtype], x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], table.data_ptr(),
                       ids.data_ptr(), offsets.data_ptr())


def merge_pairs(lib: ctypes.CDLL, states: torch.Tensor, lse: torch.Tensor, plan, out: torch.Tensor) -> None:
    """states: [P, H, D], lse: [P, H] -> out: [Nq, H, D], each query's pairs merged in logical order."""
    num_heads, head_dim = states.shape[1], states.shape[2]
    lib.kvp_merge_pairs(states.data_ptr(), lse.data_ptr(), plan.q_off.numel() - 1, plan.q_off.data_ptr(),
                        plan.q_pairs.data_ptr(), num_heads, head_dim, out.data_ptr())


class Fold:
    """A running attention state over query rows, folded block by block in logical order.

    rows: Hkv * R query rows of dim D. `add` folds per-block states out: [n, Hkv, R, D] and
    lse: [n, Hkv, R]; `result` gives the merged output [Hkv, R, D] (0 where nothing was visible)."""

    def __init__(self, lib: ctypes.CDLL, num_kv_heads: int, rows: int, head_dim: int) -> None:
        self.lib = lib
        self.shape = (num_kv_heads, rows, head_dim)
        self.acc = torch.zeros(num_kv_heads * rows, head_dim)
        self.max = torch.full((num_kv_heads * rows,), float("-inf"))
        self.sum = torch.zeros(num_kv_heads * rows)

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        n = out.shape[0]
        out = out.reshape(n, -1, self.shape[2]).contiguous()
        lse = lse.reshape(n, -1).contiguous()
        self.lib.kvp_fold_states(out.data_ptr(), lse.data_ptr(), n, out.shape[1], self.shape[2],
                                 self.acc.data_ptr(), self.max.data_ptr(), self.sum.data_ptr())

    def result(self) -> torch.Tensor:
        out = self.acc / self.sum.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        return out.view(self.shape)


def attend_all_bf16(lib: ctypes.CDLL, qh: torch.Tensor, runs: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                    causal: int | None = None, group: int = 1, window: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Query rows over keys read in place, with bfloat16 dot products (prefill.c): qh [Hkv, R, D]
    fp32 rows; runs: (k, v) [Hkv, n, D] bfloat16 views (rows contiguous), together the keys in
    order. Every row sees every key, or with `causal` = c, row r (token r // group) sees keys
    0 .. c + r // group (with `window` > 0, the last `window` of them). Returns out [Hkv, R, D] and
    lse [Hkv, R] fp32, fp32 attention to about 1e-5 of the outputs' scale (Q written as three
    bfloat16 terms, the probabilities as two; multiplied on AMX tiles where `prefill_amx`); None
    where prefill.c does not apply: keys not
    bfloat16, D not a multiple of 64, or a CPU without AVX512-BF16."""
    if not runs or any(k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.stride(2) != 1 or v.stride(2) != 1
                       for k, v in runs):
        return None
    qh = qh.float()
    if qh.stride(2) != 1:
        qh = qh.contiguous()
    heads, rows, dim = qh.shape
    table = torch.tensor([[k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), k.shape[1]]
                          for k, v in runs], dtype=torch.int64)
    out = torch.empty(heads, rows, dim)
    lse = torch.empty(heads, rows)
    rc = lib.kvp_prefill_bf16(qh.data_ptr(), qh.stride(0), qh.stride(1), heads, rows, group,
                              -1 if causal is None else causal, window, table.data_ptr(), len(runs), dim, scale, out.data_ptr(),
                              lse.data_ptr())
    if rc == -2:
        raise MemoryError("prefill attention: out of memory")
    return (out, lse) if rc == 0 else None


def has_bf16_prefill(lib: ctypes.CDLL) -> bool:
    """Whether prefill.c's kernel runs here (built with AVX512-BF16 for this CPU): one call over
    one row and one key."""
    probe = torch.zeros(1, 1, 64)
    return attend_all_bf16(lib, probe, [(probe.bfloat16(), probe.bfloat16())], 1.0) is not None


def prefill_amx(lib: ctypes.CDLL, on: bool | None = None) -> bool:
    """Whether prefill.c's kernel multiplies on AMX tiles (where the CPU has them and Linux grants
    their state; the default) rather than with the AVX512-BF16 dot products, and decode attends a
    bfloat16 block read by four queries or more of a batch on tiles too (kvp_decode_tiles) rather
    than with attention.c's fp32 products; `on` sets which from now on (where it can)."""
    return bool(lib.kvp_prefill_set_amx(-1 if on is None else int(on)))


def qgemm_tiles(lib: ctypes.CDLL, on: bool | None = None) -> bool:
    """Whether kvp_qgemm_tiles multiplies Q4_0/Q4_1/Q8_0 products of TILE_MIN_ROWS rows or more on
    AMX tiles (where the CPU has them and Linux grants their state; the default): faster than the
    rows' path there, and not its bits (native/tiles.c); `on` sets which from now on (where it can)."""
    return bool(lib.kvp_qgemm_set_tiles(-1 if on is None else int(on)))


def gemm_rows(lib: ctypes.CDLL, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """y = x @ w_t for a few rows, each row's result independent of the others (see linear.c).

    x: [M, in] fp32 (rows contiguous); w_t: [in, out] fp32 or bf16, rows contiguous -> y: [M, out] fp32."""
    rows, cols = x.shape[0], w_t.shape[1]
    assert x.dtype == torch.float32 and x.stride(1) == 1 and w_t.stride(1) == 1
    y = torch.empty(rows, cols)
    lib.kvp_gemm_rows(int(w_t.dtype == torch.bfloat16), x.data_ptr(), x.stride(0), w_t.data_ptr(), w_t.stride(0), rows,
                      w_t.shape[0], cols, y.data_ptr(), y.stride(0))
    return y
