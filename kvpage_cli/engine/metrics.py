"""Throughput and movement counters, and the stats a caller reads from the engine."""

from __future__ import annotations

from dataclasses import dataclass

from .events import BlocksMoved, KVRestored, StepDone


@dataclass(frozen=True)
class EngineStats:
    """Measured figures since the engine was loaded (or since `reset_stats`)."""

    backend: str
    kv_path: str
    mode: str
    pool_bytes: int  # slots allocated on the compute device (0 until the pool is first used)
    pool_slots_per_layer: int
    store_bytes: int  # blocks in use by live contexts
    store_reserved_bytes: int  # arenas allocated
    weight_bytes: int
    blocks_moved: int
    bytes_moved: int
    pool_hit_rate: float | None
    copy_seconds: float
    copy_wait_seconds: float  # time attention waited for a prefetched copy (selective mode, pool path)
    blocks_attended: int  # per-layer blocks read by decode steps (selective mode)
    blocks_candidate: int  # per-layer live blocks those steps could have read
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    store_disk_bytes: int = 0  # of store_bytes, the blocks in the disk tier (the rest are in RAM)
    cached_tokens: int = 0  # prompt tokens whose KV was loaded from the saved-KV cache
    cache_load_seconds: float = 0.0  # reading and checking saved KV (not in prefill_seconds)
    kv_read_bytes: int = 0  # K/V bytes attention read (a block shared by a step's sequences counted once)

    @property
    def store_ram_bytes(self) -> int:
        return self.store_bytes - self.store_disk_bytes

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Metrics:
    """The engine's one stats object: counters folded from the events it emits. Steps (StepDone:
    rows, seconds, KV read, selective mode's choices), pool loads (BlocksMoved: copies, hits) and
    saved-KV loads (KVRestored). A step that runs prompt rows and decode rows together is one
    measurement: its seconds are split between prefill and decode by their rows."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.cached_tokens = 0
        self.cache_load_seconds = 0.0
        self.blocks_moved = 0
        self.bytes_moved = 0
        self.copy_seconds = 0.0
        self.copy_wait_seconds = 0.0
        self.lookups = 0
        self.hits = 0
        self.kv_read_bytes = 0
        self.blocks_attended = 0
        self.blocks_candidate = 0

    def on_event(self, event) -> None:
        if isinstance(event, BlocksMoved):
            self.blocks_moved += event.blocks
            self.bytes_moved += event.bytes
            self.copy_seconds += event.copy_s
            self.copy_wait_seconds += event.waited_s
            self.lookups += event.lookups
            self.hits += event.hits
        elif isinstance(event, StepDone):
            rows = event.prefill_tokens + event.decode_tokens
            self.prefill_tokens += event.prefill_tokens
            self.decode_tokens += event.decode_tokens
            self.prefill_seconds += event.seconds * event.prefill_tokens / rows if rows else 0.0
            self.decode_seconds += event.seconds * event.decode_tokens / rows if rows else 0.0
            self.kv_read_bytes += event.kv_read_bytes
            self.blocks_attended += event.blocks_attended
            self.blocks_candidate += event.blocks_candidate
        elif isinstance(event, KVRestored):
            self.cached_tokens += event.tokens
            self.cache_load_seconds += event.seconds

    @property
    def pool_hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None
