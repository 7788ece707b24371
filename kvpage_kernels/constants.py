"""The one definition of what the kernels and the engine share: the block size (tokens per block)
and the head sizes the attention kernels take."""

BLOCK_TOKENS = 64

HEAD_DIMS = (64, 128, 256)
