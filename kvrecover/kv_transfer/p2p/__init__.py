"""Point-to-point KV transfer: a consumer pulls a producer's kept blocks (NIXL)."""
