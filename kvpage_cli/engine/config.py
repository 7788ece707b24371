"""Engine configuration: one frozen dataclass, built by the CLI or a library user."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage_kernels.constants import BLOCK_TOKENS  # tokens per block: the unit of KV storage, movement and selection

DEFAULT_POOL_MIB = 64.0  # the pool where EngineConfig.pool_mib is None, on a CPU (and the least on a GPU)
GPU_POOL_SHARE = 0.25  # ... on a GPU: this share of the device memory free when the engine loads

SMALL_ROWS = 64
"""Segments of at most this many rows share one row-independent linear call (weight-bandwidth
bound); longer ones are compute bound and get a matrix multiplication each. Their attention, too,
gives each row what it gives alone (dispatch: a short prompt segment's rows as decode queries where
the backend's prompt attention would not)."""

TILE_MIN_ROWS = 8
"""Products of this many rows or more may multiply on AMX tiles where the CPU has them (native/tiles.c
gets it at build time): per matrix 1.2-1.6x the rows' path at 8 rows (a throwaway script); stop 40's
prototype was even at 4 rows and slower at 1."""

TILE_RUN_BLOCKS = 8
"""A batch's generated tokens attend up to this many consecutive blocks that they all read whole in
one pass on AMX tiles (native/prefill.c's kvp_decode_tiles), one state per query for the pass
rather than one per block. 16 queries over 16 and 128 shared blocks, the states and their merge
per layer (a throwaway script, SmolLM2's heads, the Sapphire Rapids VM): 0.19 and 1.57 ms with 8
against 0.31 and 2.94 a block at a time; 4: 0.21 and 1.72; 16: 0.24 and 1.53 (16 blocks are then
one pass a KV head, three for two threads). bench/native_attention.py has the 8 beside 1."""

MODES = ("auto", "exact", "selective", "retrieval")
DTYPES = ("float32", "bfloat16")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")
WEIGHTS = ("auto", "float32", "bfloat16", "int8", "int4", "gguf")
ACTIVATIONS = ("auto", "float32", "int8")
BACKENDS = ("auto", "torch", "native", "triton")
KV_PATHS = ("auto", "pool", "store")
DEVICES = ("auto", "cpu", "cuda")
DECODE_STEPS = ("auto", "graph", "eager", "host")
# 20 GiB of disk: the index of about 460K tokens for SmolLM2 (45 KiB of float32 KV a token), so that
# `ask repo/` indexes once and answers the next questions from the saved windows
DEFAULT_CACHE_MIB = 20480.0

POLICIES = ("lru", "quest", "draft", "scores")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    pool_mib: size of the slot pool on the compute device, in MiB, for all layers together.
        It does not depend on the context length. None (the default): DEFAULT_POOL_MIB on a CPU
        (whose attention reads most blocks where they lie in the store); on a GPU, GPU_POOL_SHARE
        of the device memory free when the engine loads (at least DEFAULT_POOL_MIB, at most the KV
        of max_batch sequences of max_context tokens), so that the blocks a step reads stay
        resident and the step runs on the device (device_step.py).
    mode: "exact" (every block takes part in every step), "selective" (the policy's blocks plus
        the always-kept ones), "retrieval" (a document longer than the context is indexed window
        by window and each question reads the blocks chosen for it; see index.py) or "auto"
        (exact when the prompt fits the model's context, retrieval when it does not). The engine
        attends exactly in all but selective mode; the tasks build retrieval on it.
    dtype: "float32" or "bfloat16" for weights, activations and KV.
    kv_dtype: the KV blocks' element type where it differs from `dtype`: "bfloat16" halves the
        bytes every decode step reads (and the store, the pool and the saved KV) while weights and
        activations stay fp32; K and V are rounded to bfloat16 as they are written, and attention
        computes in fp32 from them. "int8": each K and V row (one token, one KV head) is kept as
        int8 with its own float32 scale (largest magnitude / 127), carried in the block: about a
        quarter of fp32's bytes; attention computes in fp32 from the rows times their scales.
        "auto": bfloat16 where the weights are kept quantized (any `weights` but float32) and the
        backend is not Triton, else `dtype`. Chosen by measurement (docs/models.md):
        beside 4-bit weights bfloat16 KV changed no greedy token in 128 at 1K-8K, no pass key at 8K
        and no finding of the sample review, and halves the memory KV takes. "float32" keeps
        every row as computed: the engine's logits then match transformers' fp32 ones (tests).
        bfloat16 and int8 on the native and torch backends.
    weights: the format the weight matrices are kept and read in: "float32" (of `dtype`),
        "gguf" (a GGUF file's own quantized blocks, memory-mapped from the file), or made at
        load: "bfloat16", "int8" (a scale per output channel), "int4" (groups of 32). All but
        float32 run on the native CPU kernels. "auto": gguf for a GGUF source where the native
        kernels run, else float32 (bench/engine.py --weights measures the choice).
    activations: what quantized weights (gguf, int8, int4) are multiplied with: "float32" (the
        weights' values times the fp32 activations: the model the weights dequantized to fp32
        describe), "int8" (each activation row rounded to int8 as llama.cpp rounds it, in groups of
        32, of 256 for the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and integer dot products:
        AVX-VNNI / AVX-512 VNNI where the CPU has them, AVX2 or portable C where not; faster, and
        its logits differ by that rounding; a row's bits still its own, whatever the rows beside it) or
        "auto", the default (int8 for K-quant matrices, float32 for the others: on Gemma 3 270M's
        Q4_K_M file, greedy tokens over the sample contract stay with float32 activations' longer
        than llama.cpp's do, bench/quant_models.py --agreement). Decode steps and batches round; a
        prefill chunk's products round for K-quants (read from their blocks on VNNI tiles), and
        multiply fp32 activations for other formats.
    backend: "auto" (Triton on CUDA for the head sizes its kernels take, 64, 128 and 256, else
        torch; the native CPU kernels on CPU when a C compiler is available, else torch), "torch",
        "native" or "triton".
    device: "auto" (CUDA when torch sees a GPU, else the CPU; the CPU when backend "native" or
        kv_path "store", which run there alone, is asked for), "cpu" or "cuda".
    prefill_chunk: prompt tokens processed per forward pass during prefill (1024: as fast as one
        pass over a whole 1K-4K prompt, measured by bench/engine.py; also the saved KV's granularity).
    max_context: the longest context allowed, in tokens; None means the model's own limit.
    kv_path: how exact mode reaches blocks: "pool" streams every block through the pool slots;
        "store" reads blocks where they are in the store (only where the store is in the
        compute device's memory, i.e. on CPU); "auto" picks "store" on CPU and "pool" elsewhere.
    threads: torch/native CPU threads (None: leave torch's default).
    home: folder for caches (converted weights, saved KV); None means ~/.cache/kvpage.
    policy, recent_blocks: selective mode's residency policy and the number of most recent
        blocks always kept.
    draft_layers, draft_model: the "draft" policy ranks blocks by the attention of a draft: a
        separate model with the same tokenizer (draft_model: alias, folder or .gguf) decoding
        alongside, or, when draft_model is None, the model's own first `draft_layers` layers.
    host_mib: bound on the host RAM the store may use (None: no bound); blocks beyond it live in
        memory-mapped files under `home/tmp` (removed when the process ends) and are read back on
        demand. Values are the same bits wherever a block lives.
    kv_cache: save documents' blocks after a prefill under `home/kv/` and reuse them when a later
        prompt starts with the same tokens (see `kv/saved/`).
    cache_mib: size limit of that cache; least recently used entries are evicted beyond it.
    max_batch: the most sequences `Engine.run` advances in one forward pass (continuous batching).
    retrieval_tokens: retrieval mode's budget: the most document tokens a question attends (also
        bounded by the model's context and, where attention reads blocks through the pool, by the
        pool's slots: tasks/retrieval.question_budget).
    tp: tensor-parallel ranks: the model's heads and MLP split over `tp` processes of a running
        torch.distributed process group (parallel.py), each holding the KV of its own heads.
    decode_step: how decode steps over blocks read through the pool run (device_step.py): "graph"
        (one upload and one readback a step, captured as a CUDA graph per padded batch size; eager
        where capture fails or on a CPU), "eager" (the same step without capture), "host" (the
        per-layer path, which plans and copies blocks on the host as it goes) or "auto" (graph on
        CUDA, host elsewhere). Steps the device path does not take run on the host path anyway.
    """

    pool_mib: float | None = None
    mode: str = "auto"
    dtype: str = "float32"
    kv_dtype: str = "auto"
    weights: str = "auto"
    activations: str = "auto"
    backend: str = "auto"
    device: str = "auto"
    prefill_chunk: int = 1024
    max_context: int | None = None
    kv_path: str = "auto"
    threads: int | None = None
    home: str | None = None
    policy: str = "scores"
    recent_blocks: int = 2
    draft_layers: int = 2
    draft_model: str | None = None
    host_mib: float | None = None
    kv_cache: bool = False
    cache_mib: float = DEFAULT_CACHE_MIB
    max_batch: int = 16
    retrieval_tokens: int = 4096
    seed: int = 0
    tp: int = 1
    decode_step: str = "auto"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _check_choice("weights", self.weights, WEIGHTS)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("kv_path", self.kv_path, KV_PATHS)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("activations", self.activations, ACTIVATIONS)
        _check_choice("decode_step", self.decode_step, DECODE_STEPS)
        if self.pool_mib is not None and not self.pool_mib > 0:
            raise ValueError(f"pool_mib must be positive, got {self.pool_mib}")
        if not 16 <= self.prefill_chunk <= 4096:
            raise ValueError(f"prefill_chunk must be between 16 and 4096 tokens, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be at least 1, got {self.max_context}")
        if self.recent_blocks < 0:
            raise ValueError(f"recent_blocks must be >= 0, got {self.recent_blocks}")
        if self.host_mib is not None and self.host_mib < 0:
            raise ValueError(f"host_mib must be >= 0, got {self.host_mib}")
        if self.retrieval_tokens < BLOCK_TOKENS:
            raise ValueError(f"retrieval_tokens must be at least {BLOCK_TOKENS}, got {self.retrieval_tokens}")
        if not 1 <= self.max_batch <= 1024:
            raise ValueError(f"max_batch must be between 1 and 1024, got {self.max_batch}")
        if not 1 <= self.tp <= 64:
            raise ValueError(f"tp must be between 1 and 64 ranks, got {self.tp}")
        if not self.cache_mib > 0:
            raise ValueError(f"cache_mib must be positive, got {self.cache_mib}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def kv_dtype_of(config: EngineConfig, weights: str, backend: str) -> str:
    """The KV blocks' element type: kv_dtype; where it is auto, bfloat16 beside weights kept
    quantized (`weights`: the format load chose) except on the Triton backend, else dtype."""
    if config.kv_dtype != "auto":
        return config.kv_dtype
    return "bfloat16" if weights != "float32" and backend != "triton" else config.dtype


def default(name: str):
    """The default of an EngineConfig field (the CLI's defaults come from here)."""
    return EngineConfig.__dataclass_fields__[name].default
