"""A model: its spec, weights (Hugging Face folders, GGUF files, quantized matrices), rotary
embedding, forward pass (the runner) and its split over tensor-parallel ranks."""
