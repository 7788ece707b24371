"""Attention over blocks: the torch reference, the backends that implement it (native, Triton,
torch), the dispatch that plans which blocks a step reads, and the selection policies."""
