"""The one definition of the block size (tokens per block)."""

BLOCK_TOKENS = 64
