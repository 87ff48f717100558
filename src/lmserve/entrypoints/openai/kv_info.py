"""GET /v1/kv_transfer: a disaggregated server's role and KV geometry, which `lmserve router` compares between its
prefill and decode servers at start-up (a mismatch is refused naming the field, before any request)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lmserve.engine.kv_transfer import kv_geometry
from lmserve.entrypoints.openai.state import ServerState


def add_kv_info_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/kv_transfer")
    async def kv_transfer() -> JSONResponse:
        engine = state.ready_engine()
        kv = getattr(engine.config, "kv_transfer", None)
        role = None if kv is None else kv.kv_role
        return JSONResponse({"kv_role": role, "kv_connector": "lmserve", **kv_geometry(engine.config)})
