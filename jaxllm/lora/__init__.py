"""Multi-LoRA serving: adapters in PEFT's format over one base model, mixed in every step.

request.py   LoRARequest (vLLM's)
adapter.py   a PEFT directory -> the engine's fused layout (host); AdapterCache (max_cpu_loras)
layers.py    LoRAWeight: a matrix with every slot's adapter beside it (device)
slots.py     LoRASlots: which adapter each device slot holds (the runner's)
"""

from jaxllm.lora.request import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
