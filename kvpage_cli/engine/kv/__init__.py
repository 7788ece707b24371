"""The KV cache: 64-token blocks, the store that holds every block of a context, the pool of
slots on the compute device, the block manager that owns which block is where, and `saved/`,
blocks kept on disk between runs."""
