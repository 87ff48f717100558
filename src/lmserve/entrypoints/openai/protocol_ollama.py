"""Request bodies of Ollama's API (/api/chat, /api/generate, /api/embed, /api/show) and their translation onto the
OpenAI-side request models the generation path takes: `options` → sampling fields, `format` → response_format,
Ollama's tool calls (arguments as objects) → the chat template's. Strict types, as protocol.py's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai.errors import bad_request

# options that steer Ollama's runtime (GPU layers, threads, mmap, batch), not the output: accepted, no effect here
RUNTIME_OPTIONS = frozenset(
    {"num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "numa", "low_vram", "vocab_only",
     "f16_kv", "logits_all", "num_keep"}
)  # fmt: skip
# option name → the sampling field it sets (num_predict, stop and num_ctx are handled on their own)
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# the OpenAI field a refusal names → the Ollama field the client sent
PARAM_NAMES = {
    "max_tokens": "options.num_predict",
    "stop": "options.stop",
    "repetition_penalty": "options.repeat_penalty",
    "response_format": "format",
    **{v: f"options.{k}" for k, v in SAMPLING_OPTIONS.items() if k != v},
    **{k: f"options.{k}" for k, v in SAMPLING_OPTIONS.items() if k == v},
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Options(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    num_predict: int | None = None  # -1: until EOS or the context; -2: fill the context
    num_ctx: int | None = None
    stop: list[p.Text] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ToolCallFunction(_Strict):
    name: p.Text
    arguments: dict[str, Any]


class ToolCall(_Strict):
    function: ToolCallFunction


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: p.Text = ""
    thinking: p.Text | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: p.Text | None = None


class _GenerationRequest(_Strict):
    model: p.Text = ""
    format: p.Text | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    think: bool | p.Text | None = None
    keep_alive: Any = None  # how long Ollama keeps a model loaded; this server keeps its one model


class ChatRequest(_GenerationRequest):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_GenerationRequest):
    prompt: p.Text = ""
    system: p.Text | None = None
    suffix: p.Text | None = None
    template: p.Text | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


class ModelRequest(_Strict):
    model: p.Text = ""
    name: p.Text = ""  # older clients send `name`


class EmbedRequest(_Strict):
    model: p.Text = ""
    input: p.Text | list[p.Text]
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: Any = None


def sampling_fields(options: Options | None, max_model_len: int) -> dict[str, Any]:
    """The ChatCompletionRequest fields `options` sets; 400 naming `options.X` for what this server cannot do."""
    if options is None:
        return {}
    extra = sorted(set(options.model_extra or {}) - RUNTIME_OPTIONS)
    if extra:
        raise bad_request(f"options.{extra[0]} is not supported by this server", f"options.{extra[0]}")
    if options.num_ctx is not None and not 1 <= options.num_ctx <= max_model_len:
        raise bad_request(
            f"options.num_ctx ({options.num_ctx}) must be in [1, {max_model_len}]: the model serves at most "
            f"{max_model_len} tokens (max_model_len)",
            "options.num_ctx",
        )
    fields: dict[str, Any] = {
        field: getattr(options, name) for name, field in SAMPLING_OPTIONS.items() if getattr(options, name) is not None
    }
    if options.num_predict is not None:
        if options.num_predict < -2 or options.num_predict == 0:
            raise bad_request("options.num_predict must be >= 1, or -1 / -2 (no limit)", "options.num_predict")
        if options.num_predict > 0:
            fields["max_tokens"] = options.num_predict
    if options.stop is not None:
        fields["stop"] = options.stop
    return fields


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's `format` ("json" or a JSON schema) as an OpenAI response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f'format must be "json" or a JSON schema object, got {fmt!r}', "format")


def chat_messages(messages: list[Message]) -> list[p.ChatMessage]:
    """Ollama messages → the chat template's (tool calls with their arguments as objects, as templates take them)."""
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise bad_request(f"messages[{i}].images: this server serves a text model", f"messages[{i}].images")
        calls = None
        if m.tool_calls:
            calls = [
                {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ]
        out.append(p.ChatMessage(role=m.role, content=m.content, name=m.tool_name, tool_calls=calls))
    return out
