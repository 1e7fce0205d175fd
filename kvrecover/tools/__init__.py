"""Developer tools that check the code base itself (run as `python -m kvrecover.tools.NAME`)."""
