"""kvrecover: LLM inference for disaggregated serving that recovers exactly from KV load failures."""

from kvrecover.config import EngineArgs, KVTransferConfig
from kvrecover.llm import LLM
from kvrecover.outputs import CompletionOutput, RequestOutput
from kvrecover.sampling import SamplingParams
from kvrecover.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "KVTransferConfig", "EngineArgs",
           "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
