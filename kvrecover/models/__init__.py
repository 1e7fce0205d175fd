"""Model families (one file each, chosen by `registry.py`), their shared layers, and checkpoint loading."""
