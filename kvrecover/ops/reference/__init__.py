"""The reference kernels in plain torch (CPU and GPU): attention, small ops, rotary, step inputs."""
