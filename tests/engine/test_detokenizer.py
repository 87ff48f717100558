"""IncrementalDetokenizer: streamed deltas equal the full decode, UTF-8 splits never leak, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmserve.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from lmserve.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a test. The quick brown fox jumps over the lazy dog!",
    "Don't stop believing; it's what we're doing, isn't it? Yes , it is .",
    "你好，世界！今天天气很好。我们去公园散步吧。中文分词测试，世界你好。",
    "Emoji time 😀😃😄 🎉🎉 🚀 and mixed 中文 text 👍 ok? 🇫🇷 flags é ü ß",
    "STOP here. ### end ### and more text after the marker <b>bold</b>",
] * 10
SPECIALS = ["<|endoftext|>", "<|pad|>"]
ALPHABET = sorted(set("".join(CORPUS)))


def _train(pre_tokenizer: Any, decoder: Any, normalizer: Any = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE, saved and reloaded through AutoTokenizer like a real checkpoint."""
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    path: Path = tmp_path_factory.mktemp("bytelevel_tokenizer")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1]
    ).save_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    # Multi-byte characters really are split across tokens, so the UTF-8 hold-back is exercised.
    pieces = [loaded.decode([i]) for i in loaded.encode("😀中", add_special_tokens=False)]
    assert any("\ufffd" in p for p in pieces)
    return loaded


@pytest.fixture(scope="module")
def byte_level_cleanup() -> PreTrainedTokenizerFast:
    """Same tokenizer but decode() applies clean_up_tokenization (" ." -> "." ...)."""
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIALS[0],
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    ids = hf.encode("a . b", add_special_tokens=False)
    assert hf.decode(ids) == "a. b"  # the cleanup is really on
    return hf


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style: the decoder strips the first token's leading space."""
    tok = _train(
        pre_tokenizers.Metaspace(prepend_scheme="first"),
        decoders.Metaspace(prepend_scheme="first"),
        normalizers.NFC(),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0])


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[DetokenizerUpdate]:
    updates, pos, c = [], 0, 0
    while pos < len(ids):
        size = chunks[c % len(chunks)] if chunks else 1
        updates.append(detok.update(ids[pos : pos + size]))
        pos += size
        c += 1
    return updates


def _check_stream(tokenizer: Any, ids: list[int], chunks: list[int], skip_special: bool) -> None:
    params = SamplingParams(skip_special_tokens=skip_special)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    updates = _stream(detok, ids, chunks)
    tail = detok.flush()
    full = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert "".join(u.delta_text for u in updates) + tail == full
    assert detok.output_text == full
    assert all(u.stop_str is None for u in updates)
    if "\ufffd" not in full:
        assert all("\ufffd" not in u.delta_text for u in updates)


ids_strategy = st.lists(st.integers(0, 419), max_size=40)
chunks_strategy = st.lists(st.integers(1, 4), min_size=1, max_size=5)
# Pieces include special tokens and the patterns clean_up_tokenization rewrites.
TEXT_PIECES = ALPHABET + SPECIALS + ["  ", " .", " 's", " n't", " ' "]
text_strategy = st.lists(st.sampled_from(TEXT_PIECES), max_size=40).map("".join)
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("tokenizer_name", ["byte_level", "byte_level_cleanup", "metaspace"])
@SETTINGS
@given(ids=ids_strategy, chunks=chunks_strategy, skip_special=st.booleans())
def test_stream_equals_full_decode_random_ids(
    request: pytest.FixtureRequest, tokenizer_name: str, ids: list[int], chunks: list[int], skip_special: bool
) -> None:
    tokenizer = request.getfixturevalue(tokenizer_name)
    _check_stream(tokenizer, [i % len(tokenizer) for i in ids], chunks, skip_special)


@pytest.mark.parametrize("tokenizer_name", ["byte_level", "byte_level_cleanup", "metaspace"])
@SETTINGS
@given(text=text_strategy, chunks=chunks_strategy, skip_special=st.booleans())
def test_stream_equals_full_decode_real_text(
    request: pytest.FixtureRequest, tokenizer_name: str, text: str, chunks: list[int], skip_special: bool
) -> None:
    tokenizer = request.getfixturevalue(tokenizer_name)
    _check_stream(tokenizer, tokenizer.encode(text, add_special_tokens=False), chunks, skip_special)


STOP_ALPHABET = st.sampled_from(ALPHABET[:40] + ["。", "😀", " "])


def _expected_with_stops(full: str, stops: list[str], include: bool, boundary: int = 0) -> tuple[str, str | None]:
    """Reference: cut at the stop string that completes first in the full text, ending past `boundary`
    characters (the text of the first min_tokens tokens, where no stop string may end)."""
    best = None
    for s in stops:
        i = full.find(s, max(0, boundary - len(s) + 1))
        if i != -1 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return full, None
    end, start, s = best
    return full[: end if include else start], s


@SETTINGS
@given(text=text_strategy, chunks=chunks_strategy, include=st.booleans(), data=st.data())
def test_stop_strings_property(
    byte_level: Any, text: str, chunks: list[int], include: bool, data: st.DataObject
) -> None:
    ids = byte_level.encode(text, add_special_tokens=False)
    full = byte_level.decode(ids, skip_special_tokens=True)
    # Stop strings: substrings of the output (so they match, often across tokens) and random ones.
    substrings = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda i: st.integers(i + 1, i + 6).map(lambda j: full[i:j] or "#")
    )
    random_stops = st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4)
    stops = data.draw(st.lists(st.one_of(substrings, random_stops), min_size=1, max_size=3))
    min_tokens = data.draw(st.one_of(st.just(0), st.integers(0, len(ids) + 1)))
    # The first min_tokens tokens' text; a character they only begin belongs to the tokens after them.
    boundary = len(byte_level.decode(ids[:min_tokens], skip_special_tokens=True).rstrip("\ufffd"))
    expected, expected_stop = _expected_with_stops(full, stops, include, boundary)

    params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=None)
    detok = IncrementalDetokenizer(byte_level, [], params)
    streamed = ""
    for upd in _stream(detok, ids, chunks):
        streamed += upd.delta_text
        assert expected.startswith(streamed)  # nothing past the cut ever leaks, even transiently
        if upd.stop_str is not None:
            assert upd.stop_str == expected_stop
    if expected_stop is None:
        streamed += detok.flush()
    assert streamed == expected
    assert detok.stop_str == expected_stop
    assert detok.output_text == expected


def _emit(tokenizer: Any, text: str, params: SamplingParams) -> tuple[IncrementalDetokenizer, str]:
    """Feed `text`'s tokens one at a time; return the detokenizer and the streamed text (no flush)."""
    detok = IncrementalDetokenizer(tokenizer, [], params)
    return detok, "".join(
        detok.update([i]).delta_text for i in tokenizer.encode(text, add_special_tokens=False)
    )


def _feed_one_by_one(
    tokenizer: Any, text: str, params: SamplingParams
) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas = []
    for i in tokenizer.encode(text, add_special_tokens=False):
        upd = detok.update([i])
        deltas.append(upd.delta_text)
        if upd.stop_str is not None:
            break
    return detok, deltas


def test_multibyte_chars_never_leak_replacement(byte_level: Any) -> None:
    text = "你好😀🎉世界 🇫🇷"
    detok, deltas = _feed_one_by_one(byte_level, text, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # some tokens were partial characters and were held


def test_stop_string_split_across_tokens(byte_level: Any) -> None:
    text = "今天天气很好。我们去公园"
    ids = byte_level.encode(text, add_special_tokens=False)
    # The stop string spans several byte-level tokens.
    assert len(byte_level.encode("天气很好", add_special_tokens=False)) > 1
    detok, deltas = _feed_one_by_one(byte_level, text, SamplingParams(stop=["天气很好"]))
    assert "".join(deltas) == "今天"
    assert detok.stop_str == "天气很好" and detok.finished
    assert len(deltas) < len(ids)
    # After the stop nothing more comes out.
    assert detok.update(ids[-1:]) == DetokenizerUpdate("", None)
    assert detok.flush() == ""
    assert detok.output_text == "今天"


def test_include_stop_str_in_output(byte_level: Any) -> None:
    params = SamplingParams(stop=["###"], include_stop_str_in_output=True)
    detok, deltas = _feed_one_by_one(byte_level, "STOP here. ### end ###", params)
    assert "".join(deltas) == "STOP here. ###"
    assert detok.stop_str == "###"


def test_earliest_completing_stop_wins(byte_level: Any) -> None:
    detok, deltas = _feed_one_by_one(
        byte_level, "the quick brown fox", SamplingParams(stop=["brown fox", "quick"])
    )
    assert "".join(deltas) == "the " and detok.stop_str == "quick"


def test_hold_back_only_what_a_stop_string_could_need(byte_level: Any) -> None:
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(byte_level, [], params)
    emitted = ""
    for i in byte_level.encode("lazy dog ST", add_special_tokens=False):
        emitted += detok.update([i]).delta_text
    # "ST" could still become "STOP": exactly those 2 characters are held back.
    assert emitted == "lazy dog "
    emitted += detok.update(byte_level.encode("a", add_special_tokens=False)).delta_text
    assert emitted == "lazy dog STa"  # "STa" cannot start "STOP": released at once
    # Nothing is held when the tail cannot begin any stop string.
    detok, emitted = _emit(byte_level, "quick fox", SamplingParams(stop=["STOP"]))
    assert emitted == "quick fox"
    # Never more than max(len(stop)) - 1 characters.
    detok, emitted = _emit(byte_level, "SSSSSS", SamplingParams(stop=["SSSS"]))
    assert emitted == ""  # "SSSS" itself matched: cut before it
    detok, emitted = _emit(byte_level, "SSSSSS", SamplingParams(stop=["SSSX"]))
    assert emitted == "SSS"
    assert detok.flush() == "SSS"


def test_flush_releases_held_text(byte_level: Any) -> None:
    detok, emitted = _emit(byte_level, "end #", SamplingParams(stop=["###"]))
    assert emitted == "end "
    assert detok.flush() == "#"
    assert detok.output_text == "end #" and detok.stop_str is None


def test_skip_special_tokens(byte_level: Any) -> None:
    eos = byte_level.convert_tokens_to_ids(SPECIALS[0])
    ids = byte_level.encode("Hello", add_special_tokens=False) + [eos]
    for skip in (True, False):
        detok = IncrementalDetokenizer(byte_level, [], SamplingParams(skip_special_tokens=skip))
        text = "".join(detok.update([i]).delta_text for i in ids) + detok.flush()
        assert text == ("Hello" if skip else "Hello" + SPECIALS[0])


def test_metaspace_leading_space_after_skipped_special(metaspace: Any) -> None:
    eos = metaspace.convert_tokens_to_ids(SPECIALS[0])
    ids = metaspace.encode("Hello world", add_special_tokens=False)
    ids = ids[:1] + [eos] + ids[1:]
    detok = IncrementalDetokenizer(metaspace, [], SamplingParams())
    text = "".join(detok.update([i]).delta_text for i in ids) + detok.flush()
    assert text == metaspace.decode(ids, skip_special_tokens=True) == "Hello world"


def test_min_tokens_ignores_stop_strings_inside_them(byte_level: Any) -> None:
    text = "a.b.c.d"
    ids = byte_level.encode(text, add_special_tokens=False)
    ends = [len(byte_level.decode(ids[:k])) for k in range(len(ids) + 1)]
    m = next(k for k in range(len(ids)) if "." in text[: ends[k]] and "." in text[ends[k] :])
    detok, deltas = _feed_one_by_one(byte_level, text, SamplingParams(stop=["."], min_tokens=m, max_tokens=None))
    cut = text.index(".", ends[m])  # the first "." past the first m tokens' text
    assert "".join(deltas) == text[:cut] and detok.stop_str == "." and len(deltas) > m
    # min_tokens covering every token: no stop at all
    detok, deltas = _feed_one_by_one(byte_level, text, SamplingParams(stop=["."], min_tokens=len(ids), max_tokens=None))
    assert "".join(deltas) == text and detok.stop_str is None


def test_min_tokens_stop_string_straddling_the_boundary(byte_level: Any) -> None:
    text, stop = "the lazy dog. the lazy dog.", "lazy dog"
    ids = byte_level.encode(text, add_special_tokens=False)
    ends = [len(byte_level.decode(ids[:k])) for k in range(len(ids) + 1)]
    first, second = text.index(stop), text.rindex(stop)
    # min_tokens ending inside the first "lazy dog": it straddles the boundary and stops the output there
    m = next(k for k in range(len(ids)) if first < ends[k] < first + len(stop))
    for include, expected in ((False, text[:first]), (True, text[: first + len(stop)])):
        params = SamplingParams(stop=[stop], min_tokens=m, max_tokens=None, include_stop_str_in_output=include)
        detok, deltas = _feed_one_by_one(byte_level, text, params)
        assert "".join(deltas) == expected and detok.stop_str == stop
    # the whole first one inside the first min_tokens tokens: ignored, the second one stops the output
    m = next(k for k in range(len(ids)) if ends[k] >= first + len(stop))
    for include, expected in ((False, text[:second]), (True, text[: second + len(stop)])):
        params = SamplingParams(stop=[stop], min_tokens=m, max_tokens=None, include_stop_str_in_output=include)
        detok, deltas = _feed_one_by_one(byte_level, text, params)
        assert "".join(deltas) == expected and detok.stop_str == stop
