"""KV connectors: moving KV cache blocks between engines through a store."""
