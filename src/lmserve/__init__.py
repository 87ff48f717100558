"""lmserve: an LLM inference and serving engine."""

from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.entrypoints.llm import LLM
from lmserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
