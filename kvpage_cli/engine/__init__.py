"""The kvpage inference engine: real model weights on a paged KV cache.

    from kvpage_cli.engine import Engine, EngineConfig
    engine = Engine.load("smollm2", EngineConfig(pool_mib=16))
    ctx = engine.prefill(engine.tokenizer("A long document ...").input_ids)
    for token in engine.generate(engine.fork(ctx), question_ids, max_new_tokens=64):
        ...
"""

from .config import BLOCK_TOKENS, EngineConfig
from .engine import Engine
from .events import BlocksMoved, DecodeProgress, EngineWarning, Event, ModelLoading, PrefillProgress
from .kv.context import Context
from .kv.saved.disk import CacheEntry, KVCache
from .metrics import EngineStats
from .model.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from .model.weights import ALIASES, DEFAULT_MODEL

__all__ = [
    "ALIASES",
    "BLOCK_TOKENS",
    "BlocksMoved",
    "CacheEntry",
    "Context",
    "DEFAULT_MODEL",
    "DecodeProgress",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "EngineWarning",
    "Event",
    "KVCache",
    "ModelLoading",
    "ModelSpec",
    "PrefillProgress",
    "SUPPORTED_ARCHITECTURES",
]
