"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), answering only with
--enable-lora-runtime-updates: a loaded adapter is validated here (400 naming the path or field), an unknown name
to unload is 404 model_not_found, an adapter with requests in flight is not unloaded (400: never breaks them).
The engines need no message: cores load an adapter from its path on its first request and drop unused ones from
RAM by LRU (max_cpu_loras)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from lmserve.entrypoints.openai.errors import APIError, bad_request
from lmserve.entrypoints.openai.lora_modules import LoRAModules
from lmserve.entrypoints.openai.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


def _updatable(state: ServerState) -> LoRAModules:
    state.ready_engine()
    loras = state.loras
    if loras is None or not loras.runtime_updates:
        raise APIError(404, "loading and unloading LoRA adapters needs --enable-lora --enable-lora-runtime-updates",
                       code="not_found")  # fmt: skip
    return loras


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        loras = _updatable(state)
        try:
            loras.load(body.lora_name, body.lora_path)
        except ValueError as e:
            param = "lora_name" if str(e).startswith("lora_name") else "lora_path"
            raise bad_request(str(e), param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        loras = _updatable(state)
        try:
            loras.unload(body.lora_name)
        except KeyError:
            raise APIError(404, f"LoRA adapter {body.lora_name!r} is not loaded", param="lora_name",
                           code="model_not_found") from None  # fmt: skip
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
