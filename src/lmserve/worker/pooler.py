"""The pooling runner's step: each pooling request's share of the step's hidden states (rows after the final
norm) reduced to its output once its prompt is computed — the last row, the mean of all rows (summed across
prefill chunks), or the first — cut to `dimensions` and L2-normalised; or, with score_token_ids, the softmax over
those tokens' logits at the last row (a yes/no reranker's p(yes) is the last of them)."""

from __future__ import annotations

from typing import Any

import torch

from lmserve.core.outputs import ScheduledRequest


def pool_step(
    ordered: list[ScheduledRequest], first_row: dict[str, int], hidden: torch.Tensor, model: Any
) -> dict[str, list[float]]:
    """Request id → pooled output of every pooling request whose prompt this step finishes."""
    out: dict[str, list[float]] = {}
    for s in ordered:
        req = s.request
        params = req.sampling_params.pooling
        if params is None:
            continue
        row0 = first_row[req.request_id]
        rows = hidden[row0 : row0 + s.num_new_tokens]
        if params.pooling_type == "mean":  # float32 sums; restarted when the prompt is computed from position 0
            total = rows.float().sum(0)
            req.pooling_state = total if s.start == 0 or req.pooling_state is None else req.pooling_state + total
        elif params.pooling_type == "cls" and s.start == 0:
            req.pooling_state = rows[0].float()
        if not s.reaches_end:
            continue
        if params.score_token_ids:
            logits = model.compute_logits(rows[-1:])[0]
            ids = torch.tensor(params.score_token_ids, dtype=torch.long, device=logits.device)
            out[req.request_id] = torch.softmax(logits.float()[ids], dim=-1).tolist()
            continue
        if params.pooling_type == "last":
            vec = rows[-1].float()
        elif params.pooling_type == "mean":
            vec = req.pooling_state / req.num_prompt_tokens
        else:
            vec = req.pooling_state
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        if params.normalize:
            vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
        req.pooling_state = None
        out[req.request_id] = vec.tolist()
    return out
