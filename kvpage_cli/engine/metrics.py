"""Throughput and movement counters, and the stats a caller reads from the engine."""

from __future__ import annotations

from dataclasses import dataclass


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
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Metrics:
    """Counters the engine adds to at step boundaries."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_tokens = 0
        self.decode_seconds = 0.0

    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds

    def add_decode(self, tokens: int, seconds: float) -> None:
        self.decode_tokens += tokens
        self.decode_seconds += seconds
