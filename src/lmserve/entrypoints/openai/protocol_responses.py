"""Bodies of OpenAI's Responses API (POST /v1/responses): the request, its translation to a chat conversation
(input items → ChatMessages, function tools → chat tools, text.format → response_format, tool_choice), and the
response object with its output items (message, function_call, reasoning) and usage."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from lmserve.entrypoints.openai import protocol as p

BUILTIN_TOOL_HINT = "only tools of type 'function' are served"


class ResponsesRequest(p._Strict):
    model: p.Text | None = None
    input: p.Text | list[dict[str, Any]] = ""
    instructions: p.Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: p.Text | None = None
    # vLLM's extras
    seed: int | None = None
    top_k: int | None = None
    stop: p.Text | list[p.Text] | None = None


def _bad(message: str, param: str) -> p.RequestError:
    return p.RequestError(message, param)


TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if kind in TEXT_PARTS else None
        if not isinstance(text, str):
            raise _bad(
                f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are served, got type {kind!r}",
                f"{where}.content[{j}]",
            )
        out.append(text)
    return "".join(out)


def _call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(value: str | list[dict[str, Any]]) -> list[p.ChatMessage]:
    """`input` as chat messages: a string is one user message; items are messages (roles user / system /
    developer / assistant), function_call items (joined into the assistant turn before them) and
    function_call_output items (tool turns); reasoning items are dropped, as the chat template has no place
    for them. RequestError naming `input[i]` for anything else."""
    if isinstance(value, str):
        return [p.ChatMessage(role="user", content=value)]
    messages: list[p.ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", where)
            text = _text_of(item.get("content"), where)
            messages.append(p.ChatMessage(role=role, content=text))
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, args)):
                raise _bad(f"{where}: a function_call item needs string call_id, name and arguments", where)
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":
                last = p.ChatMessage(role="assistant", content="")
                messages.append(last)
            last.tool_calls = [*(last.tool_calls or []), _call_dict(call_id, name, args)]
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: a function_call_output item needs a string call_id", where)
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append(p.ChatMessage(role="tool", content=text, tool_call_id=call_id))
        elif kind == "reasoning":
            continue
        else:
            raise _bad(
                f"{where}.type {kind!r} is not served (message, function_call, function_call_output, reasoning)", where
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools; a built-in tool (web search, file search, computer use, ...)
    is refused naming its type."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"tools[{i}]: tool type {kind!r} is not supported: {BUILTIN_TOOL_HINT}", f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' tool_choice ("auto" / "none" / "required" / {"type": "function", "name"}) in chat's shape."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice is None or isinstance(choice, str):
        return choice
    raise _bad(f"tool_choice {choice!r} is not supported: give auto, none, required or a function", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format (json_schema with name / schema / strict at the top, json_object, text) as chat's
    response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format")


# ---- the response object ------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"] = "in_progress"
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    def output_text(self) -> str:
        return "".join(c.text for item in self.output if isinstance(item, OutputMessage) for c in item.content)


def response_usage(usage: p.Usage) -> ResponseUsage:
    details = usage.completion_tokens_details
    reasoning_tokens = 0 if details is None else details.reasoning_tokens
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=usage.total_tokens,
    )
