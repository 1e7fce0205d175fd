"""Worker side: the model runner, KV cache tensors, step inputs, CUDA graphs, sampler, overlap.

The kernels it runs live in `kvrecover.ops`, chosen once per engine (`ops.backend`).
"""
