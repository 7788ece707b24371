"""Triton kernels of kvpage's paged KV cache, each with its launcher and fp32 torch reference.

Installed under the import name `kvpage_kernels`. Importing it never needs Triton: without it the
launchers raise TritonUnavailableError and the `*_ref` references still work. To run the kernels on
CPU tensors, set TRITON_INTERPRET=1 before triton (and this package) is imported.
"""

from importlib import import_module

# Where each public name lives. They are bound on first use (PEP 562), so that importing a
# submodule such as `kvpage_kernels.constants` does not import Triton (about 3 s on a small CPU,
# paid by every `kvpage` command, `--help` included).
_MODULES = {
    "HAS_TRITON": "_triton", "TritonUnavailableError": "_triton",
    "BLOCK_TOKENS": "constants",
    **dict.fromkeys(("dequant_matmul", "dequant_matmul_ref", "dequantize_ref", "pack4", "unpack4"), "dequant_matmul"),
    **dict.fromkeys(("merge_attention_states", "merge_attention_states_ref", "merge_ragged_states",
                     "merge_ragged_states_ref", "merge_two_states", "merge_two_states_ref"), "merge_states"),
    **dict.fromkeys(("default_num_splits", "paged_decode_attention", "paged_decode_attention_ref"),
                    "paged_decode_attention"),
    **dict.fromkeys(("paged_prefill_attention", "paged_prefill_attention_ref"), "paged_prefill_attention"),
    **dict.fromkeys(("rope_bake_store", "rope_bake_store_ref", "rope_k_ref"), "rope_bake_store"),
    **dict.fromkeys(("shared_decode_states", "shared_decode_states_ref"), "shared_decode_states"),
}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Every name at once: some launchers share their module's name (paged_decode_attention), and
    # importing a module binds it on the package, over a function bound earlier.
    modules = {module: import_module(f".{module}", __name__) for module in set(_MODULES.values())}
    for public, module in _MODULES.items():
        globals()[public] = getattr(modules[module], public)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULES))


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
