"""KVTransferConfig: prefill/decode disaggregation's settings, vLLM's `--kv-transfer-config` keys (a JSON object:
kv_connector, kv_role, kv_ip, kv_port, kv_lease_s, kv_load_failure_policy, kv_transfer_timeout_s).

`lmserve serve --disaggregation 1P1D` builds one per core itself (ipc addresses); the two-server form passes it.
Every bad value raises ValueError naming the key. No torch. See docs/disaggregation.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

KV_CONNECTORS = ("lmserve",)
KV_ROLES = ("kv_producer", "kv_consumer")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
DEFAULT_KV_LEASE_S = 30.0


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "lmserve"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_lease_s: float = DEFAULT_KV_LEASE_S
    kv_load_failure_policy: str = "fail"
    kv_transfer_timeout_s: float = 5.0
    kv_address: str | None = None  # a full ZeroMQ address for the KV server (ipc://... inside one serve)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {list(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role == "kv_both":
            raise ValueError(
                "kv_role: 'kv_both' (both roles on one server) is not supported: run a kv_producer and a kv_consumer "
                "server, or one `lmserve serve --disaggregation 1P1D`"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {list(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        for name in ("kv_lease_s", "kv_transfer_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be an integer in [0, 65536), got {self.kv_port!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def bind_address(self) -> str:
        """Where a producer's KV server listens."""
        if self.kv_address is not None:
            return self.kv_address
        host = f"[{self.kv_ip}]" if ":" in self.kv_ip else self.kv_ip
        return f"tcp://{host}:{self.kv_port}" if self.kv_port else f"tcp://{host}:*"

    @classmethod
    def from_value(cls, value: dict[str, Any] | str | KVTransferConfig) -> KVTransferConfig:
        """A dict, its JSON text, or a config already built."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}; known: {sorted(known)}")
        if "kv_role" not in value:
            raise ValueError(f"kv_transfer_config.kv_role is required: one of {list(KV_ROLES)}")
        return cls(**value)
