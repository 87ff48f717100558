"""lmserve.sim.calibrate: the loads it serves to time served steps."""

from __future__ import annotations

from itertools import pairwise

from lmserve.bench.datasets import load_tokenizer
from lmserve.default_model import default_model_path
from lmserve.sim.calibrate import Grid, served_loads


def test_served_loads_cover_every_batch_size_in_a_seeded_shuffled_order() -> None:
    grid = Grid.full()
    tok = load_tokenizer(default_model_path())
    loads = served_loads(grid, tok, max_len=1024)
    sizes = [d for _, d in loads]
    batches = [b for b in grid.decode_batches if b > 0]
    # every decode batch twice (short and long prompts), and one stream over a shared prefix
    assert sorted(sizes) == sorted([*batches, *batches, 1])
    for reqs, d in loads:
        assert len(reqs) >= 2 * d  # each stream serves more than one request: joins beside running decodes
    # not in order of batch size: served so, the machine's drift over the minute would read as a cost of the rows
    descents = sum(a > b for a, b in pairwise(sizes))
    ascents = sum(a < b for a, b in pairwise(sizes))
    assert descents >= 4 and ascents >= 4, sizes
    again = served_loads(grid, tok, max_len=1024)
    assert [(d, [r.prompt_token_ids for r in reqs]) for reqs, d in again] == [
        (d, [r.prompt_token_ids for r in reqs]) for reqs, d in loads
    ]
