"""Triton kernels of kvpage's paged KV cache, each with its launcher and fp32 torch reference.

Installed under the import name `kvpage_kernels`. Importing it never needs Triton: without it the
launchers raise TritonUnavailableError and the `*_ref` references still work. To run the kernels on
CPU tensors, set TRITON_INTERPRET=1 before triton (and this package) is imported.
"""

from ._triton import HAS_TRITON, TritonUnavailableError
from .constants import BLOCK_TOKENS
from .dequant_matmul import dequant_matmul, dequant_matmul_ref, dequantize_ref, pack4, unpack4
from .merge_states import (
    merge_attention_states,
    merge_attention_states_ref,
    merge_ragged_states,
    merge_ragged_states_ref,
    merge_two_states,
    merge_two_states_ref,
)
from .paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from .rope_bake_store import rope_bake_store, rope_bake_store_ref, rope_k_ref
from .shared_decode_states import shared_decode_states, shared_decode_states_ref

__all__ = [
    "BLOCK_TOKENS",
    "HAS_TRITON",
    "TritonUnavailableError",
    "default_num_splits",
    "dequant_matmul",
    "dequant_matmul_ref",
    "dequantize_ref",
    "merge_attention_states",
    "merge_attention_states_ref",
    "merge_ragged_states",
    "merge_ragged_states_ref",
    "merge_two_states",
    "merge_two_states_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "pack4",
    "rope_bake_store",
    "rope_bake_store_ref",
    "rope_k_ref",
    "shared_decode_states",
    "shared_decode_states_ref",
    "unpack4",
]
