"""The GPU kernels in Triton: paged attention, fused small ops, the fused MoE, the
batch-invariant matmul, Gated DeltaNet's convolution and delta rule.

Import only where Triton exists (CUDA machines, or `TRITON_INTERPRET=1`); `step_inputs`,
`metadata` and `interpreter_compat` need no Triton.
"""
