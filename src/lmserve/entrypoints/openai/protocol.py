"""Request and response bodies of the OpenAI-compatible API (OpenAI names, plus vLLM's extra fields).

Requests are strict (no "5" for 5, no 1.5 for an int, no 1 for true) so a wrong type is a 400 naming the
field, not a silent coercion; unknown fields are ignored as OpenAI does. Value ranges are checked once,
by SamplingParams (see `to_sampling_params`), plus the server's own caps below.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer

from lmserve.parsers.chat_settings import RequestError as RequestError
from lmserve.sampling_params import SamplingParams

MAX_N = 128
"""Most sequences per prompt (`n`); OpenAI's limit."""
MAX_PROMPTS = 128
"""Most prompts in one /v1/completions request."""
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
SEED_RANGE = (-(2**63), 2**63 - 1)


def _unicode_text(s: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which are not Unicode text: no tokenizer takes them
    and no UTF-8 response can echo them, so they are refused where they are parsed, naming the field."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains a lone UTF-16 surrogate ({s[e.start]!r} at character {e.start}), which is not valid "
            "Unicode text"
        ) from None
    return s


Text = Annotated[str, AfterValidator(_unicode_text)]
"""A request string: any JSON string except one holding a lone surrogate."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: Text | None = None
    # prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} to a kv_producer server, or the
    # kv_transfer_params a producer answered to a kv_consumer server (lmserve router sends both)
    kv_transfer_params: dict[str, Any] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # output constraints (entrypoints/openai/tools.py turns them into StructuredOutputsParams)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extra: per prompt position, the logprob of the prompt's token and its k most likely alternatives
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt is scored, nothing generated
    logprobs: int | None = None
    echo: bool = False  # the text (and logprobs) start with the prompt's
    best_of: int | None = None
    suffix: Text | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False  # refused when true: chat has no echo (use /v1/completions, or prompt_logprobs)
    # refused when set: a per-request template runs arbitrary Jinja
    chat_template: Any = None
    # tool calling (entrypoints/openai/tools.py); `functions` (deprecated) is refused
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    functions: Any = None
    # reasoning models (entrypoints/openai/chat_settings.py, parsers/): kwargs for the chat template (e.g.
    # {"enable_thinking": false}), OpenAI's reasoning_effort (passed to the template), and vLLM's include_reasoning
    chat_template_kwargs: Any = None
    reasoning_effort: Any = None
    include_reasoning: bool = True


class TokenizeRequest(_Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser

    @model_serializer(mode="wrap")
    def _drop_no_details(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("completion_tokens_details", 0) is None:
            del out["completion_tokens_details"]
        return out


class CompletionLogprobs(BaseModel):
    """With echo the prompt's tokens come first; the first has no logprob (null entries, as OpenAI sends)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's entry at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token there
    decoded_token: str | None = None  # the token's name, as `tokens` spells it


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's prompt_logprobs: per prompt position, None for the first, else token id → entry (the prompt's token and
the k most likely ones)."""


class _DropNullPromptLogprobs(BaseModel):
    """prompt_logprobs appears only when asked for."""

    @model_serializer(mode="wrap")
    def _drop_no_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("prompt_logprobs", 0) is None:
            del out["prompt_logprobs"]
        return out


class CompletionChoice(_DropNullPromptLogprobs):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # streaming: in the choice's first chunk


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # with a reasoning parser; `reasoning` is vLLM's newer name, the same text
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_DropNullPromptLogprobs):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # of the rendered conversation (vLLM's place for it)


class _DropNone(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:  # OpenAI sends {"content": "..."} without role
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_DropNullPromptLogprobs):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the first chunk after the prompt was computed


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lmserve"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's shape); None for the base itself
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- request → SamplingParams -------------------------------------------------------------------


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """Build SamplingParams (which validates ranges, raising ValueError naming the field) after the
    server's own caps; RequestError for those. `defaults` (the model's generation_config.json sampling
    fields) fill the fields the request leaves unset."""
    _check_caps(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    kwargs: dict[str, Any] = dict(
        prompt_logprobs=prompt_logprobs_to_compute(req),
        n=req.n,
        best_of=getattr(req, "best_of", None),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        logit_bias=req.logit_bias,
    )
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    kwargs.update({k: v for k, v in (defaults or {}).items() if optional.get(k) is None})
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return SamplingParams(**kwargs)


def prompt_logprobs_to_compute(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The top-k the engine computes per prompt position: enough for prompt_logprobs and for echo's logprobs
    (each view keeps its own k of them)."""
    wanted = [req.prompt_logprobs]
    if isinstance(req, CompletionRequest) and req.echo:
        wanted.append(req.logprobs)
    given = [k for k in wanted if k is not None]
    return max(given) if given else None


def _check_caps(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.prompt_logprobs}",
            "prompt_logprobs",
        )
    if req.n > MAX_N:
        raise RequestError(f"n must be at most {MAX_N}, got {req.n}", "n")
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature}", "temperature")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise RequestError(f"seed must be a signed 64-bit integer, got {req.seed}", "seed")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise RequestError(f"stop: each stop string may be at most {MAX_STOP_STRING_CHARS} characters", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    if req.logit_bias is not None and len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(req.logit_bias)}", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        _check_chat_caps(req)
    else:
        _check_completion_caps(req)


def _check_chat_caps(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                "top_logprobs",
            )
    if req.chat_template is not None:
        raise RequestError("chat_template: a per-request chat template is not accepted", "chat_template")
    if req.echo:
        raise RequestError(
            "echo is not supported on chat completions: use /v1/completions with echo, or prompt_logprobs here",
            "echo",
        )
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if getattr(req, name) == 0:
        raise RequestError(f"{name} must be >= 1 (chat has no echo to score a prompt with 0)", name)


def _check_completion_caps(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise RequestError(
            "max_tokens must be >= 1; 0 is accepted only with echo (the prompt is scored, nothing generated)",
            "max_tokens",
        )
    if req.echo and req.best_of is not None and req.best_of > req.n:
        raise RequestError(
            f"best_of ({req.best_of}) > n ({req.n}) cannot be combined with echo: give best_of = n or leave it unset",
            "best_of",
        )
    if req.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if req.best_of is not None:
        if not req.n <= req.best_of <= MAX_N:
            raise RequestError(f"best_of must be in [n={req.n}, {MAX_N}], got {req.best_of}", "best_of")
        if req.best_of > req.n and req.stream:
            raise RequestError("best_of > n cannot stream: the best sequences are known only at the end", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", "logprobs")
