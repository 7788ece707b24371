"""Keys of saved KV: a hash chain over a prompt's tokens, seeded by the model and how its KV is computed.

A prompt is cut into segments of `segment_tokens` tokens, a multiple of the 64-token block and of
the prefill chunk, so that a segment's K/V are the very bits a fresh prefill of any prompt that
starts with those tokens computes. Keys form a hash chain: the key after block i is
sha256(key after block i-1 + token ids of block i), starting from a seed that names the model
(`model_fingerprint`: weights, dtype, RoPE, KV format version) and how its KV was computed; a
segment is stored under the key after its last block, which covers every token before it.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from ...config import BLOCK_TOKENS

KV_FORMAT_VERSION = 1
"""Version of kvpage's KV layout (what a block holds, RoPE baked into K, the segment file format).
Part of every model fingerprint: saved KV of another version is never found."""



def model_fingerprint(weights_fingerprint: str, dtype: str, rope: dict) -> str:
    """Names a model's KV: its weights, the KV dtype, its RoPE settings and KV_FORMAT_VERSION.

    rope: rope key -> RopeParams (inverse frequencies and attention scaling)."""
    digest = hashlib.sha256(f"kvpage-kv-format-{KV_FORMAT_VERSION}|{weights_fingerprint}|{dtype}".encode())
    for key in sorted(rope):
        params = rope[key]
        digest.update(f"|{key}|{params.attention_scaling!r}|".encode())
        digest.update(params.inv_freq.to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def chain_seed(fingerprint: str, numerics: str) -> str:
    """The first link of the hash chain: the model and how its KV is computed (backend, kv path,
    prefill chunk...), so that restored KV is the bits this engine would compute itself."""
    return hashlib.sha256(f"kvpage-kv|{fingerprint}|{numerics}".encode()).hexdigest()


def _links(seed: str, token_ids: list[int]):
    """The chain's link after each whole block of `token_ids` (bytes), in order."""
    link = bytes.fromhex(seed)
    ids = np.asarray(token_ids, dtype="<i4")
    for block in range(len(token_ids) // BLOCK_TOKENS):
        link = hashlib.sha256(link + ids[block * BLOCK_TOKENS:(block + 1) * BLOCK_TOKENS].tobytes()).digest()
        yield link


def chain_keys(seed: str, token_ids: list[int], segment_tokens: int) -> list[str]:
    """Key of every whole segment of `token_ids`: keys[j] covers tokens [0, (j+1)*segment_tokens)."""
    per_segment = segment_tokens // BLOCK_TOKENS
    return [link.hex() for block, link in enumerate(_links(seed, token_ids)) if (block + 1) % per_segment == 0]


def end_key(seed: str, token_ids: list[int]) -> str:
    """Key of a whole prompt's end (`token_ids` whole blocks): the blocks after its last whole
    segment, saved for a caller that reads no logits of the prompt (a retrieval index's head). The
    chain's link after the last block, marked, so it is never a segment's key."""
    link = bytes.fromhex(seed)
    for link in _links(seed, token_ids):
        pass
    return hashlib.sha256(link + b"|prompt-end").hexdigest()


def segment_tokens_for(prefill_chunk: int) -> int:
    """Segment length: whole blocks and whole prefill chunks (then restored KV is bit-identical)."""
    return math.lcm(BLOCK_TOKENS, prefill_chunk)
