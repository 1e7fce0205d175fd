"""`kvrecover serve`: the OpenAI-compatible HTTP server of one engine (`app.py`), its
engine thread, generation requests, detokenizer, chat template and metrics."""
