"""A request body → what the engine takes, checked before anything is queued: the model name (404), prompts as
token ids (strings, token ids, lists of them, chat messages through the chat template), SamplingParams with the
model's generation defaults, the output constraint with its grammar compiled, and the lengths against
max_model_len. Every refusal is an APIError naming the field (400), shared by the HTTP routes and gRPC."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lmserve.engine.async_engine import AsyncEngine
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai import tools
from lmserve.entrypoints.openai.errors import APIError, bad_request, from_value_error
from lmserve.entrypoints.openai.state import ServerState
from lmserve.lora.request import LoRARequest
from lmserve.parsers import ReasoningParser
from lmserve.sample.structured_output import GrammarError
from lmserve.sampling_params import SamplingParams, check_runner

MAX_SEQS_PER_REQUEST = 256  # n × number of prompts


def tokenize_body(engine: AsyncEngine, body: p.TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        return render_chat(engine, body.messages, body.add_generation_prompt)
    return encode(engine.tokenizer, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)


def detokenize_tokens(engine: AsyncEngine, tokens: list[int]) -> str:
    vocab = engine.config.model.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens out of range [0, {vocab}): {bad[:5]}", "tokens")
    return engine.tokenizer.decode(tokens)


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The adapter the `model` field names (None: the base model); 404 model_not_found for an unknown name."""
    if model is None or model == state.served_model_name:
        return None
    lora = None if state.loras is None else state.loras.by_name.get(model)
    if lora is not None:
        return lora
    names = sorted(state.loras.by_name) if state.loras is not None else []
    adapters = f" and the LoRA adapters {names}" if names else ""
    raise APIError(
        404,
        f"model {model!r} does not exist; this server serves {state.served_model_name!r}{adapters}",
        param="model",
        code="model_not_found",
    )


def sampling_params_of(
    engine: AsyncEngine, body: p.CompletionRequest | p.ChatCompletionRequest, rename: dict[str, str]
) -> SamplingParams:
    try:  # a generation request on a pooling server: refused before anything else about it
        check_runner(getattr(engine.config, "runner", "generate"), None)
    except ValueError as e:
        raise bad_request(str(e), None, "wrong_runner") from None
    try:
        params = p.to_sampling_params(body, engine.generation_defaults)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None
    except ValueError as e:
        raise from_value_error(e, rename) from None
    vocab = engine.config.model.vocab_size
    bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
    if bad_bias:
        raise bad_request(
            f"logit_bias keys must be token ids < {vocab} (the vocabulary), got {bad_bias[:5]}", "logit_bias"
        )
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise bad_request(
            f"stop_token_ids must be < {vocab} (the vocabulary), got {bad_stop[:5]}", "stop_token_ids"
        )
    return params


async def constrain(
    engine: AsyncEngine, body: p.CompletionRequest | p.ChatCompletionRequest, params: SamplingParams
) -> tuple[SamplingParams, tools.Constraint]:
    """The request's output constraint (response_format, structured_outputs, guided_*, tools) in `params`, its
    grammar compiled (or found cached) off the event loop: a schema the library refuses is a 400 naming the field."""
    constraint = constraint_of(engine, body)
    return await apply_constraint(engine, constraint, params), constraint


def constraint_of(engine: AsyncEngine, body: p.CompletionRequest | p.ChatCompletionRequest) -> tools.Constraint:
    try:
        return tools.constraint_of(body, engine.tokenizer)
    except p.RequestError as e:
        raise bad_request(str(e), e.param) from None


async def apply_constraint(
    engine: AsyncEngine,
    constraint: tools.Constraint,
    params: SamplingParams,
    reasoning: ReasoningParser | None = None,
) -> SamplingParams:
    """`params` with the constraint's grammar, compiled; after the reasoning block when `reasoning` (this output's
    parser) has markers: the thinking is free text, the grammar applies from its end."""
    so = constraint.structured_outputs
    if so is None:
        return params
    if reasoning is not None and reasoning.end_markers:
        start = () if reasoning.starts_inside else reasoning.start_markers
        so = dataclasses.replace(so, reasoning_start=start, reasoning_end=reasoning.end_markers)
    try:
        params = dataclasses.replace(params, structured_outputs=so)
    except ValueError as e:
        raise from_value_error(e) from None
    try:
        await engine.compile_grammar(so)
    except GrammarError as e:
        raise bad_request(
            f"{constraint.param}: refused by the grammar compiler: {e.reason}", constraint.param
        ) from None
    return params


def completion_prompts(engine: AsyncEngine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt:
        raise bad_request("prompt is empty: give a string, a list of strings or token ids", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if len(items) > p.MAX_PROMPTS:
        raise bad_request(f"at most {p.MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    out = []
    for i, item in enumerate(items):
        field = "prompt" if len(items) == 1 else f"prompt[{i}]"
        out.append(user_input(field, engine.tokenize, item))
    return out


def encode(tokenizer: Any, text: str, field: str, **kwargs: Any) -> list[int]:
    return user_input(field, tokenizer.encode, text, **kwargs)


def user_input(field: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args) on request text (tokenizer, chat template): whatever it raises is the input's fault → 400."""
    try:
        return fn(*args, **kwargs)
    except APIError:
        raise
    except Exception as e:
        raise bad_request(f"{field}: cannot be tokenized: {type(e).__name__}: {e}", field) from None


def render_chat(
    engine: AsyncEngine,
    messages: list[p.ChatMessage],
    add_generation_prompt: bool,
    tool_list: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    return chat_prompt(engine, messages, add_generation_prompt, tool_list, template_kwargs)[1]


def chat_prompt(
    engine: AsyncEngine,
    messages: list[p.ChatMessage],
    add_generation_prompt: bool,
    tool_list: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The conversation through the chat template (with `template_kwargs`, e.g. enable_thinking): its text and ids."""
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    conversation = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        conversation.append(msg)
    extra = {**(template_kwargs or {}), **({"tools": tool_list} if tool_list else {})}
    try:
        text = tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as e:  # the template's own checks (role order, ...) raise jinja errors
        raise bad_request(f"messages: the chat template rejected them: {e}", "messages") from None
    return text, encode(tok, text, "messages", add_special_tokens=False)


def check_lengths(
    engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, max_param: str
) -> None:
    max_model_len = engine.config.scheduler.max_model_len
    for i, ids in enumerate(prompts):
        where = f"prompt[{i}]: " if len(prompts) > 1 else ""
        try:
            engine.validate(ids, params)
        except ValueError as e:
            err = from_value_error(e, {"max_tokens": max_param})
            err.message = where + err.message
            raise err from None
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
            raise bad_request(
                f"{where}prompt ({len(ids)} tokens) + {max_param} ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} tokens exceeds max_model_len ({max_model_len}); "
                f"lower {max_param} to at most {max_model_len - len(ids)}",
                max_param,
            )
