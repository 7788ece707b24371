"""Model runner: the decoder of llama, qwen2, qwen3, mistral and gemma3_text, written for the paged cache.

Weights are kept as `W^T` ([in, out], contiguous), with Q/K/V and gate/up fused, because
`x @ W^T` reads a row-major weight at close to memory bandwidth on a CPU while `x @ W.t()`
does not; one transposed matrix serves both the embedding lookup and the LM head when tied.
Attention is not done here: the runner computes Q/K/V, hands K and V to `write_kv`, which bakes
RoPE into K as it stores the block rows (unless the native layer rotated K already), and the
rotated Q to `attend`; both are supplied by the engine, which knows the contexts' blocks.

A forward pass runs the rows of one step: tokens of several sequences at their own positions.
Rows are grouped for the linear layers (`Rows`): the rows of short segments (decode tokens,
short prompts) go through one call of a kernel whose every row is computed alone (the native
`gemm_rows`), so a sequence gets the same bits batched or not (but for a batch's generated tokens
on AMX tiles: `Rows`), and the weights are read once for all of them; each long segment (a
prefill chunk) gets its own matrix multiplication. On
weights in a compact format, the short segments' rows of a llama-family layer go through two
native calls (`NativeLayer`: native/layer.c) instead of the operations below, one at a time.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ...errors import ModelError, UsageError
from .. import native
from ..config import SMALL_ROWS
from .parallel import Shard
from .quant import DeviceMatrix, QuantLinear, QuantMatrix, matmul_nt, quantize
from .rope import RopeParams, apply_rope, rope_cos_sin
from .spec import ModelSpec


@dataclass(frozen=True)
class RopeAt:
    """RoPE for the tokens of one forward: their cos/sin [T, D] and the parameters behind them.
    k_rotated: the K handed over with it is already rotated (the native layer did it)."""

    cos: torch.Tensor
    sin: torch.Tensor
    params: RopeParams
    positions: torch.Tensor
    k_rotated: bool = False

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """K as stored: rotated at its rows' positions."""
        return x if self.k_rotated else apply_rope(x, self.cos, self.sin)


@dataclass(frozen=True)
class Rows:
    """A step's rows as consecutive parts: (rows, small, tiles). Small parts that follow each other
    are run in one call, a long part alone. `tiles`: the part's products may run on AMX tiles
    (native/tiles.c's kvp_qgemm_tiles, from TILE_MIN_ROWS rows), whose bits differ from the rows' path's.
    A long part does (it took oneDNN's bits before). Short prompt segments never do: the same
    tokens can come in a segment of another length in a batch than alone (a review's clause
    prompts do), and must get the same bits. One-row segments do where `single_tiles`: a batch's
    generated tokens, which may get other bits batched than alone (within tolerance, tested)."""

    parts: tuple[tuple[slice, bool, bool], ...]

    @classmethod
    def of(cls, counts: Iterable[int], single_tiles: bool = False) -> "Rows":
        """Rows of segments of `counts` rows each, in order."""
        parts, start = [], 0
        for count in counts:
            small = count <= SMALL_ROWS
            tiles = not small or (count == 1 and single_tiles)
            if small and parts and parts[-1][1] and parts[-1][2] == tiles:
                parts[-1] = (slice(parts[-1][0].start, start + count), True, tiles)
            else:
                parts.append((slice(start, start + count), small, tiles))
            start += count
        return cls(tuple(parts))


_ONE_LONG = Rows(((slice(None), False, True),))  # a long segment's rows, alone
_NO_SPACE = torch.empty(0)  # a forward pass's gate and up buffer before its first long part (no allocation a step)


def _is_matrix(name: str, tensor) -> bool:
    """A weight matrix the runner keeps in the chosen format (not a norm or a bias)."""
    return isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and name.endswith(
        ("_proj.weight", "embed_tokens.weight", "lm_head.weight"))


@dataclass
class LayerWeights:
    norm_attn: torch.Tensor  # input_layernorm
    norm_mlp: torch.Tensor  # post_attention_layernorm (llama family) / pre_feedforward_layernorm (gemma)
    norm_post_attn: torch.Tensor | None  # gemma only
    norm_post_mlp: torch.Tensor | None  # gemma only
    qkv_t: torch.Tensor | QuantLinear  # [H, (Hq + 2 Hkv) D]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_t: torch.Tensor | QuantLinear  # [Hq D, H]
    o_bias: torch.Tensor | None
    gate_up_t: torch.Tensor | QuantLinear  # [H, 2 I]
    gate_up_bias: torch.Tensor | None
    down_t: torch.Tensor | QuantLinear  # [I, H]
    down_bias: torch.Tensor | None


COMPACT = (QuantMatrix, DeviceMatrix)  # weight matrices not kept as float W^T tensors


class _Matrix(ctypes.Structure):  # native/kvpage.h's kvp_matrix
    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("int8", ctypes.c_int32), ("data", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("perm", ctypes.c_void_p)]


class _Layer(ctypes.Structure):  # native/kvpage.h's kvp_layer
    _fields_ = [("hidden", ctypes.c_int32), ("q_size", ctypes.c_int32), ("kv_size", ctypes.c_int32),
                ("inter", ctypes.c_int32), ("eps", ctypes.c_float)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("norm_attn", "norm_mlp", "qkv_bias", "o_bias", "gate_up_bias",
                                                      "down_bias")]
    _fields_ += [(name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")]
    _fields_ += [("head_dim", ctypes.c_int32)]


class NativeLayer:
    """A layer's weights as native/layer.c reads them: the rows of decode steps and batches go
    through two native calls a layer (`pre`: norm and Q/K/V; `post`: output projection, residual,
    norm, MLP, residual) instead of a dozen torch operations and seven kernel calls. For the
    llama family (RMSNorm, SiLU) on compact weights; the tensors it points into are kept alive."""

    def __init__(self, lib, spec: ModelSpec, w: "LayerWeights", activations: str) -> None:
        self.lib = lib
        self.keep: list = []

        def pointer(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.float().contiguous()
            self.keep.append(t)
            return t.data_ptr()

        def matrix(m: QuantMatrix) -> _Matrix:
            perm = None
            if m.out_perm is not None:
                perm = m.out_perm.to(torch.int64).contiguous()
                self.keep.append(perm)
            return _Matrix(m.qtype, m.rows, m.cols, int(m.rounds_activations(activations)), m._addr, m.data.shape[1],
                           perm.data_ptr() if perm is not None else None)

        (q, k, v), (gate, up), (o,), (down,) = (w.qkv_t.parts, w.gate_up_t.parts, w.o_t.parts, w.down_t.parts)
        self.q_size, self.kv_size = q.rows, k.rows
        self.layer = _Layer(spec.hidden_size, q.rows, k.rows, gate.rows, spec.rms_eps,
                            pointer(w.norm_attn), pointer(w.norm_mlp), pointer(w.qkv_bias), pointer(w.o_bias),
                            pointer(w.gate_up_bias), pointer(w.down_bias),
                            matrix(q), matrix(k), matrix(v), matrix(o), matrix(gate), matrix(up), matrix(down),
                            spec.head_dim)
        self.ref = ctypes.byref(self.layer)

    def pre(self, h: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
            tiles: bool = False) -> torch.Tensor:
        """h: [M, hidden] fp32 contiguous -> Q, K, V of norm(h): [M, q + 2 kv]; with cos and sin
        ([M, head_dim] fp32 contiguous) Q and K rotated as `apply_rope` rotates them, bit for bit.
        tiles: products on AMX tiles where they apply (see Rows)."""
        out = torch.empty(h.shape[0], self.q_size + 2 * self.kv_size)
        self._check(self.lib.kvp_layer_pre(self.ref, h.data_ptr(), h.shape[0], None if cos is None else cos.data_ptr(),
                                           None if sin is None else sin.data_ptr(), out.data_ptr(), int(tiles)))
        return out

    def post(self, h: torch.Tensor, a: torch.Tensor, tiles: bool = False) -> torch.Tensor:
        """The layer's output for h [M, hidden] and attention's a [M, q] (h is not changed)."""
        out = h.clone()
        a = a.float().contiguous()
        self._check(self.lib.kvp_layer_post(self.ref, out.data_ptr(), a.data_ptr(), h.shape[0], int(tiles)))
        return out

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"the native layer kernel failed ({rc})")


class ModelRunner:
    """weights: the matrices' format: "float32" (W^T tensors of `dtype`, fused), or "bfloat16",
    "int8", "int4" (made at load) or "gguf" (the tensors are already QuantMatrix): QuantLinear,
    run by the native CPU kernels, or with `kernels` (kvpage_kernels: the Triton backend's)
    decoded once at load into DeviceMatrix parts multiplied by the Triton dequantize-in-register
    kernel. shard: this process's part of a tensor-parallel model (parallel.py); `spec` is then
    the rank's own (its heads, its part of the MLP) and `full_spec` the model's."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], rope: dict[str, RopeParams],
                 dtype: torch.dtype, device: torch.device, native_lib=None, weights: str = "float32",
                 shard: Shard | None = None, activations: str = "float32", kernels=None) -> None:
        self.full_spec = spec
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self._space: torch.Tensor | None = None  # forward's buffer for long parts' gate and up products
        self.rope = rope
        # the same frequencies on the compute device: a step computes its cos/sin with no copy (a
        # copy from the host inside a step would stop a CUDA graph's capture)
        self.rope_on_device = {key: RopeParams(p.inv_freq.to(device), p.attention_scaling) for key, p in rope.items()}
        self.weights = weights
        self.native = native_lib if device.type == "cpu" else None
        compact = weights != "float32" or any(isinstance(t, QuantMatrix) for t in tensors.values())
        if shard is not None:
            shard.check(spec)
            if compact and weights != "gguf":  # made from whole rows, then split: a rank's values are one process's
                made: dict[int, QuantMatrix] = {}  # a tied LM head is the embedding's matrix, made once
                for name, t in list(tensors.items()):
                    if _is_matrix(name, t):
                        if id(t) not in made:
                            made[id(t)] = quantize(t, weights)
                        tensors[name] = made[id(t)]
            tensors = shard.split(tensors, spec)
            spec = shard.local_spec(spec)
        self.spec = spec
        if compact and (native_lib is None or (kernels is None and self.native is None)):
            raise ModelError(f"{weights} weights are read (or decoded at load) by the native kernels, which this "
                             f"engine does not have (device {device.type}); use float32 weights")
        if activations == "int8" and (not compact or weights == "bfloat16"):
            raise UsageError(f"int8 activations multiply quantized weights (gguf, int8, int4), not {weights} weights")
        if activations == "int8" and kernels is not None:
            raise UsageError("int8 activations run on the native CPU kernels, not on the Triton kernels")
        self.activations = activations  # per matrix: QuantMatrix.rounds_activations

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            tensor = tensors.get(name)
            if tensor is None:
                if required:
                    raise ModelError(f"the weights have no tensor {name}")
                return None
            if isinstance(tensor, QuantMatrix):
                raise ModelError(f"the weights' tensor {name} is a {tensor.format} matrix where a vector belongs")
            return tensor.to(device=device, dtype=dtype)

        def matrix(name: str) -> QuantMatrix:
            tensor = tensors.get(name)
            if tensor is None:
                raise ModelError(f"the weights have no tensor {name}")
            return tensor if isinstance(tensor, QuantMatrix) else quantize(tensor, weights)

        def transposed(*names: str) -> torch.Tensor | QuantLinear:
            if compact:
                return QuantLinear([matrix(n) for n in names])
            parts = [get(n) for n in names]
            return torch.cat(parts, 0).t().contiguous()

        def bias(*names: str) -> torch.Tensor | None:
            parts = [get(n, required=False) for n in names]
            if all(p is None for p in parts):
                return None
            sizes = [tensors[n.replace(".bias", ".weight")].shape[0] for n in names]
            return torch.cat([p if p is not None else torch.zeros(s, dtype=dtype, device=device) for p, s in zip(parts, sizes)])

        self.layers: list[LayerWeights] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(LayerWeights(
                norm_attn=get(p + "input_layernorm.weight"),
                norm_mlp=get(p + ("pre_feedforward_layernorm.weight" if spec.gemma_norms else "post_attention_layernorm.weight")),
                norm_post_attn=get(p + "post_attention_layernorm.weight") if spec.gemma_norms else None,
                norm_post_mlp=get(p + "post_feedforward_layernorm.weight") if spec.gemma_norms else None,
                qkv_t=transposed(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                qkv_bias=bias(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                q_norm=get(attn + "q_norm.weight") if spec.qk_norm else None,
                k_norm=get(attn + "k_norm.weight") if spec.qk_norm else None,
                o_t=transposed(attn + "o_proj.weight"),
                o_bias=get(attn + "o_proj.bias", required=False),
                gate_up_t=transposed(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                gate_up_bias=bias(mlp + "gate_proj.bias", mlp + "up_proj.bias"),
                down_t=transposed(mlp + "down_proj.weight"),
                down_bias=get(mlp + "down_proj.bias", required=False),
            ))
        self.final_norm = get("model.norm.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise ModelError("the weights have no tensor model.embed_tokens.weight")
        head = tensors.get("lm_head.weight")
        tied = spec.tie_embeddings or head is None or head is embed
        if compact:
            self.embed = matrix("model.embed_tokens.weight")  # rows dequantized as tokens come
            self.lm_head_t = QuantLinear([self.embed if tied else matrix("lm_head.weight")])
            self.vocab = self.lm_head_t.out_features
        elif tied:
            self.lm_head_t = embed.to(device=device, dtype=dtype).t().contiguous()  # [H, V]
            self.embed = None  # rows are read as columns of lm_head_t
        else:
            self.lm_head_t = head.to(device=device, dtype=dtype).t().contiguous()
            self.embed = embed.to(device=device, dtype=dtype)
        if not compact:
            self.vocab = self.lm_head_t.shape[1]
        self.embed_scale = (
            torch.tensor(spec.embed_scale, dtype=dtype, device=device) if spec.embed_scale is not None else None
        )
        if compact and kernels is not None:
            self._to_device_matrices(native_lib, kernels)
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self._split = (q_size, kv_size, kv_size)
        # the rows of decode steps and batches run each layer in two native calls where the layer
        # is one layer.c computes: llama-family norms and MLP, compact weights read by the native
        # kernels, fp32, one process
        fused = (compact and self.native is not None and kernels is None and shard is None and dtype == torch.float32
                 and not spec.gemma_norms and spec.activation == "silu")
        self.native_layers = [NativeLayer(self.native, spec, w, activations) for w in self.layers] if fused else None

    def _to_device_matrices(self, lib, kernels) -> None:
        """Every QuantMatrix decoded for the Triton kernels (a tied LM head stays the embedding's)."""
        made: dict[int, DeviceMatrix] = {}

        def convert(m: QuantMatrix) -> DeviceMatrix:
            if id(m) not in made:
                made[id(m)] = DeviceMatrix(m, lib, self.device, kernels)
            return made[id(m)]

        for layer in self.layers:
            for name in ("qkv_t", "o_t", "gate_up_t", "down_t"):
                linear = getattr(layer, name)
                linear.parts = [convert(p) for p in linear.parts]
        self.lm_head_t.parts = [convert(p) for p in self.lm_head_t.parts]
        self.embed = convert(self.embed)

    def linear(self, x: torch.Tensor, w_t: torch.Tensor | QuantLinear, rows: Rows,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [N, in] @ w_t: [in, out], part by part (see Rows); out: where a quantized product of
        one part may be written (QuantLinear)."""
        if len(rows.parts) == 1:
            return self._part(x, w_t, *rows.parts[0][1:], out=out)
        return torch.cat([self._part(x[part], w_t, small, tiles) for part, small, tiles in rows.parts])

    def _part(self, x: torch.Tensor, w_t: torch.Tensor | QuantLinear, small: bool, tiles: bool,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w_t, QuantLinear):
            return w_t(self.native, x, small, self.activations, tiles, out=out).to(x.dtype)
        if small and self.native is not None:
            return native.gemm_rows(self.native, x.float().contiguous(), w_t).to(x.dtype)
        return matmul_nt(x.contiguous(), w_t.t())

    def _matrices(self) -> list:
        """Each weight matrix once: W^T tensors (float32), or the QuantMatrix parts of QuantLinears
        (a tied LM head shares the embedding's)."""
        seen, matrices = set(), []
        linears = [self.lm_head_t] + ([self.embed] if self.embed is not None else [])
        for layer in self.layers:
            linears += [layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t]
        for linear in linears:
            for part in (linear.parts if isinstance(linear, QuantLinear) else [linear]):
                if id(part) not in seen:
                    seen.add(id(part))
                    matrices.append(part)
        return matrices

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the runner reads (a GGUF file's mapped blocks included)."""
        vectors = [self.final_norm] + [t for layer in self.layers for name, t in vars(layer).items()
                                       if t is not None and name not in ("qkv_t", "o_t", "gate_up_t", "down_t")]
        return sum(self.weight_formats().values()) + sum(t.numel() * t.element_size() for t in vectors)

    def weight_values(self) -> int:
        """Number of values in the weight matrices (vectors not counted)."""
        return sum(m.rows * m.cols if isinstance(m, COMPACT) else m.numel() for m in self._matrices())

    def weight_formats(self) -> dict[str, int]:
        """Bytes of the weight matrices by format ("float32", "Q4_1", "int8", ...), largest first."""
        sizes: dict[str, int] = {}
        for m in self._matrices():
            if isinstance(m, COMPACT):
                name, size = m.format, m.nbytes
            else:
                name, size = str(m.dtype).removeprefix("torch."), m.numel() * m.element_size()
            sizes[name] = sizes.get(name, 0) + size
        return dict(sorted(sizes.items(), key=lambda item: -item[1]))

    def int8_activation_formats(self) -> list[str]:
        """The weight formats whose products round activations to int8 under EngineConfig.activations
        (none on the Triton kernels, which multiply float32 activations)."""
        return sorted({m.format for m in self._matrices()
                       if isinstance(m, QuantMatrix) and m.rounds_activations(self.activations)})

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as the architecture does it (Gemma: (1 + w), scaled in fp32 before the cast)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)
        if self.spec.gemma_norms:
            return (h * (1.0 + weight.float())).to(x.dtype)
        return weight * h.to(x.dtype)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] -> hidden: [T, H]. Split by vocabulary, a rank gives the rows of its
        tokens and zeros for the others', and the sum over ranks is every row (exactly: one term
        is not zero)."""
        if self.shard is None:
            h = self._embed_rows(token_ids)
        else:
            vocab = self.shard.vocab(self.full_spec)
            mine = (token_ids >= vocab.start) & (token_ids < vocab.stop)
            h = self._embed_rows(torch.where(mine, token_ids - vocab.start, 0))
            h = self.shard.all_reduce(torch.where(mine.unsqueeze(-1), h, torch.zeros((), dtype=h.dtype)))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        return h.contiguous()

    def _embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, COMPACT):
            rows = token_ids.cpu() if isinstance(self.embed, QuantMatrix) else token_ids
            h = self.embed.take(self.native, rows).to(device=self.device, dtype=self.dtype)
        elif self.embed is not None:
            h = self.embed[token_ids]
        else:
            h = self.lm_head_t[:, token_ids].t()
        return h

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: Rows,
        write_kv: Callable[[int, torch.Tensor, torch.Tensor, "RopeAt"], None],
        attend: Callable[[int, torch.Tensor], torch.Tensor],
        logit_rows: torch.Tensor,
        logit_groups: Rows,
    ) -> torch.Tensor:
        """Runs N rows (tokens of one or several sequences, each at its position) through every layer.

        write_kv(layer, k [N, Hkv, D], v [N, Hkv, D], rope) stores them, K rotated (by
        `rope.apply`: a no-op where the native layer rotated it);
        attend(layer, q [N, Hq, D] rotated) -> [N, Hq, D] attends each row over its own context,
        the step's rows included. Returns fp32 logits [len(logit_rows), V] of the rows asked for
        (grouped for the LM head as `logit_groups`).
        """
        self._space = _NO_SPACE if self.device.type == "cpu" else None  # a buffer is made by the first long part
        try:
            return self._forward(token_ids, positions, rows, write_kv, attend, logit_rows, logit_groups)
        finally:
            self._space = None

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: Rows, write_kv, attend,
                 logit_rows: torch.Tensor, logit_groups: Rows) -> torch.Tensor:
        spec = self.spec
        num_tokens = token_ids.shape[0]
        cos_sin = {key: rope_cos_sin(params, positions, self.dtype) for key, params in self.rope_on_device.items()}
        h = self.embed_tokens(token_ids)
        for i, (layer_spec, w) in enumerate(zip(spec.layers, self.layers)):
            cos, sin = cos_sin[layer_spec.rope_key]
            qkv, rotated = self._pre(i, h, w, rows, cos, sin)
            q, k, v = qkv.split_with_sizes(self._split, dim=-1)
            q = q.view(num_tokens, spec.num_heads, spec.head_dim)
            k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
            v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
            if w.q_norm is not None:
                q = self.norm(q, w.q_norm)
                k = self.norm(k, w.k_norm)
            if not rotated:
                q = apply_rope(q, cos, sin)
            write_kv(i, k, v, RopeAt(cos, sin, self.rope[layer_spec.rope_key], positions, k_rotated=rotated))
            a = attend(i, q).to(self.dtype).reshape(num_tokens, spec.num_heads * spec.head_dim)
            h = self._post(i, h, a, w, rows)
        self._space = None  # let go before the LM head, when every layer's weights are resident
        if logit_rows.numel() == 0:  # prompt chunks before their last: no logits wanted
            return torch.empty(0, self.vocab if self.shard is None else self.full_spec.vocab_size)
        last = h[logit_rows]
        logits = self.linear(self.norm(last, self.final_norm), self.lm_head_t, logit_groups).float()
        if self.shard is not None:  # each rank's columns of the vocabulary
            logits = self.shard.all_gather_vocab(logits, self.full_spec)
        if spec.final_logit_softcap:
            cap = spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _pre(self, i: int, h: torch.Tensor, w: LayerWeights, rows: Rows, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Q, K, V of norm(h): [N, q + 2 kv], and whether Q and K are rotated already: small parts
        go through the native layer where there is one, which rotates them too where the model
        has no Q/K norms (those come between the projection and RoPE); long parts beside them
        are then rotated here, so that every row leaves alike."""
        if self.native_layers is None:
            return self._pre_torch(h, w, rows), False
        layer = self.native_layers[i]
        rope = w.q_norm is None and any(small for _, small, _ in rows.parts)
        if len(rows.parts) == 1 and rope:  # a decode step: every row in one native call
            return layer.pre(h.contiguous(), cos, sin, tiles=rows.parts[0][2]), True

        def part_pre(part: slice, small: bool, tiles: bool) -> torch.Tensor:
            if small:
                if rope:
                    return layer.pre(h[part].contiguous(), cos[part], sin[part], tiles=tiles)
                return layer.pre(h[part].contiguous(), tiles=tiles)
            qkv = self._pre_torch(h[part], w, _ONE_LONG)
            return self._rotated(qkv, cos[part], sin[part]) if rope else qkv

        parts = [part_pre(*part) for part in rows.parts]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), rope

    def _rotated(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[n, q + 2 kv] with Q and K rotated (V as it was)."""
        spec, n = self.spec, qkv.shape[0]
        q, k, v = qkv.split(self._split, dim=-1)
        q = apply_rope(q.reshape(n, spec.num_heads, spec.head_dim), cos, sin).reshape(n, -1)
        k = apply_rope(k.reshape(n, spec.num_kv_heads, spec.head_dim), cos, sin).reshape(n, -1)
        return torch.cat((q, k, v), dim=-1)

    def _pre_torch(self, h: torch.Tensor, w: LayerWeights, rows: Rows) -> torch.Tensor:
        qkv = self.linear(self.norm(h, w.norm_attn), w.qkv_t, rows)
        return qkv + w.qkv_bias if w.qkv_bias is not None else qkv

    def _post(self, i: int, h: torch.Tensor, a: torch.Tensor, w: LayerWeights, rows: Rows) -> torch.Tensor:
        """The layer's output from h and attention's output a: [N, hidden]."""
        if self.native_layers is None:
            return self._post_torch(h, a, w, rows)
        if len(rows.parts) == 1 and rows.parts[0][1]:
            return self.native_layers[i].post(h.contiguous(), a, tiles=rows.parts[0][2])
        parts = [self.native_layers[i].post(h[part].contiguous(), a[part], tiles=tiles) if small
                 else self._post_torch(h[part], a[part], w, _ONE_LONG) for part, small, tiles in rows.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _post_torch(self, h: torch.Tensor, a: torch.Tensor, w: LayerWeights, rows: Rows) -> torch.Tensor:
        spec = self.spec
        a = self.linear(a, w.o_t, rows)
        if self.shard is not None:  # each rank's heads give a partial sum of the projection
            a = self.shard.all_reduce(a)
        if w.o_bias is not None:
            a = a + w.o_bias
        if spec.gemma_norms:
            h = h + self.norm(a, w.norm_post_attn)
            m = self.mlp(self.norm(h, w.norm_mlp), w, rows)
            return h + self.norm(m, w.norm_post_mlp)
        h = h + a
        return h + self.mlp(self.norm(h, w.norm_mlp), w, rows)

    def _gate_up_space(self, x: torch.Tensor, w: LayerWeights, rows: Rows) -> torch.Tensor | None:
        """Where a long part's gate and up product is written during a forward pass: one buffer for
        every layer (`forward` makes it and lets it go). A fresh tensor of that size (64 MiB at a
        1B llama's 1,024-token chunk) is a new memory map whose pages fault in on first write, in
        every layer: a Q5_K product of 1,024 rows by 8,192 x 2,048 took 57 ms into the gate half of
        a fresh [1,024, 16,384] tensor and 45 ms into one written before (medians of 12, measured on
        a 2-vCPU Zen 5 VM)."""
        if (self._space is None or x.dtype != torch.float32 or len(rows.parts) != 1 or rows.parts[0][1]
                or not isinstance(w.gate_up_t, QuantLinear)):
            return None
        size = x.shape[0] * w.gate_up_t.out_features
        if self._space.numel() < size:
            self._space = torch.empty(size)
        return self._space[:size].view(x.shape[0], w.gate_up_t.out_features)

    def activation(self, gate: torch.Tensor, rows: Rows, inplace: bool = False) -> torch.Tensor:
        """The MLP's activation (SiLU or GELU-tanh) of gate [N, I], each row the bits it gets alone;
        inplace: written over gate (a view) and returned, the same bits.

        On a CPU, torch splits an elementwise operation into one chunk per thread by element count;
        a chunk that ends inside a row leaves that row's last elements to the scalar function, whose
        tanh and exp round otherwise than the vectorized one's, so a row's bits would depend on the
        rows beside it and the thread count (seen at 16 threads: SiLU over 40 rows of 2,048). The
        rows of short segments (decode tokens, short prompts: `Rows`) are therefore activated on one
        thread, each row then one vectorized loop; a long segment, always computed alone, keeps
        every thread."""
        if self.spec.activation == "gelu_tanh":
            act = partial(torch.ops.aten.gelu_ if inplace else F.gelu, approximate="tanh")
        else:
            act = partial(F.silu, inplace=inplace)
        if gate.device.type != "cpu" or torch.get_num_threads() == 1 or all(not small for _, small, _ in rows.parts):
            return act(gate)

        def one_thread(x: torch.Tensor) -> torch.Tensor:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return act(x)
            finally:
                torch.set_num_threads(threads)

        if len(rows.parts) == 1:
            return one_thread(gate)
        if inplace:
            for part, small, _ in rows.parts:
                (one_thread if small else act)(gate[part])
            return gate
        return torch.cat([one_thread(gate[part]) if small else act(gate[part]) for part, small, _ in rows.parts])

    def mlp(self, x: torch.Tensor, w: LayerWeights, rows: Rows) -> torch.Tensor:
        gate_up = self.linear(x, w.gate_up_t, rows, out=self._gate_up_space(x, w, rows))
        if w.gate_up_bias is not None:
            gate_up = gate_up + w.gate_up_bias
        gate, up = gate_up.chunk(2, dim=-1)
        # the activation is written over gate's half of gate_up and multiplied by up there, and the
        # down product reads that half in place: no [N, I] tensor more at a prompt chunk's peak
        out = self.linear(self.activation(gate, rows, inplace=True).mul_(up), w.down_t, rows)
        if self.shard is not None:
            out = self.shard.all_reduce(out)
        if w.down_bias is not None:
            out = out + w.down_bias
        return out
