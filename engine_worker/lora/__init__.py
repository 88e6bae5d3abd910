"""Many LoRA adapters on one engine (vLLM's design).

``LoRARequest`` names an adapter; ``adapter`` reads a PEFT directory into per-module A/B
tensors (validated against the model at load); ``cache`` keeps up to ``max_cpu_loras`` of them
loaded (LRU) and remembers every registered adapter's path; ``slots`` holds ``max_loras`` of
them in stacked device buffers; ``batch`` is one step's per-token adapter slots, applied by the
shrink/expand ops of ``ops`` inside the model's projections (never merged into the weights).
"""

from engine_worker.lora.config import LoRAConfig
from engine_worker.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
