"""The pooling runner's step: each pooling request's share of the step's hidden states (rows after the final
norm) reduced to its output once its prompt is computed — the last row, the mean of all rows (summed across
prefill chunks), or the first — cut to `dimensions` and L2-normalised; or, with score_token_ids, the softmax over
those tokens' logits at the last row (a yes/no reranker's p(yes) is the last of them), or a cross-encoder's
classifier head on the last row."""

from __future__ import annotations

from pathlib import Path
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
        if params.classify:
            logits = classifier(model)(rows[-1:].float())[0]
            out[req.request_id] = (torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)).tolist()
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


def classifier(model: Any) -> torch.nn.Linear:
    """The checkpoint's classifier head (`score.weight`, labels × hidden) of a *ForSequenceClassification model,
    read from its safetensors once, in float32."""
    head = getattr(model, "_lmserve_classifier", None)
    if head is None:
        from safetensors import safe_open

        from lmserve.model.loader import checkpoint_files

        weight = None
        for f in checkpoint_files(Path(model.config.path)):
            with safe_open(str(f), framework="pt") as st:
                if "score.weight" in st.keys():
                    weight = st.get_tensor("score.weight").float()
        assert weight is not None, f"{model.config.path}: a *ForSequenceClassification checkpoint without score.weight"
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight.data = weight.to(next(model.parameters()).device)
        model._lmserve_classifier = head
    return head
