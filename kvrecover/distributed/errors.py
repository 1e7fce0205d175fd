"""The failure of a rank: the tensor-parallel group cannot run another step."""

from __future__ import annotations


class RankFailedError(RuntimeError):
    """A rank died, raised in its forward, broke the step protocol or missed its
    deadline. The group is unusable: the engine ends its requests and closes."""
