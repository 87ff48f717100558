"""The server's LoRA adapters by name (LoRAModules): `--lora-modules name=path ...` and /v1/load_lora_adapter's,
each a LoRARequest, with the count of API requests of each in flight. See docs/lora.md.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field

from lmserve.config.engine import ModelConfig
from lmserve.lora.adapter import load_adapter
from lmserve.lora.request import LoRARequest


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """`name=path` or vLLM's JSON `{"name": ..., "path": ...}` → (name, path); ValueError naming --lora-modules."""
    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                what = "is not name=path or a JSON object with name and path"
                raise ValueError(f"--lora-modules: {spec!r} {what}") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {spec!r} is not name=path")
        out.append((str(name), str(path)))
    return out


@dataclass
class LoRAModules:
    """Adapters by name. Each gets an id never reused, so a reloaded name never meets KV cached under its predecessor.

    Adapters are validated here against the base model's shapes (a broken path is a 400 before anything is queued);
    the engine cores load them from the path on first use. An adapter with requests in flight is not unloaded.
    """

    model: ModelConfig  # the base model the adapters are checked against
    max_lora_rank: int
    base_name: str  # the served model name: `model` = it means no adapter
    runtime_updates: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    by_name: dict[str, LoRARequest] = field(default_factory=dict)
    in_use: Counter = field(default_factory=Counter)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def load(self, name: str, path: str) -> LoRARequest:
        """Validate the adapter (ValueError naming the field or path) and serve it under name."""
        if not name:
            raise ValueError("lora_name must be a non-empty string")
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self.by_name:
            raise ValueError(f"lora_name {name!r} is already loaded (from {self.by_name[name].lora_path!r})")
        request = LoRARequest(name, next(self._ids), path)
        load_adapter(request, self.model, self.max_lora_rank)
        self.by_name[name] = request
        return request

    def unload(self, name: str) -> LoRARequest:
        """KeyError: not loaded; ValueError: requests of it are in flight."""
        request = self.by_name[name]
        if self.in_use[name]:
            raise ValueError(f"lora_name {name!r} is in use by {self.in_use[name]} requests; unload it when they end")
        del self.by_name[name]
        return request

    def acquire(self, request: LoRARequest | None) -> None:
        if request is not None:
            self.in_use[request.lora_name] += 1

    def release(self, request: LoRARequest | None) -> None:
        if request is not None:
            self.in_use[request.lora_name] -= 1
            if self.in_use[request.lora_name] <= 0:
                del self.in_use[request.lora_name]
