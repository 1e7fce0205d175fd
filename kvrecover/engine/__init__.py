"""Engine side: requests, the block pool, the scheduler, recovery and the step loop.

Its public API is `__all__`; entrypoints import nothing else from here
(`kvrecover.tools.layering` checks it). Most callers use `kvrecover.LLM`.
"""

from kvrecover.engine.engine import Engine
from kvrecover.engine.snapshot import EngineSnapshot

__all__ = ["Engine", "EngineSnapshot"]
