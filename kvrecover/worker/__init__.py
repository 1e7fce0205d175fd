"""Worker side: KV cache tensors, attention backends and the model runner."""
