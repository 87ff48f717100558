"""LoRARequest: which adapter a request runs under (vLLM's shape). Data only; the adapter itself is lora/adapter.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the name a server's `model` field uses; lora_int_id: a positive id, unique per adapter for the
    engine's life (it salts the prefix-cache hash chain and keys the slot tables); lora_path: a PEFT directory
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string (a PEFT adapter directory)")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
