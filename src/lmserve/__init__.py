"""lmserve: an LLM inference and serving engine.

The public names load on first use (PEP 562), so that `import lmserve.<module>` and the `lmserve` CLI's
subcommands that need no model (`--help`, `bench serve`, `diagnose`, ...) do not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmserve.core.outputs import CompletionOutput, RequestOutput
    from lmserve.engine.beam_search import BeamSearchParams
    from lmserve.llm import LLM
    from lmserve.lora.request import LoRARequest
    from lmserve.sampling_params import SamplingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "lmserve.llm",
    "SamplingParams": "lmserve.sampling_params",
    "StructuredOutputsParams": "lmserve.sampling_params",
    "BeamSearchParams": "lmserve.engine.beam_search",
    "RequestOutput": "lmserve.core.outputs",
    "CompletionOutput": "lmserve.core.outputs",
    "LoRARequest": "lmserve.lora.request",
}
__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
    "LoRARequest",
]
assert set(__all__) == set(_EXPORTS), "every public name has a module to load it from"
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
