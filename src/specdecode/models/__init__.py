"""Model families, checkpoint loading and the speculation-ready KV cache."""
