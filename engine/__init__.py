"""The serving engine: a PyTorch LLM server with continuous batching over a paged KV cache."""
