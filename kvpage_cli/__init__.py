"""kvpage: long-document analysis with a local language model on a paged KV cache."""

__version__ = "0.1.0"
