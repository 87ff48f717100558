"""lmserve: an LLM inference and serving engine."""

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.entrypoints.beam_search import BeamSearchParams
from lmserve.entrypoints.llm import LLM
from lmserve.lora_request import LoRARequest
from lmserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
    "LoRARequest",
]
__version__ = "0.1.0"
