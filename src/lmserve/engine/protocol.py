"""EngineClient: the one contract a server (HTTP, gRPC) holds its engine by. AsyncEngine (the engine on a thread of
this process), EngineCoreClient (engine-core processes over ZeroMQ) and DisaggregatedClient (prefill and decode
cores) implement it; tests/engine/test_protocol.py checks each does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lmserve.config.engine import EngineConfig
    from lmserve.engine.input_processor import Prompt
    from lmserve.engine.snapshot import EngineSnapshot
    from lmserve.engine.streams import RequestStream
    from lmserve.lora.request import LoRARequest
    from lmserve.sampling_params import SamplingParams, StructuredOutputsParams


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Any
    generation_defaults: dict[str, Any]  # the model's generation_config.json sampling fields

    @property
    def dead_error(self) -> BaseException | None: ...  # set once the engine can serve nothing more

    @property
    def is_running(self) -> bool: ...

    def start(self) -> EngineClient: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int: ...

    async def compile_grammar(self, params: StructuredOutputsParams) -> None: ...

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def watch_block_map(self, on: bool) -> None: ...

    def reset_prefix_cache(self, include_disk: bool = False) -> None: ...
