"""The GPU kernels in Triton: paged attention, fused small ops, the fused MoE, the
batch-invariant matmul.

Import only where Triton exists (CUDA machines, or `TRITON_INTERPRET=1`); `step_inputs` and
`metadata` need no Triton.
"""
