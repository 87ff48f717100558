"""Constrained output in the OpenAI API: response_format, vLLM's structured_outputs / guided_* extras and tool calls.

A request names at most one constraint; it becomes a StructuredOutputsParams plus the API field to blame in a 400:

    response_format {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}        (vLLM)
    guided_json | guided_regex | guided_choice | guided_grammar                              (vLLM, older)
    tools + tool_choice {"type": "function", "function": {"name": F}}  → json = F's parameters schema
    tools + tool_choice "required"  → json = [{"name": F, "parameters": {...}}, ...] (one or more calls)
    tools + tool_choice "auto"      → unconstrained; the chat template shows the tools and the model may write
                                      Hermes-style <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks
    tools + tool_choice "none"      → tools ignored

`ToolCallFormatter` turns a finished sequence into `tool_calls` (and streams them as deltas).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from lmserve.core.outputs import CompletionOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.sampling_params import StructuredOutputsParams

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.S)

ToolMode = Literal["named", "required", "auto"]


@dataclass
class ToolPlan:
    """How this request's tools are used: `mode`, the tools for the chat template, the named function."""

    mode: ToolMode
    tools: list[dict[str, Any]]
    function_name: str | None = None
    parallel: bool = True  # "required": several calls allowed (parallel_tool_calls)


@dataclass
class Constraint:
    """What a request asks for: the grammar constraint (None: none), the field a refusal names, tool handling."""

    structured_outputs: StructuredOutputsParams | None = None
    param: str | None = None
    tools: ToolPlan | None = None


def _bad(message: str, param: str) -> p.RequestError:
    return p.RequestError(message, param)


def template_supports_tools(tokenizer: Any) -> bool:
    """A chat template that renders a `tools` variable (Hermes 2 Pro / Hermes 3, Qwen2 / Qwen2.5 / Qwen3, ...)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def constraint_of(body: p.CompletionRequest | p.ChatCompletionRequest, tokenizer: Any) -> Constraint:
    """The request's constraint; RequestError naming the field for anything malformed or contradictory."""
    found: list[Constraint] = []
    rf = _response_format(body.response_format)
    if rf is not None:
        found.append(Constraint(rf, "response_format"))
    if body.structured_outputs is not None:
        found.append(Constraint(_structured_outputs(body.structured_outputs), "structured_outputs"))
    guided = {
        "guided_json": "json",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }
    for name, kind in guided.items():
        value = getattr(body, name)
        if value is not None:
            found.append(Constraint(_params(name, **{kind: value}), name))
    plan = _tool_plan(body, tokenizer) if isinstance(body, p.ChatCompletionRequest) else None
    if plan is not None and plan.mode != "auto":
        found.append(Constraint(_tool_params(plan), "tools", plan))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)  # type: ignore[misc]
        raise _bad(f"give at most one output constraint, got {names}", found[1].param)  # type: ignore[arg-type]
    out = found[0] if found else Constraint()
    if plan is not None:
        out.tools = plan
    return out


def _params(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise _bad(f"{param}: {str(e).removeprefix('structured_outputs')}".replace(": .", "."), param) from None


def _response_format(rf: Any) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema must be an object with name and schema", "response_format")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad("response_format.json_schema.name must be a string", "response_format")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputsParams(json=schema)
    raise _bad(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {rf!r}", "response_format")


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise _bad(f"structured_outputs must be an object, got {value!r}", "structured_outputs")
    unknown = set(value) - set(StructuredOutputsParams.KINDS)
    if unknown:
        raise _bad(
            f"structured_outputs: unknown or unsupported fields {sorted(unknown)} "
            f"(supported: {', '.join(StructuredOutputsParams.KINDS)})",
            "structured_outputs",
        )
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise _bad(str(e), "structured_outputs") from None


def _tool_plan(body: p.ChatCompletionRequest, tokenizer: Any) -> ToolPlan | None:
    if body.functions is not None:
        raise _bad("functions is deprecated and not supported: use tools", "functions")
    tools = _tools(body.tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise _bad("tool_choice needs a non-empty tools list", "tool_choice")
    if choice == "auto":
        if not template_supports_tools(tokenizer):
            raise _bad(
                "tool_choice 'auto' needs a chat template that renders tools (Hermes-style <tool_call> output, as "
                "Qwen2.5 / Qwen3 / Hermes templates); this model's template does not. Use tool_choice 'required' "
                "or a named function, which constrain the output to the function's schema",
                "tool_choice",
            )
        return ToolPlan("auto", tools)
    if choice == "required":
        return ToolPlan("required", tools, parallel=body.parallel_tool_calls)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise _bad(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})", "tool_choice"
            )
        return ToolPlan("named", tools, name)
    raise _bad(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {choice!r}",
        "tool_choice",
    )


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    seen = set()
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-.]{1,64}", name):
            raise _bad(f"tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _, -, ., got {name!r}", f"tools[{i}]")
        if name in seen:
            raise _bad(f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}]")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
    return value


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _tool_params(plan: ToolPlan) -> StructuredOutputsParams:
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.function_name)
        return StructuredOutputsParams(json=_parameters(tool))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in plan.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not plan.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


# ---- output ------------------------------------------------------------------------------------


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(content before the first <tool_call>, the calls) from Hermes-style output; blocks that are not a JSON
    object with a string `name` are left in the content."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES_CALL.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(p.ToolCall(id=_call_id(), function=p.FunctionCall(name=obj["name"], arguments=arguments)))
    content = text[:start].strip()
    return (content or None), calls


def _hold_back(text: str) -> int:
    """How many characters of `text` may be streamed as content: up to a <tool_call> or a partial one at the end."""
    found = text.find(TOOL_CALL_START)
    if found >= 0:
        return found
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)


@dataclass
class _StreamState:
    sent_chars: int = 0  # auto: content characters streamed so far
    call_id: str | None = None  # named: the call's id once its header went out


@dataclass
class ToolCallFormatter:
    """Per-request: the assistant message (and stream deltas) of each choice under the tool plan."""

    plan: ToolPlan
    _streams: dict[int, _StreamState] = field(default_factory=dict)

    def message(self, c: CompletionOutput) -> tuple[p.AssistantMessage, str | None]:
        """The final message and finish_reason of a finished choice."""
        reason = None if c.finish_reason is None else str(c.finish_reason)
        calls = self._calls(c.text, complete=reason == "stop")
        if calls is None:
            return p.AssistantMessage(content=c.text), reason
        content, tool_calls = calls
        return p.AssistantMessage(content=content, tool_calls=tool_calls), "tool_calls" if tool_calls else reason

    def _calls(self, text: str, complete: bool) -> tuple[str | None, list[p.ToolCall]] | None:
        if self.plan.mode == "named":
            return None, [
                p.ToolCall(id=_call_id(), function=p.FunctionCall(name=self.plan.function_name, arguments=text))
            ]
        if self.plan.mode == "required":
            if not complete:
                return None  # cut by max_tokens: not a list of calls; returned as text
            return None, [
                p.ToolCall(
                    id=_call_id(),
                    function=p.FunctionCall(
                        name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False)
                    ),
                )
                for call in json.loads(text)
            ]
        content, calls = parse_hermes_tool_calls(text)
        return (content, calls) if calls else None

    def delta(self, idx: int, c: CompletionOutput) -> tuple[p.DeltaMessage | None, str | None]:
        """This step's delta for choice `idx` (None: nothing to send yet) and its finish_reason once finished."""
        state = self._streams.setdefault(idx, _StreamState())
        reason = None if c.finish_reason is None else str(c.finish_reason)
        if self.plan.mode == "named":
            calls = []
            if state.call_id is None:
                state.call_id = _call_id()
                fn = p.DeltaFunctionCall(name=self.plan.function_name, arguments="")
                calls.append(p.DeltaToolCall(index=0, id=state.call_id, type="function", function=fn))
            if c.delta_text:
                calls.append(p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(arguments=c.delta_text)))
            return p.DeltaMessage(tool_calls=calls) if calls else None, "tool_calls" if reason == "stop" else reason
        if not c.finished:
            if self.plan.mode == "required":
                return None, None  # a JSON list of calls is sent whole once complete
            upto = _hold_back(c.text)
            new = c.text[state.sent_chars : upto]
            state.sent_chars = max(state.sent_chars, upto)
            return (p.DeltaMessage(content=new) if new else None), None
        # finished: the rest of the content, then every call with its whole arguments
        msg, reason = self.message(c)
        if not msg.tool_calls:  # plain text after all (auto without calls, or a list of calls cut by max_tokens)
            rest = c.text[state.sent_chars :]
            return (p.DeltaMessage(content=rest) if rest else None), reason
        rest = c.text[state.sent_chars : max(_hold_back(c.text), state.sent_chars)] if self.plan.mode == "auto" else ""
        deltas = [
            p.DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=p.DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for i, call in enumerate(msg.tool_calls)
        ]
        return p.DeltaMessage(content=rest or None, tool_calls=deltas), reason
