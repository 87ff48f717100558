"""The model's sampling defaults, read from its generation_config.json (vLLM's `--generation-config auto`).

They fill the fields a request leaves unset (sampling_defaults); an explicit SamplingParams is taken as given, and
`generation_config="vllm"` ignores them. EOS ids in the file always count (generation_eos_ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmserve.sampling_params import SamplingParams

# generation_config.json key → SamplingParams field (the fields vLLM takes from it, minus max_new_tokens)
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return cfg


def generation_eos_ids(cfg: dict[str, Any]) -> list[int]:
    eos = cfg.get("eos_token_id")
    return list(eos) if isinstance(eos, list) else [] if eos is None else [int(eos)]


def sampling_defaults(model_dir: str | Path, mode: str) -> dict[str, Any]:
    """SamplingParams field → value from the model's generation_config.json ({} for mode "vllm" or no
    file). Checked once here so a bad file fails at load, not as a 400 on every request."""
    if mode == "vllm":
        return {}
    assert mode == "auto", f"generation_config mode {mode!r}"
    cfg = read_generation_config(model_dir)
    defaults = {field: cfg[key] for key, field in SAMPLING_KEYS.items() if cfg.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(
            f"{Path(model_dir) / 'generation_config.json'}: {e} (pass generation_config='vllm' to ignore the file)"
        ) from None
    return defaults
