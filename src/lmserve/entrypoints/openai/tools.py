"""Constrained output in the OpenAI API: response_format, vLLM's structured_outputs / guided_* extras and tool calls.

constraint_of turns a request's one constraint into a StructuredOutputsParams plus the API field to blame in a 400;
ToolCallFormatter turns finished sequences into `tool_calls` (and stream deltas). See docs/structured_outputs.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from lmserve.core.outputs import CompletionOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.parsers import HermesToolParser, ToolCall, ToolParser
from lmserve.parsers.base import call_id
from lmserve.sampling_params import StructuredOutputsParams

ToolMode = Literal["named", "required", "auto"]


@dataclass
class ToolPlan:
    """How this request's tools are used: `mode`, the tools for the chat template, the named function."""

    mode: ToolMode
    tools: list[dict[str, Any]]
    function_name: str | None = None
    parallel: bool = True  # parallel_tool_calls: "required" and "auto" may return several calls


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
                "tool_choice 'auto' needs a chat template that renders tools (the model then writes calls in its "
                "family's format, Hermes-style <tool_call> by default: --tool-call-parser); this model's template "
                "does not. Use tool_choice 'required' "
                "or a named function, which constrain the output to the function's schema",
                "tool_choice",
            )
        return ToolPlan("auto", tools, parallel=body.parallel_tool_calls)
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


def to_api_calls(calls: list[ToolCall]) -> list[p.ToolCall]:
    return [p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(content before the first <tool_call>, the calls) from Hermes-style output (parsers.hermes); an output whose
    blocks are not all a JSON object with a string `name` is all content."""
    content, calls = HermesToolParser().extract(text)
    return content, to_api_calls(calls)


@dataclass
class _StreamState:
    sent_chars: int = 0  # auto: content characters streamed so far
    sent_logprobs: int = 0  # logprob entries sent so far (held-back tokens send theirs with the next chunk)


@dataclass
class ToolCallFormatter:
    """Per-request: the assistant message (and stream deltas) of each choice under the tool plan.

    One rule for every mode, streamed or not, each of n choices on its own: a choice carries `tool_calls`, and
    finish_reason "tool_calls", only when its output holds complete calls (named: one JSON value, the grammar's
    arguments object; required: the JSON list of calls; auto: every <tool_call> block a JSON object with a
    name). Otherwise (cut by max_tokens, a stop string, an abort) it is plain content with the engine's
    finish_reason, so a client never receives arguments that do not parse. Streams therefore hold a named or
    required call back and send it whole, as the non-streamed message has it; auto streams its content up to
    the first <tool_call>."""

    plan: ToolPlan
    parser: ToolParser = field(default_factory=HermesToolParser)  # auto: the family's call format
    _streams: dict[int, _StreamState] = field(default_factory=dict)

    def message(self, c: CompletionOutput) -> tuple[p.AssistantMessage, str | None]:
        """The final message and finish_reason of a finished choice."""
        reason = None if c.finish_reason is None else str(c.finish_reason)
        calls = self._calls(c.text)
        if calls is None:
            return p.AssistantMessage(content=c.text), reason
        content, tool_calls = calls
        return p.AssistantMessage(content=content, tool_calls=tool_calls), "tool_calls"

    def _calls(self, text: str) -> tuple[str | None, list[p.ToolCall]] | None:
        """(content, calls) when `text` holds complete calls, else None (it is returned as content)."""
        if self.plan.mode == "auto":
            content, calls = self.parser.extract(text, self.plan.tools)
            if not calls:
                return None
            return content, to_api_calls(calls if self.plan.parallel else calls[:1])
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested past json's limit
            return None  # cut short: not a whole JSON value
        if self.plan.mode == "named":
            return None, [
                p.ToolCall(id=call_id(), function=p.FunctionCall(name=self.plan.function_name, arguments=text))
            ]
        if not isinstance(value, list) or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
        ):
            return None  # the grammar writes a list of {"name", "parameters"}; anything else is not calls
        return None, [
            p.ToolCall(
                id=call_id(),
                function=p.FunctionCall(
                    name=call["name"], arguments=json.dumps(call.get("parameters", {}), ensure_ascii=False)
                ),
            )
            for call in value
        ]

    def deltas(self, idx: int, c: CompletionOutput) -> list[tuple[p.DeltaMessage, str | None]]:
        """This step's (delta, finish_reason) chunks for choice `idx`: none while held back; calls are followed by
        a chunk of their own for the finish_reason, as OpenAI sends them (the openai client's stream helper emits
        a call's `arguments.done` only when the finish_reason comes after its deltas)."""
        state = self._streams.setdefault(idx, _StreamState())
        if not c.finished:
            if self.plan.mode != "auto":
                return []  # a call is sent whole once complete (it may yet be cut short)
            upto = self.parser.stream_upto(c.text)
            new = c.text[state.sent_chars : upto]
            state.sent_chars = max(state.sent_chars, upto)
            return [(p.DeltaMessage(content=new), None)] if new else []
        # finished: the rest of the content, then every call with its whole arguments
        msg, reason = self.message(c)
        if not msg.tool_calls:  # plain text after all (no calls, or calls cut short)
            rest = c.text[state.sent_chars :]
            return [(p.DeltaMessage(content=rest or None), reason)]
        rest = (msg.content or "")[state.sent_chars :] if self.plan.mode == "auto" else ""
        calls = [
            p.DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=p.DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for i, call in enumerate(msg.tool_calls)
        ]
        return [(p.DeltaMessage(content=rest or None, tool_calls=calls), None), (p.DeltaMessage(), reason)]

    def chunk_choices(
        self, idx: int, c: CompletionOutput, chat_logprobs: Callable[[list[Any] | None], p.ChatLogprobs | None]
    ) -> list[p.ChatChunkChoice]:
        """This step's stream choices for choice `idx`; the first carries the logprobs of every token not sent yet
        (held-back ones too), formatted by `chat_logprobs`."""
        out = []
        for delta, reason in self.deltas(idx, c):
            lp = self._unsent_logprobs(idx, c)
            out.append(
                p.ChatChunkChoice(
                    index=idx,
                    delta=delta,
                    logprobs=chat_logprobs(lp) if lp else None,
                    finish_reason=reason,
                    stop_reason=c.stop_reason if reason is not None else None,
                )
            )
        return out

    def _unsent_logprobs(self, idx: int, c: CompletionOutput) -> list[Any] | None:
        if c.logprobs is None:
            return None
        state = self._streams[idx]
        start, state.sent_logprobs = state.sent_logprobs, len(c.logprobs)
        return c.logprobs[start:]
