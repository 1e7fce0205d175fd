"""kvrecover: LLM inference for disaggregated serving that recovers exactly from KV load failures."""

from kvrecover.config import EngineArgs, KVTransferConfig
from kvrecover.llm import LLM
from kvrecover.outputs import CompletionOutput, RequestOutput
from kvrecover.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "KVTransferConfig", "EngineArgs", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
