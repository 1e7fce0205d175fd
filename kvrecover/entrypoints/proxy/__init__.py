"""`kvrecover proxy`: OpenAI endpoints in front of prefill and decode instances
(`app.py`), with failover and migration (`request.py`) over checked upstream answers."""
