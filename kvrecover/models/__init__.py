"""Model definitions (Llama family) and checkpoint loading."""
