"""The reference `ops.interface.SamplingKernels`: torch's cast and argmax."""

from __future__ import annotations

import torch


class TorchSampling:
    """Greedy tokens by `torch.argmax` (first maximum on ties, as every backend's)."""

    def upcast_greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`logits` as float32, each row's argmax)."""
        upcast = logits.float()
        return upcast, upcast.argmax(-1)
