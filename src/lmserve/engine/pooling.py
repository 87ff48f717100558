"""The PoolingParams of one request on a pooling engine: the engine's pooler (model_config.PoolerConfig) with
the request's `dimensions` checked against the model (its hidden size, its Matryoshka dimensions) and the
scorer's tokens resolved to ids; ValueError naming the field for what the model cannot give."""

from __future__ import annotations

from typing import Any

from lmserve.config.engine import EngineConfig
from lmserve.sampling_params import PoolingParams


def pooling_params(config: EngineConfig, tokenizer: Any, dimensions: int | None = None) -> PoolingParams:
    pooler = config.pooler
    if pooler is None:
        raise ValueError(
            "runner: this engine runs the generate runner: embeddings and scores need --runner pooling "
            "(or --runner auto with an embedding checkpoint)"
        )
    hidden = config.model.hidden_size
    if dimensions is not None:
        if pooler.is_scorer:
            raise ValueError("dimensions: this model scores (yes/no tokens); it has no embedding to shorten")
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be an integer in [1, {hidden}] (the model's size), got {dimensions!r}")
        dims = pooler.matryoshka_dimensions
        if dims and dimensions not in dims:
            raise ValueError(f"dimensions: the model was trained for {sorted(dims)}, got {dimensions}")
    ids = tuple(score_token_ids(tokenizer, pooler.score_tokens)) if pooler.score_tokens else ()
    return PoolingParams(pooler.pooling_type, pooler.normalize, dimensions, ids, pooler.classifier)  # type: ignore


def score_token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> list[int]:
    """Each scoring token as one vocabulary entry (a reranker's "no" and "yes")."""
    ids = []
    for t in tokens:
        tid = tokenizer.convert_tokens_to_ids(t)
        if tid is None or tid == tokenizer.unk_token_id and t != tokenizer.unk_token:
            raise ValueError(f"pooler_config.score_tokens: {t!r} is not one token of the vocabulary")
        ids.append(int(tid))
    return ids
