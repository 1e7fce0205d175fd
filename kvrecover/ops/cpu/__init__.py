"""The batch-invariant CPU kernels: oneDNN packing and fixed tiles, our C kernels (csrc/) and their build."""
