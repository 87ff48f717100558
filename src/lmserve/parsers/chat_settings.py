"""ChatSettings: a server's chat-side options (reasoning and tool-call parsers, chat template and its default
kwargs), checked at start-up and resolved against the model's chat template once it is loaded; plus the
per-request chat template kwargs (`chat_template_kwargs`, `reasoning_effort`) merged over the server's defaults."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from lmserve import parsers

logger = logging.getLogger(__name__)

AUTO, NONE = "auto", "none"
# keys the server itself passes to the template: a request may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "return_dict",
     "continue_final_message", "documents"}
)  # fmt: skip


class RequestError(ValueError):
    """A request value the server refuses, with the API field it belongs to."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ChatSettings:
    """reasoning_parser / tool_parser: a parser name, "auto" (chosen from the chat template: parsers.detect_parsers)
    or "none" (reasoning: not split; tools: Hermes). ValueError listing the known names for an unknown one."""

    reasoning_parser: str = AUTO
    tool_parser: str = AUTO
    chat_template: str | None = None  # replaces the model's template
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # resolved by resolve() once the tokenizer is known
    reasoning_cls: type[parsers.ReasoningParser] | None = None
    tools: parsers.ToolParser = field(default_factory=parsers.HermesToolParser)

    def __post_init__(self) -> None:
        if self.reasoning_parser not in (AUTO, NONE):
            parsers.reasoning_parser(self.reasoning_parser)
        if self.tool_parser not in (AUTO, NONE):
            parsers.tool_parser(self.tool_parser)
        if not isinstance(self.default_template_kwargs, dict):
            raise ValueError("default chat template kwargs must be a JSON object")

    def resolve(self, tokenizer: Any) -> None:
        """Install the template override on `tokenizer` and choose the parsers (logged)."""
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = " ".join(template.values())
        found_reasoning, found_tools = parsers.detect_parsers(template)
        reasoning = found_reasoning if self.reasoning_parser == AUTO else self.reasoning_parser
        tools = (found_tools or "hermes") if self.tool_parser in (AUTO, NONE) else self.tool_parser
        self.reasoning_cls = None if reasoning in (None, NONE) else parsers.reasoning_parser(reasoning)
        self.tools = parsers.tool_parser(tools)
        logger.info("reasoning parser: %s; tool call parser: %s", reasoning or "none", tools)

    def reasoning(self, prompt_text: str) -> parsers.ReasoningParser | None:
        """A new reasoning parser for one output sequence of this prompt, or None when reasoning is not split."""
        return None if self.reasoning_cls is None else self.reasoning_cls(prompt_text)

    @property
    def keeps_special_tokens(self) -> bool:
        return self.reasoning_cls is not None and self.reasoning_cls.keeps_special_tokens

    def template_kwargs(self, request_kwargs: Any, reasoning_effort: Any) -> dict[str, Any]:
        """The kwargs for the chat template: the server's defaults, then the request's `chat_template_kwargs`,
        and `reasoning_effort` (also `enable_thinking: false` for "none" unless given). RequestError naming the
        field for a value that is not an object, or that sets a key the server passes itself."""
        out = dict(self.default_template_kwargs)
        if request_kwargs is not None:
            if not isinstance(request_kwargs, dict):
                raise RequestError(
                    f"chat_template_kwargs must be an object, got {request_kwargs!r}", "chat_template_kwargs"
                )
            reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(request_kwargs))
            if reserved:
                raise RequestError(
                    f"chat_template_kwargs may not set {reserved}: the server passes them itself",
                    "chat_template_kwargs",
                )
            out.update(request_kwargs)
        if reasoning_effort is not None:
            if not isinstance(reasoning_effort, str):
                raise RequestError(f"reasoning_effort must be a string, got {reasoning_effort!r}", "reasoning_effort")
            out.setdefault("reasoning_effort", reasoning_effort)
            if reasoning_effort == "none":
                out.setdefault("enable_thinking", False)
        return out
