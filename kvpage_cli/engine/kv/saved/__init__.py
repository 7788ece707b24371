"""Saved KV: a prompt's blocks on disk, found again by a hash chain over its tokens."""
