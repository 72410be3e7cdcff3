"""vLLM's LoRARequest, for imports: pagedserve serves no LoRA adapters, so passing one is refused by name
(`lora_request`: merge the adapter into the weights, peft's merge_and_unload, and load the merged checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
