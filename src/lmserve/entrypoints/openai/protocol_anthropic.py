"""Bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request, its translation
to a chat conversation (system, text / tool_use / tool_result blocks, tools with input_schema, tool_choice), and
the message answered (text and tool_use blocks, stop_reason, usage)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from lmserve.entrypoints.openai import protocol as p

# server tools (web search, code execution, bash, text editor, computer use, ...) carry a versioned type
CUSTOM_TOOL_TYPES = (None, "custom")


class AnthropicMessage(p._Strict):
    role: Literal["user", "assistant"]
    content: p.Text | list[dict[str, Any]]


class CountTokensRequest(p._Strict):
    model: p.Text | None = None
    messages: list[AnthropicMessage]
    system: p.Text | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[p.Text] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


def _bad(message: str, param: str) -> p.RequestError:
    return p.RequestError(message, param)


def _text_blocks(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise _bad(f"{where}[{j}]: only text blocks are served here, got type {kind!r}", f"{where}[{j}]")
        out.append(block["text"])
    return "".join(out)


def system_message(system: str | list[dict[str, Any]] | None) -> list[p.ChatMessage]:
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [p.ChatMessage(role="system", content=text)] if text else []


def chat_messages(messages: list[AnthropicMessage]) -> list[p.ChatMessage]:
    """Anthropic's turns as chat messages: a user turn's tool_result blocks become tool messages (before its text),
    an assistant turn's tool_use blocks its tool_calls; thinking blocks are dropped (no place in the chat
    template). RequestError naming `messages[i].content[j]` for any other block (image, document, ...)."""
    out: list[p.ChatMessage] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append(p.ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[p.ChatMessage] = []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(tid, str) or not isinstance(name, str) or not isinstance(args, dict):
                    raise _bad(f"{where}: a tool_use block needs a string id and name and an object input", where)
                fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
                calls.append({"id": tid, "type": "function", "function": fn})
            elif kind == "tool_result" and m.role == "user":
                tid = block.get("tool_use_id")
                if not isinstance(tid, str):
                    raise _bad(f"{where}: a tool_result block needs a string tool_use_id", where)
                text = _text_blocks(block.get("content", ""), f"{where}.content")
                results.append(p.ChatMessage(role="tool", content=text, tool_call_id=tid))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            else:
                raise _bad(f"{where}: block type {kind!r} is not served in a {m.role} turn", where)
        out.extend(results)
        if texts or calls or not results:
            out.append(p.ChatMessage(role=m.role, content="".join(texts), tool_calls=calls or None))
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Custom tools (name, description, input_schema) as chat tools; a server tool is refused naming its type."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in CUSTOM_TOOL_TYPES:
            raise _bad(f"tools[{i}]: tool type {kind!r} is not supported: only custom tools (name, input_schema) "
                       "are served", f"tools[{i}]")  # fmt: skip
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> tuple[Any, bool]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice: auto, any (→ required), tool (→ the
    named function), none; disable_parallel_tool_use → one call at most."""
    if choice is None:
        return ("auto" if has_tools else None), True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise _bad(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")


def template_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` for chat templates that read enable_thinking (Qwen3 and kin)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _bad(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", "thinking")
    return {"enable_thinking": kind != "disabled"}


# ---- the answer ---------------------------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


def usage_of(usage: p.Usage) -> Usage:
    """Anthropic's split: input_tokens are those not read from the cache; cache_read_input_tokens the others."""
    cached = usage.prompt_tokens_details.cached_tokens
    return Usage(
        input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens, cache_read_input_tokens=cached
    )


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of chat's finish_reason and the stop string or token that ended the output."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_block(call: p.ToolCall) -> dict[str, Any]:
    args = json.loads(call.function.arguments)  # the tool path returns only calls whose arguments parse
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": args}
