"""What the server and the proxy share: OpenAI's request records and error format
(`protocol.py`), its response shapes (`shapes.py`), the one writer of OpenAI answers
(`responses.py`) and the HTTP plumbing of both apps (`http.py`)."""
