"""Typed progress events. The engine reports through a callback and never prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class ModelLoading:
    """A model is being loaded; `stage` says what is happening (e.g. "dequantizing GGUF")."""

    source: str
    stage: str


@dataclass(frozen=True)
class PrefillProgress:
    """`done` of `total` prompt tokens are in the context after `elapsed_s` seconds.

    `cached` tokens came from the saved-KV cache instead of being computed."""

    done: int
    total: int
    elapsed_s: float
    cached: int = 0


@dataclass(frozen=True)
class IndexProgress:
    """Retrieval: `done` of `total` document tokens indexed (window by window) after `elapsed_s`;
    `cached` of them mapped from the saved-KV cache instead of computed."""

    done: int
    total: int
    elapsed_s: float
    cached: int = 0


@dataclass(frozen=True)
class DecodeProgress:
    """`generated` new tokens (over every sequence of the run) after `elapsed_s` seconds of
    decoding; `token_id` is the newest; `sequences` were decoding together."""

    generated: int
    elapsed_s: float
    token_id: int
    sequences: int = 1


@dataclass(frozen=True)
class BlocksMoved:
    """One load (or prefetch) of a layer's pool slots: `blocks` copied in (`bytes`), taking
    `copy_s` on the compute path (a prefetch copies on the copy engine: not counted); `waited_s`
    spent waiting for prefetched copies; `lookups` blocks asked for, `hits` already resident."""

    blocks: int
    bytes: int
    waited_s: float = 0.0
    lookups: int = 0
    hits: int = 0
    copy_s: float = 0.0


@dataclass(frozen=True)
class KVRestored:
    """`tokens` of a prompt's KV were loaded from the saved-KV cache in `seconds`."""

    tokens: int
    seconds: float


@dataclass(frozen=True)
class StepDone:
    """One forward pass: `prefill_tokens` prompt rows and `decode_tokens` generated ones in
    `seconds` (a step that runs both is one measurement; metrics split it by rows)."""

    prefill_tokens: int
    decode_tokens: int
    seconds: float
    kv_read_bytes: int = 0  # K/V bytes attention read (a block shared by several queries once)
    blocks_attended: int = 0  # selective mode: per-layer blocks its decode rows read ...
    blocks_candidate: int = 0  # ... of the live blocks they could have read


@dataclass(frozen=True)
class EngineWarning:
    """Something the user should know that does not stop the run."""

    message: str


Event = Union[ModelLoading, PrefillProgress, IndexProgress, DecodeProgress, BlocksMoved, KVRestored, StepDone,
              EngineWarning]
EventCallback = Callable[[Event], None]


def emit(callback: EventCallback | None, event: Event) -> None:
    if callback is not None:
        callback(event)
