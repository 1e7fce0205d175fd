"""Kernels, by family, behind one declared interface (`interface.py`).

`reference/` (torch attention and ops, the reference numerics), `cpu/` (the
batch-invariant CPU kernels: oneDNN tiles, our C kernels and their build) and
`triton/` (GPU attention, fused ops, batch-invariant matmul) each provide the
`interface` Protocols; `backend.select_backend` picks one set per engine.
Nothing here imports the engine, the worker or the models; the Triton modules
import only where Triton exists.
"""
