"""Benchmark datasets: exact prompt lengths, unique prompts, shared prefixes, file formats, flag errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmserve.bench.datasets import DatasetConfig, PromptBuilder, build_requests, load_tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return load_tokenizer(str(tokenizer_dir))


def test_random_lengths_are_exact_and_prompts_unique(tok):
    cfg = DatasetConfig(num_requests=40, input_len=32, output_len=10, range_ratio=0.5, seed=3)
    reqs = build_requests(cfg, tok)
    assert len(reqs) == 40 and len({r.prompt for r in reqs}) == 40
    for r in reqs:
        assert list(tok.encode(r.prompt)) == r.prompt_token_ids
        assert 16 <= r.prompt_len <= 48 and 5 <= r.output_len <= 15
    assert len({r.prompt_len for r in reqs}) > 1
    assert [r.prompt for r in build_requests(cfg, tok)] == [r.prompt for r in reqs]  # seeded


def test_random_fixed_lengths(tok):
    reqs = build_requests(DatasetConfig(num_requests=5, input_len=7, output_len=3), tok)
    assert [r.prompt_len for r in reqs] == [7] * 5 and [r.output_len for r in reqs] == [3] * 5


def test_fallback_without_word_tokens_is_exact(tok):
    builder = PromptBuilder(tok, seed=1)
    builder.words = []  # as for a tokenizer with no single-token " word" pieces
    for n in (1, 5, 33):
        assert len(tok.encode(builder.text(n), add_special_tokens=False)) == n


def test_prefix_groups_share_their_prefix(tok):
    cfg = DatasetConfig(
        name="prefix", num_requests=6, input_len=8, output_len=4, prefix_len=24, num_prefix_groups=2
    )
    reqs = build_requests(cfg, tok)
    assert [r.prompt_len for r in reqs] == [32] * 6
    assert len({r.prompt for r in reqs}) == 6
    heads = [tuple(r.prompt_token_ids[:24]) for r in reqs]
    assert heads[0] == heads[2] == heads[4] and heads[1] == heads[3] == heads[5] and heads[0] != heads[1]


def test_sharegpt(tok, tmp_path: Path):
    words = " the cat sat on the mat and then went home to sleep"
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}{words}"},
                {"from": "gpt", "value": words},
            ]
        }
        for i in range(5)
    ]
    data.append(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words}]}
    )  # too short
    data.append({"id": "no turns"})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = build_requests(DatasetConfig(name="sharegpt", num_requests=5, dataset_path=str(path)), tok)
    assert len(reqs) == 5 and len({r.prompt for r in reqs}) == 5
    assert all(r.output_len == len(tok.encode(words, add_special_tokens=False)) for r in reqs)
    fixed = build_requests(
        DatasetConfig(name="sharegpt", num_requests=2, dataset_path=str(path), sharegpt_output_len=7), tok
    )
    assert [r.output_len for r in fixed] == [7, 7]
    with pytest.raises(ValueError, match="--num-requests=6"):
        build_requests(DatasetConfig(name="sharegpt", num_requests=6, dataset_path=str(path)), tok)


def test_jsonl(tok, tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"prompt": "bye", "output_len": 2}\n')
    reqs = build_requests(DatasetConfig(name="jsonl", num_requests=2, dataset_path=str(path)), tok)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 5), ("bye", 2)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"--dataset-path: .*bad.jsonl:1"):
        build_requests(DatasetConfig(name="jsonl", num_requests=1, dataset_path=str(bad)), tok)


@pytest.mark.parametrize(
    "cfg, flag",
    [
        (DatasetConfig(name="nope"), "--dataset"),
        (DatasetConfig(num_requests=0), "--num-requests"),
        (DatasetConfig(input_len=0), "--input-len"),
        (DatasetConfig(output_len=0), "--output-len"),
        (DatasetConfig(range_ratio=1.0), "--range-ratio"),
        (DatasetConfig(name="prefix", prefix_len=0), "--prefix-len"),
        (DatasetConfig(name="jsonl"), "--dataset-path"),
        (DatasetConfig(name="sharegpt", dataset_path="/nonexistent.json"), "--dataset-path"),
    ],
)
def test_bad_config_names_the_flag(tok, cfg, flag):
    with pytest.raises(ValueError, match=flag):
        build_requests(cfg, tok)


def test_too_few_distinct_prompts(tok):
    with pytest.raises(ValueError, match="--input-len"):
        build_requests(DatasetConfig(num_requests=5000, input_len=1), tok)
