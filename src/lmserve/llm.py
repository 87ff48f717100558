"""Offline inference: LLM(model).generate(prompts, sampling_params) -> list[RequestOutput]; LLM.chat(messages) through
the chat template, with reasoning and tool calls parsed as the server does."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any

from lmserve.config.engine import EngineArgs
from lmserve.core.outputs import CompletionOutput, RequestOutput
from lmserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from lmserve.engine.closing import EngineClosedError
from lmserve.engine.input_processor import Prompt
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.pooling import pooling_params
from lmserve.lora.request import LoRARequest
from lmserve.sampling_params import SamplingParams


@dataclass
class ChatCompletionOutput(CompletionOutput):
    """A chat choice: `text` is the content, beside the reasoning and the tool calls the parsers found."""

    reasoning_content: str | None = None
    tool_calls: list[Any] = field(default_factory=list)  # parsers.ToolCall (name, arguments JSON text, id)


class LLM:
    """Offline engine. close() (or the end of `with LLM(...) as llm:`, or the object's collection, or interpreter
    exit) ends its processes and threads and frees its model and KV pool; a closed LLM raises EngineClosedError."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            from lmserve.default_model import default_model_path

            model = default_model_path()
        self._engine: LLMEngine | None = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, **engine_args))
        self._finalizer = weakref.finalize(self, LLMEngine.close, self._engine)  # on collection or at exit

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineClosedError("this LLM is closed (close() or its `with` block ended); create a new one")
        return self._engine

    def close(self) -> None:
        """End the engine's processes and threads and free its memory; a second call does nothing."""
        self._engine = None
        self._finalizer()  # (runs LLMEngine.close once: later calls and collection do nothing)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. All prompts are validated before
        any is queued, so one bad prompt raises ValueError and nothing is half-run. lora_request: one adapter for
        every prompt, or a list with one (or None: the base model) per prompt (needs enable_lora=True)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text or token ids)
        prompts_list: list[Prompt] = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts_list):
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {len(prompts_list)} prompts (lengths must match)"
                )
            params_list = sampling_params
        else:
            # None: the model's generation_config.json defaults (EngineArgs.generation_config="auto")
            params_list = [sampling_params or self.engine.default_sampling_params()] * len(prompts_list)
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompts_list):
                raise ValueError(
                    f"lora_request: got {len(lora_request)} for {len(prompts_list)} prompts (lengths must match)"
                )
            loras = lora_request
        else:
            loras = [lora_request] * len(prompts_list)
        engine = self.engine
        for lora in dict.fromkeys(r for r in loras if r is not None):
            engine.add_lora(lora)  # a broken adapter raises before anything is queued
        for i, (prompt, params) in enumerate(zip(prompts_list, params_list, strict=True)):
            try:
                engine.validate(engine.tokenize(prompt)[1], params)
                if params.structured_outputs is not None:  # compiled on the pool; a refused grammar raises here
                    engine.structured.compile(params.structured_outputs).result()
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids = [
            engine.add_request(None, p, sp, lora_request=lr)
            for p, sp, lr in zip(prompts_list, params_list, loras, strict=True)
        ]
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], dimensions: int | None = None) -> list[list[float]]:
        """The embedding of every prompt (text or token ids), in input order, on a pooling engine (runner pooling,
        or auto with an embedding checkpoint); `dimensions`: Matryoshka truncation before normalising. A
        scoring model (pooler_config score_tokens) returns the scoring tokens' probabilities instead."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        engine = self.engine
        params = SamplingParams(max_tokens=0, pooling=pooling_params(engine.config, engine.tokenizer, dimensions))
        for i, prompt in enumerate(prompts):  # every prompt checked before any is queued
            try:
                engine.validate(engine.tokenize(prompt)[1], params)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids = [engine.add_request(None, p, params) for p in prompts]
        return [out.pooled for out in self._run(ids, use_tqdm=False)]  # type: ignore[misc]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        reasoning_parser: str = "auto",
        tool_parser: str = "auto",
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} messages) or to each of a list of
        them, through the chat template (with `tools` and `chat_template_kwargs`, e.g. {"enable_thinking": False}).
        Each output is a ChatCompletionOutput: `text` the content, `reasoning_content` and, with tools, the
        `tool_calls` — split by the named parsers ("auto": chosen from the template; reasoning "none": no split)."""
        from lmserve.parsers.chat_settings import ChatSettings

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        settings = ChatSettings(reasoning_parser, tool_parser)
        settings.resolve(tok)
        kwargs = settings.template_kwargs(chat_template_kwargs, None)
        if tools:
            kwargs["tools"] = tools
        texts = [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
            for c in conversations
        ]
        params = sampling_params or self.engine.default_sampling_params()
        keep = (settings.keeps_special_tokens or (tools and settings.tools.keeps_special_tokens)) and (
            params.skip_special_tokens
        )
        if keep:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the parsers' markers are special
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        for text, out in zip(texts, outs, strict=True):
            out.outputs = [self._chat_output(c, settings, text, tools, bool(keep)) for c in out.outputs]
        return outs

    def _chat_output(self, c: CompletionOutput, settings: Any, prompt: str, tools: Any, strip_eos: bool) -> Any:
        text = c.text
        if strip_eos and c.token_ids and str(c.finish_reason) == "stop":
            tail = self.engine.tokenizer.decode(c.token_ids[-1:], skip_special_tokens=False)
            text = text.removesuffix(tail) if c.stop_reason is None or isinstance(c.stop_reason, int) else text
        parser = settings.reasoning(prompt)
        reasoning, content = parser.extract(text) if parser is not None else (None, text)
        calls: list[Any] = []
        if tools:
            found, calls = settings.tools.extract(content or "", tools)
            content = found if calls else content
        fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(CompletionOutput)}
        fields["text"] = content or ""
        return ChatCompletionOutput(**fields, reasoning_content=reasoning, tool_calls=calls)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]

    def beam_search(
        self, prompts: Prompt | list[Prompt], params: BeamSearchParams, lora_request: LoRARequest | None = None
    ) -> list[BeamSearchOutput]:
        """Beam search (HF generate(num_beams=...) semantics) for every prompt, under lora_request if given; outputs
        in input order."""
        if lora_request is not None:
            self.engine.add_lora(lora_request)  # a broken adapter raises before anything is queued
        return beam_search(self.engine, prompts, params, lora_request)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()
