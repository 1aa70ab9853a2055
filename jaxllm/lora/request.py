"""`LoRARequest`: which adapter a request runs under (vLLM's `vllm.lora.request.LoRARequest`),
and `LoRAError`, what an adapter that cannot be served raises."""

from __future__ import annotations

import dataclasses


class LoRAError(ValueError):
    """An adapter that cannot be served: missing or corrupt files, an unsupported kind or
    target, a rank above max_lora_rank, shapes that do not fit the base model, an id in use."""


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`) at
    `lora_path`, known to the engine by `lora_int_id` (> 0, unique per adapter) and to the
    server's clients by `lora_name` (the request's `model`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
