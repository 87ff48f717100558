"""ServerState: what every route, the middleware, the dashboard and the gRPC frontend share about one server
(its engine once loaded, the served name, the API key, metrics, chat settings); `ready_engine()` is the 503 while
loading."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.engine.protocol import EngineClient
from lmserve.engine.token_bytes import TokenBytes
from lmserve.entrypoints.openai.errors import APIError
from lmserve.entrypoints.openai.lora_modules import LoRAModules
from lmserve.observability.prometheus import Metrics
from lmserve.parsers.chat_settings import ChatSettings

LOADING_RETRY_AFTER_S = 5


@dataclass
class ServerState:
    served_model_name: str
    api_key: str | None
    max_request_body_bytes: int
    engine: EngineClient | None = None
    token_bytes: TokenBytes | None = None  # of the engine's tokenizer, for logprobs
    metrics: Metrics | None = None
    load_error: BaseException | None = None
    loras: LoRAModules | None = None  # the LoRA adapters served by name (--enable-lora), else None
    chat: ChatSettings = field(default_factory=ChatSettings)  # parsers and chat template options

    def ready_engine(self) -> EngineClient:
        engine = self.engine
        if engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
            raise APIError(
                503,
                "the model is still loading",
                code="loading",
                headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
            )
        if engine.dead_error is not None:
            raise APIError(503, f"the engine loop is not running: {engine.dead_error}", code="engine_dead")
        return engine


def engine_health(engine: EngineClient) -> tuple[int, dict]:
    """/health's status code and body for a loaded engine (the dashboard feed shows the body): dead (503, and with
    disaggregation when a whole role is gone, naming it), degraded (some of several cores died, named), or ok."""
    if engine.dead_error is not None:
        return 503, {"status": "dead", "error": str(engine.dead_error)}
    degraded = getattr(engine, "degraded_error", None)  # some of several engine cores died
    if degraded is not None:
        return 200, {"status": "degraded", "error": degraded}
    return 200, {"status": "ok"}
