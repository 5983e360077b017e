"""Which adapter tensors a LoRA method shares, by name (the server and the clients agree on it).

Names are ``models.vlm.adapter_state``'s: ``<module path>.lora_A.weight`` and
``.lora_B.weight`` for LoRA (peft: A random, B zero; ΔW = B·A), ``.hada_w1_a`` ...
``.hada_w2_b`` for LoHa (ΔW = (w1_a·w1_b) ⊙ (w2_a·w2_b)).
"""

from __future__ import annotations

from collections.abc import Iterable

from fedvlm.models.vlm import layer_of

HALVES = ("A", "B")


def lora_half(names: Iterable[str], half: str) -> list[str]:
    """Every layer's ``lora_A`` (half 'A') or ``lora_B`` (half 'B') tensor."""
    if half not in HALVES:
        raise ValueError(f"half must be 'A' or 'B', got {half!r}")
    tag = f".lora_{half}."
    return sorted(n for n in names if tag in n)


def top_layers(names: Iterable[str], count: int) -> list[str]:
    """FedPer's shared part: the adapters of the ``count`` highest decoder layers."""
    names = list(names)
    layers = sorted({i for i in (layer_of(n) for n in names) if i is not None})
    if count > len(layers):
        raise ValueError(f"fedper.shared-layers = {count} but the language model has {len(layers)} adapted layers")
    keep = set(layers[len(layers) - count :])
    return sorted(n for n in names if layer_of(n) in keep)


def loha_global(names: Iterable[str]) -> list[str]:
    """FedPara's shared pair (w1_a, w1_b); the w2 pair stays on the client."""
    return sorted(n for n in names if ".hada_w1_" in n)
