"""The `kvrecover` command line: `main.py` (every subcommand's parser and dispatch) and
the serving commands (`serve.py`, `proxy.py`, `serve_demo.py`)."""
