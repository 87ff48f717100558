"""OpenAI-compatible HTTP API: protocol (pydantic bodies), server (FastAPI + SSE), errors, `serve` CLI."""
