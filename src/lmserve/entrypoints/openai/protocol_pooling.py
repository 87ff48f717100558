"""Request bodies of the pooling endpoints: OpenAI's /v1/embeddings, vLLM's /score, Jina's / Cohere's /rerank.
Strict types, as protocol.py's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from lmserve.entrypoints.openai import protocol as p

MAX_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class PoolingBody:
    """What Generation reads of a body, for a pooling request: no KV handoff, no stream, no prompt logprobs."""

    kv_transfer_params = None
    stream = False
    stream_options = None
    prompt_logprobs = None


class EmbeddingRequest(_Strict):
    model: p.Text | None = None
    input: p.Text | list[p.Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: p.Text | None = None


class ScoreRequest(_Strict):
    model: p.Text | None = None
    text_1: p.Text | list[p.Text]
    text_2: p.Text | list[p.Text]


class RerankDocument(_Strict):
    text: p.Text


class RerankRequest(_Strict):
    model: p.Text | None = None
    query: p.Text
    documents: list[p.Text | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """`input` as a list of prompts (text or token ids)."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return list(value)
