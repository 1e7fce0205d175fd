"""`RedisConnector`: KV blocks in one Redis server or a Redis Cluster."""
