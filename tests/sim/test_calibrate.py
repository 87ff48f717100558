"""lmserve.sim.calibrate: the loads it serves to time served steps."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from lmserve.bench.datasets import load_tokenizer
from lmserve.default_model import default_model_path
from lmserve.sim.grid_profile import Grid
from lmserve.sim.served_steps import served_loads


def test_served_loads_cover_every_batch_size_in_a_seeded_shuffled_order() -> None:
    grid = Grid.full()
    tok = load_tokenizer(default_model_path())
    loads = served_loads(grid, tok, max_len=1024)
    sizes = [d for _, d, _ in loads]
    batches = [b for b in grid.decode_batches if b > 0]
    # every decode batch twice (short and long prompts), and one stream over a shared prefix; all closed loops
    assert sorted(sizes) == sorted([*batches, *batches, 1])
    for reqs, d, rate in loads:
        assert len(reqs) >= 2 * d and rate == math.inf  # each stream serves more than one request
    # not in order of batch size: served so, the machine's drift over the minute would read as a cost of the rows
    descents = sum(a > b for a, b in pairwise(sizes))
    ascents = sum(a < b for a, b in pairwise(sizes))
    assert descents >= 4 and ascents >= 4, sizes
    again = served_loads(grid, tok, max_len=1024)
    assert [(d, [r.prompt_token_ids for r in reqs]) for reqs, d, _ in again] == [
        (d, [r.prompt_token_ids for r in reqs]) for reqs, d, _ in loads
    ]
    # with a request's time alone: two open loops of Poisson arrivals besides, at 1 and 2 requests per that time
    with_poisson = served_loads(grid, tok, max_len=1024, request_s=0.05)
    open_loops = [(reqs, rate) for reqs, d, rate in with_poisson if d is None]
    assert sorted(rate for _, rate in open_loops) == pytest.approx([20.0, 40.0])
    assert all(len(reqs) == 40 * grid.repeats and reqs[0].output_len == 32 for reqs, _ in open_loops)
    assert len(with_poisson) == len(loads) + 2
