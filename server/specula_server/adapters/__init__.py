"""Adapters a request can name: LoRA (PEFT layout) and Medusa heads, from the Hub or local adapter directories.

`sources` finds and checks an adapter's directory, `lora` and `medusa` read it for one tensor-parallel rank,
and `registry` keeps the loaded adapters in the slots the model reads each step.
"""

from __future__ import annotations

from specula_server.adapters.lora import LoraConfig, LoraWeights, load_lora
from specula_server.adapters.medusa import MedusaConfig, MedusaHeads, load_medusa
from specula_server.adapters.sources import AdapterError, AdapterKind, detect_adapter_kind, resolve_adapter

__all__ = [
    "AdapterError",
    "AdapterKind",
    "LoraConfig",
    "LoraWeights",
    "MedusaConfig",
    "MedusaHeads",
    "detect_adapter_kind",
    "load_lora",
    "load_medusa",
    "resolve_adapter",
]
