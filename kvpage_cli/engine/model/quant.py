"""Weight matrices kept in a compact format and multiplied without expanding them.

A `QuantMatrix` is W[N, K] as rows of bytes in one of the formats the native kernels read
(native/formats.h): a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, F16, BF16, F32), memory-mapped from the file, or a format made at load from float weights:
bfloat16, int8 (one fp32 scale per output channel) and int4 (groups of 32 with a scale and a
minimum: GGUF's Q4_1 layout). A few rows (decode steps, batches) go through the native
dequantize-and-dot kernel, each row's result independent of the others, or, with int8
activations (EngineConfig.activations), through integer dot products with the rows rounded to
int8 in groups of 32; a long prompt chunk dequantizes W (a layer's parts that share an input
together, or a slice of output rows at a time) into fp32 and multiplies it through oneDNN or
MKL, whichever this CPU's instructions favour (`matmul_nt`). On a CPU with AMX, Q4_0, Q4_1 and
Q8_0 products of 8 rows or more run on tiles instead (native/tiles.c's kvp_qgemm_tiles;
`native.qgemm_tiles`), each row's result still its own, in
other bits than the rows' path: a long chunk's, and a few rows' where the caller says
(model.Rows). On the Triton backend a `DeviceMatrix` holds the same values decoded for the
Triton dequantize-in-register kernel.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ModelError
from .. import native

WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4", "gguf")

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30
I8_ROW = 1000  # kvpage's int8 rows: an fp32 scale, then K int8 values
FLOAT_FORMATS = (F32, F16, BF16)
TILE_FORMATS = (Q4_0, Q4_1, Q8_0)  # multiplied on AMX tiles from 8 rows, where the CPU has them (native/tiles.c)
# int8 products read straight from the blocks, long chunks too (native/kquants.c)
KQUANT_FORMATS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)

# values per block, bytes per block (native/formats.c's kvp_quant_block)
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
          Q8_0: (32, 34), Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
         Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", I8_ROW: "int8"}
GROUPS_OF_16 = (Q2_K, Q3_K, Q6_K)  # a scale (and offset) per 16 decoded values, others per 32 (formats.h: block_of)

DEQUANT_CHUNK_BYTES = 16 << 20
"""A long chunk's matrix multiplication dequantizes at most this many bytes of fp32 weights at a
time (a layer's Q, K and V, or gate and up, together where they fit)."""


def _onednn_linear():
    """oneDNN's fp32 linear op where torch has it and the CPU runs AVX-512, else None (MKL then).
    On an AMD EPYC Zen 5 (AVX-512) oneDNN multiplied SmolLM2's prefill shapes 1.5-2.3x faster than
    MKL; on a Zen 3 (AVX2 only) oneDNN took 0.80-0.94x MKL's speed at 1,024 and 4,096 rows (at 64,
    0.93-1.14x) (`python bench/prefill_gemm.py`, two threads, both machines; docs/benchmarks.md)."""
    try:
        if not torch.backends.mkldnn.is_available() or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            return None
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear()


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for a long chunk's rows, fp32: on a CPU through oneDNN where
    `_onednn_linear` chose it (the op torch's compiler calls for a linear layer), else torch's
    default matrix product (MKL on x86). Both are fp32 products summed in their own order."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32:
        return _ONEDNN_LINEAR(x, w, None, "none", [], "")
    return x @ w.t()


class UnsupportedFormat(ModelError):
    """A GGUF tensor in a block format the native kernels do not read (e.g. the IQ formats)."""


def row_bytes(qtype: int, cols: int) -> int:
    if qtype == I8_ROW:
        return 4 + cols
    values, size = BLOCKS[qtype]
    if cols % values:
        raise ModelError(f"a {NAMES[qtype]} row holds a multiple of {values} values, not {cols}")
    return cols // values * size


def _ggml_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return str(qtype)


@dataclass(eq=False)
class QuantMatrix:
    """W[N, K] (N = `rows` output features, K = `cols` inputs) as N rows of bytes of `qtype`.

    data: uint8 [N, row_bytes], C-contiguous (a numpy memmap over a GGUF file, or owned bytes).
    out_perm: output feature i is the matrix's row out_perm[i] (llama GGUF files store Q and K
    rows permuted for their rotary layout); None when the rows are in order."""

    qtype: int
    data: np.ndarray
    rows: int
    cols: int
    out_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in NAMES:
            raise UnsupportedFormat(f"weights in GGML format {_ggml_name(self.qtype)} are not supported "
                                    f"(supported: {', '.join(sorted(NAMES.values()))})")
        expected = (self.rows, row_bytes(self.qtype, self.cols))
        if self.data.dtype != np.uint8 or tuple(self.data.shape) != expected or not self.data.flags.c_contiguous:
            raise ModelError(f"a {NAMES[self.qtype]} matrix of {self.rows}x{self.cols} needs {expected[0]}x{expected[1]} "
                             f"contiguous bytes, got {self.data.dtype} {tuple(self.data.shape)}")
        self._addr = self.data.ctypes.data

    @property
    def format(self) -> str:
        return NAMES[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def row_slice(self, start: int, stop: int) -> "QuantMatrix":
        """Output features [start, stop): a view of a mapped file's bytes, a copy of bytes made at
        load (so that the whole matrix can be freed). With permuted rows the slice must hold whole
        permutation groups (a tensor-parallel rank's heads do)."""
        data = self.data[start:stop] if isinstance(self.data, np.memmap) else self.data[start:stop].copy()
        if self.out_perm is None:
            return QuantMatrix(self.qtype, data, stop - start, self.cols)
        perm = self.out_perm[start:stop]
        if perm.numel() and (int(perm.min()) < start or int(perm.max()) >= stop):
            raise ModelError(f"rows {start}:{stop} of a permuted {self.format} matrix cut a permutation group")
        return QuantMatrix(self.qtype, data, stop - start, self.cols, perm - start)

    def col_slice(self, start: int, stop: int) -> "QuantMatrix":
        """Inputs [start, stop) of every row (a copy), on block boundaries."""
        if self.qtype == I8_ROW:  # the row's scale, then its values
            data = np.concatenate([self.data[:, :4], self.data[:, 4 + start:4 + stop]], axis=1)
        else:
            values, size = BLOCKS[self.qtype]
            if start % values or stop % values:
                raise ModelError(f"a {self.format} matrix can be cut only at multiples of {values} inputs, "
                                 f"not at {start}:{stop}")
            data = self.data[:, start // values * size:stop // values * size]
        return QuantMatrix(self.qtype, np.ascontiguousarray(data), self.rows, stop - start, self.out_perm)

    def rounds_activations(self, activations: str) -> bool:
        """Whether products with this matrix round x to int8 under EngineConfig.activations: "int8"
        for every block format, "auto" for the K-quants (Q2_K ... Q6_K), "float32" for none."""
        if self.qtype in FLOAT_FORMATS:
            return False
        return activations == "int8" or (activations == "auto" and self.qtype in KQUANT_FORMATS)

    def reads_long_chunks(self, lib: ctypes.CDLL, int8: bool) -> bool:
        """Whether a long chunk's product reads this matrix's blocks itself (AMX tiles, or a
        K-quant's int8 products on VNNI tiles) rather than multiplying the matrix dequantized."""
        return (int8 and self.qtype in KQUANT_FORMATS) or (not int8 and self.on_tiles(lib))

    def matmul(self, lib: ctypes.CDLL, x: torch.Tensor, few_rows: bool, int8: bool = False,
               tiles: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K] -> x @ W^T: [M, N] fp32. int8: rows of x are rounded to int8 (in groups of 32;
        for K-quants 256, llama.cpp's Q8_K) and multiplied with integer dot products (block
        formats; float formats ignore it): a few rows, and a long chunk's for K-quants (other
        formats' long chunks multiply fp32). tiles: few rows may multiply on AMX tiles (model.Rows
        says when); a long chunk's do where they apply. out: fp32 [M, N] with unit column stride
        (e.g. columns of a wider product) that receives the result, the same bits, and is returned."""
        x = x.float()
        if x.dim() != 2 or x.stride(1) != 1:  # the native kernels take rows of x at any stride (ldx)
            x = x.contiguous()
        if out is not None and (out.dtype != torch.float32 or out.shape != (x.shape[0], self.rows)
                                or out.stride(1) != 1):
            raise ValueError(f"a product goes into fp32 [{x.shape[0]}, {self.rows}] with unit column stride, not "
                             f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}")
        int8 = int8 and self.qtype not in FLOAT_FORMATS
        direct = not few_rows and self.reads_long_chunks(lib, int8)
        if few_rows or direct:
            y = out if out is not None and self.out_perm is None else torch.empty(x.shape[0], self.rows)
            if int8 and (few_rows or direct):
                kernel = lib.kvp_qgemm_rows_q8
            else:
                kernel = lib.kvp_qgemm_tiles if tiles or direct else lib.kvp_qgemm_rows
            rc = kernel(self.qtype, x.data_ptr(), x.stride(0), self._addr, self.data.shape[1], x.shape[0],
                        self.cols, self.rows, y.data_ptr(), y.stride(0))
            if rc != 0:
                raise RuntimeError(f"the native {self.format} kernel failed ({rc})")
            if self.out_perm is not None:
                y = y[:, self.out_perm] if out is None else out.copy_(y[:, self.out_perm])
            return y
        x = x.contiguous()
        step = max(16, DEQUANT_CHUNK_BYTES // (4 * self.cols))
        if step >= self.rows and out is None:  # one slice: no copy of the product into y
            return matmul_nt(x, self.dequantize(lib))
        y = torch.empty(x.shape[0], self.rows) if out is None else out
        for start in range(0, self.rows, step):
            stop = min(start + step, self.rows)
            y[:, start:stop] = matmul_nt(x, self.take(lib, torch.arange(start, stop)))
        return y

    def on_tiles(self, lib: ctypes.CDLL) -> bool:
        """Whether products of 8 rows or more multiply on AMX tiles (native/tiles.c), prompt chunks' too:
        faster there than the matrix dequantized through oneDNN (`python bench/decode_gemm.py
        --rows 64,256,1024`)."""
        return self.qtype in TILE_FORMATS and native.qgemm_tiles(lib)

    def take(self, lib: ctypes.CDLL, features: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Output features' rows of W (e.g. token embeddings), dequantized: [len(features), K] fp32
        (into `out`, rows of K contiguous values, when given)."""
        rows = features if self.out_perm is None else self.out_perm[features]
        return self._dequantize(lib, rows, out)

    def dequantize(self, lib: ctypes.CDLL, out: torch.Tensor | None = None) -> torch.Tensor:
        """All of W as fp32 [N, K], rows in output-feature order (into `out` when given)."""
        return self.take(lib, torch.arange(self.rows), out)

    def _dequantize(self, lib: ctypes.CDLL, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"row index out of range for a matrix of {self.rows} rows")
        if out is None:
            out = torch.empty(rows.numel(), self.cols)
        elif out.dtype != torch.float32 or out.shape != (rows.numel(), self.cols) or out.stride(1) != 1:
            raise ValueError(f"dequantized rows go into fp32 [{rows.numel()}, {self.cols}] rows, not {out.dtype} "
                             f"{tuple(out.shape)} with strides {out.stride()}")
        rc = lib.kvp_dequant_rows(self.qtype, self._addr, self.data.shape[1], rows.data_ptr(), rows.numel(), self.cols,
                                  out.data_ptr(), out.stride(0))
        if rc != 0:
            raise RuntimeError(f"the native {self.format} kernel failed ({rc})")
        return out


PACKED_SHIFT = {Q4_0: 8, Q4_1: 0, Q4_K: 0, Q2_K: 0, Q3_K: 4}  # values of 4 bits or fewer, plus this, fit a nibble


class DeviceMatrix:
    """A QuantMatrix for the Triton kernels (the GPU's, or the interpreter's on a CPU): its block
    format decoded once at load into int8 values with a scale and an offset per group of inputs
    (`kvp_decode_i8_rows`; every weight is exactly scale * q + offset, the values the native
    kernels use; values of 4 bits or fewer packed two a byte), on the device, rows in output-feature
    order, multiplied by the dequantize-in-register kernel (kvpage_kernels.dequant_matmul). Float
    formats (F16, BF16, F32) are kept as a W^T tensor of their own dtype and multiplied by torch."""

    def __init__(self, source: QuantMatrix, lib: ctypes.CDLL, device: torch.device, ops) -> None:
        self.ops = ops
        self.rows, self.cols = source.rows, source.cols
        self.qtype = source.qtype
        order = source.out_perm.to(torch.int64) if source.out_perm is not None else None
        self.shift = PACKED_SHIFT.get(source.qtype, 0)
        if source.qtype in FLOAT_FORMATS:
            dtype = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[source.qtype]
            values = torch.from_numpy(np.ascontiguousarray(source.data)).view(dtype).reshape(self.rows, self.cols)
            self.w_t = (values if order is None else values[order]).t().contiguous().to(device)
            self.q = self.scale = self.offset = None
            return
        group = 16 if source.qtype in GROUPS_OF_16 else 32
        q = torch.empty(self.rows, self.cols, dtype=torch.int8)
        scale = torch.empty(self.rows, self.cols // group)
        offset = torch.empty(self.rows, self.cols // group)
        rc = lib.kvp_decode_i8_rows(source.qtype, source._addr, source.data.shape[1], self.rows, self.cols,
                                    q.data_ptr(), scale.data_ptr(), offset.data_ptr())
        if rc != 0:
            raise RuntimeError(f"the native {source.format} decoder failed ({rc})")
        if order is not None:
            q, scale, offset = q[order], scale[order], offset[order]
        if source.qtype in PACKED_SHIFT:  # values of 4 bits or fewer: two a byte
            q = ops.pack4(q, self.shift)
        self.q, self.scale, self.offset = q.to(device), scale.to(device), offset.to(device)
        self.w_t = None

    @property
    def format(self) -> str:
        return NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        parts = [self.w_t] if self.w_t is not None else [self.q, self.scale, self.offset]
        return sum(t.numel() * t.element_size() for t in parts)

    def matmul(self, lib: ctypes.CDLL | None, x: torch.Tensor, few_rows: bool, int8: bool = False,
               tiles: bool = False) -> torch.Tensor:
        """x: [M, K] -> x @ W^T: [M, N] fp32 (lib, few_rows, int8, tiles: QuantMatrix's signature, unused)."""
        x = x.float().contiguous()
        if self.w_t is not None:
            return x @ self.w_t.float()
        return self.ops.dequant_matmul(x, self.q, self.scale, self.offset, self.shift)

    def take(self, lib: ctypes.CDLL | None, features: torch.Tensor) -> torch.Tensor:
        """Output features' rows of W (token embeddings), dequantized: [len(features), K] fp32."""
        rows = features.to(device=self.q.device if self.q is not None else self.w_t.device, dtype=torch.int64)
        if self.w_t is not None:
            return self.w_t[:, rows].t().float()
        return self.ops.dequantize_ref(self.q[rows], self.scale[rows], self.offset[rows], self.shift)

    def dequantize(self, lib: ctypes.CDLL | None = None) -> torch.Tensor:
        return self.take(lib, torch.arange(self.rows))


class QuantLinear:
    """Several QuantMatrix (or DeviceMatrix) whose outputs are concatenated (Q, K and V; gate and
    up): each keeps its own format (a GGUF file mixes them), so they are not fused into one matrix."""

    def __init__(self, parts: list[QuantMatrix | DeviceMatrix]) -> None:
        self.parts = parts
        self.out_features = sum(p.rows for p in parts)

    def __call__(self, lib: ctypes.CDLL, x: torch.Tensor, few_rows: bool, activations: str = "float32",
                 tiles: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, out_features]; activations: EngineConfig.activations, applied part by part
        (QuantMatrix.rounds_activations). out: fp32 [M, out_features] with unit column stride that
        the native kernels' products are written into, the same bits (a buffer reused from layer to
        layer); the product returned is the one to use (a dequantized matrix's product is not
        written there)."""
        int8 = [isinstance(p, QuantMatrix) and p.rounds_activations(activations) for p in self.parts]
        if len(self.parts) == 1:
            part = self.parts[0]
            if isinstance(part, QuantMatrix) and (few_rows or part.reads_long_chunks(lib, int8[0])):
                return part.matmul(lib, x, few_rows, int8[0], tiles, out=out)
            return part.matmul(lib, x, few_rows, int8[0], tiles)
        cols = self.parts[0].cols
        if (not few_rows and all(isinstance(p, QuantMatrix) for p in self.parts)
                and 4 * self.out_features * cols <= DEQUANT_CHUNK_BYTES
                and not all(p.reads_long_chunks(lib, i) for p, i in zip(self.parts, int8))):
            # a long chunk: every part's rows dequantized into one matrix, one product, no concatenation
            w = torch.empty(self.out_features, cols)
            start = 0
            for p in self.parts:
                p.dequantize(lib, w[start:start + p.rows])
                start += p.rows
            return matmul_nt(x.float().contiguous(), w)
        if any(not isinstance(p, QuantMatrix) for p in self.parts):
            return torch.cat([p.matmul(lib, x, few_rows, i, tiles) for p, i in zip(self.parts, int8)], dim=-1)
        y = torch.empty(x.shape[0], self.out_features) if out is None else out  # each part's columns in place
        start = 0
        for p, i in zip(self.parts, int8):
            p.matmul(lib, x, few_rows, i, tiles, out=y[:, start:start + p.rows])
            start += p.rows
        return y

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def formats(self) -> list[str]:
        return [p.format for p in self.parts]


def quantize(weight: torch.Tensor, fmt: str) -> QuantMatrix:
    """A float matrix W[N, K] made into `fmt` ("bfloat16", "int8" or "int4") at load."""
    weight = weight.detach().float().contiguous()
    rows, cols = weight.shape
    if fmt in ("int8", "int4") and cols % 32:
        raise ModelError(f"{fmt} weights need inputs in groups of 32; this model has a matrix of {cols} inputs "
                         "(use --weights bfloat16 or float32)")
    if fmt == "bfloat16":
        data = weight.to(torch.bfloat16).view(torch.uint8).reshape(rows, -1)
        return QuantMatrix(BF16, data.numpy(), rows, cols)
    if fmt == "int8":
        scale = weight.abs().amax(dim=1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(weight / scale).clamp_(-127, 127).to(torch.int8)
        data = torch.cat([scale.view(torch.uint8).reshape(rows, 4), q.view(torch.uint8)], dim=1).contiguous()
        return QuantMatrix(I8_ROW, data.numpy(), rows, cols)
    if fmt == "int4":
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize

        data = gguf_quantize(weight.numpy(), GGMLQuantizationType.Q4_1)
        return QuantMatrix(Q4_1, np.ascontiguousarray(data), rows, cols)
    raise ValueError(f"cannot make {fmt!r} weights at load")
