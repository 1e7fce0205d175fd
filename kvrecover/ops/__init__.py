"""Kernels: torch reference ops and attention, oneDNN packing, Triton attention and fused ops.

`backend.select_backend` picks one set of them per engine. Nothing here imports
the engine or the worker; the Triton modules import only where Triton exists.
"""
