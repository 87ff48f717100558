"""sse.py: ChunkTemplate writes the same bytes as the chunk model it was built from, and a whole stream's events
are byte-identical whether its plain token steps take the template or the models."""

from __future__ import annotations

import asyncio
import types

import pytest

from lmserve.core.outputs import CompletionOutput, FinishReason, RequestOutput
from lmserve.entrypoints.openai import protocol as p
from lmserve.entrypoints.openai.serving_chat import ChatGeneration
from lmserve.entrypoints.openai.serving_completion import CompletionGeneration
from lmserve.entrypoints.openai.sse import ChunkTemplate, sse
from lmserve.entrypoints.openai.state import ServerState
from lmserve.sampling_params import SamplingParams

TEXTS = [chr(i) for i in range(128)]
TEXTS += ["", " hello", 'a "quoted" \\ back\\slash', "é 中文 😀 \u2028\u2029 \ufffd", "\r\n\t"]


@pytest.mark.parametrize("index", [0, 3])
def test_template_writes_the_models_bytes(index: int) -> None:
    def completion(text: str) -> p.CompletionChunk:
        choice = p.CompletionChoice(index=index, text=text)
        return p.CompletionChunk(id="cmpl-1", created=7, model="m", choices=[choice])

    def chat(text: str) -> p.ChatCompletionChunk:
        choice = p.ChatChunkChoice(index=index, delta=p.DeltaMessage(content=text))
        return p.ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[choice])

    for build in (completion, chat):
        template = ChunkTemplate(build(ChunkTemplate.MARKER))
        for text in TEXTS:
            assert template(text) == sse(build(text)), repr(text)


def test_template_needs_the_marker_once() -> None:
    with pytest.raises(AssertionError, match="exactly once"):
        ChunkTemplate(p.CompletionChunk(id="x", created=1, model="m", choices=[p.CompletionChoice(index=0, text="")]))


class _Stream:
    """One prompt's outputs as the engine would deliver them."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self._outputs = outputs

    def __aiter__(self):  # noqa: ANN204
        return self._gen()

    async def _gen(self):  # noqa: ANN202
        for out in self._outputs:
            yield out

    def abort(self) -> None:
        pass


def _outputs(n: int, texts: list[list[str]]) -> list[RequestOutput]:
    """Cumulative outputs of n choices, one step per entry of texts (per choice: its new text); the last ends."""
    so_far = [""] * n
    outs = []
    for step, deltas in enumerate(texts):
        last = step == len(texts) - 1
        choices = []
        for i, d in enumerate(deltas):
            so_far[i] += d
            ids = list(range(step + 1))
            choices.append(CompletionOutput(
                index=i, text=so_far[i], token_ids=ids, delta_text=d, delta_token_ids=[step],
                finish_reason=FinishReason.LENGTH if last else None,
            ))  # fmt: skip
        outs.append(RequestOutput("r-0", None, [1, 2], choices, last, 0, None))  # type: ignore[arg-type]
    return outs


async def _events(gen, plain: bool) -> str:  # noqa: ANN001
    if not plain:
        gen.is_plain_step = lambda idx, c: False
    return "".join([e async for e in gen.events()])


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_events_same_with_and_without_the_template(kind: str) -> None:
    state = ServerState("m", None, 1 << 20, token_bytes=types.SimpleNamespace(special_ids=frozenset()))
    texts = [["Hel", "A"], ["lo", ""], [" wo\"r\\ld\n", "é😀"], ["", "b"], ["!", "c"]]
    runs = []
    for plain in (True, False):
        if kind == "completion":
            body = p.CompletionRequest(model="m", prompt="x", stream=True, n=2, stream_options={"include_usage": True})
            gen = CompletionGeneration(state, None, "cmpl-1", [[1, 2]], SamplingParams(n=2), body)
        else:
            body = p.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True, n=2)
            gen = ChatGeneration(state, None, "chatcmpl-1", [[1, 2]], SamplingParams(n=2), body)
        gen.created = 7
        gen.streams = [_Stream(_outputs(2, texts))]
        runs.append(asyncio.run(_events(gen, plain)))
        if plain:
            assert len(gen._templates) == 2, "both choices' middle steps took the template"
    assert runs[0] == runs[1]
    assert runs[0].count("data: ") == (12 if kind == "completion" else 13)
