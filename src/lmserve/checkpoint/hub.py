"""A model argument → a local HF model directory (resolve_model_path): an existing path as it is, else a Hub id
fetched through huggingface_hub's cache (`snapshot_download`, only the files the engine reads), its errors turned
into ValueErrors naming the id and the revision.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What the engine reads from a checkpoint: config, generation defaults, weights, tokenizer, chat template.
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# huggingface_hub's own rule for repo ids: one optional namespace, name of [\w.-], no "--" or "..".
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def is_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and "--" not in model and ".." not in model and model.count("/") == 1


def resolve_model_path(model: str, revision: str | None = None, patterns: tuple[str, ...] = MODEL_FILE_PATTERNS) -> str:
    """The local path of `model`: the directory (or a file, such as a .gguf) itself if it exists, else the Hub snapshot
    (downloaded into the HF cache unless HF_HUB_OFFLINE=1). Raises ValueError naming id and revision."""
    local = Path(model).expanduser()
    if local.exists():
        return str(local)
    if not is_repo_id(model):
        raise ValueError(f"model: {model!r} is neither a local path nor a Hugging Face Hub id ('org/name')")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.is_offline_mode()
    what = f"model {model!r} (revision {revision or 'main'!r})"
    try:
        path = snapshot_download(
            model,
            revision=revision,
            allow_patterns=list(patterns),  # `lmserve memory` needs config.json alone
            local_files_only=offline,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except GatedRepoError as e:
        raise ValueError(f"{what} is gated: accept its terms on the Hub and set HF_TOKEN ({e})") from None
    except RevisionNotFoundError:
        raise ValueError(f"{what}: the Hub repository has no such revision") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what} is not on the Hub, or is private (set HF_TOKEN), and no local directory has that name"
        ) from None
    except LocalEntryNotFoundError as e:
        if offline:
            raise ValueError(
                f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; "
                f"download it once with the network available, or unset HF_HUB_OFFLINE"
            ) from None
        raise ValueError(f"{what} could not be fetched from the Hub and is not cached: {e}") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{what}: the Hub answered {e}") from None
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{what}: the snapshot at {path} has no config.json (not a transformers model repository?)")
    return path
