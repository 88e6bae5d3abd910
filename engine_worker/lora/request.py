"""``LoRARequest``: which adapter a request runs under, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass

from quire.errors import FieldError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: ``lora_name`` is what requests (and the OpenAI ``model`` field) call it,
    ``lora_int_id`` a positive id unique per adapter, ``lora_path`` its PEFT directory
    (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise FieldError("lora_name", "must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise FieldError("lora_int_id", f"must be a positive integer, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise FieldError("lora_path", "must be a non-empty path")
