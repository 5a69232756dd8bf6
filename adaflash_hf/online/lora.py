# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""LoRA layer plumbing of the online adapter (PEFT's "layer" level): inject named LoRA adapters into a drafter,
list their matrices, activate and scale them, copy them between two drafters, take them out again.

Everything goes through `peft.functional` (`inject_adapter_in_model`, `set_adapter`, `delete_adapter`) on the plain
drafter module; no `PeftModel` wraps it, so `generate(assistant_model=drafter)` sees the same object. What PEFT does
not offer is written here: per-adapter scaling for an ensemble's mixture, and undoing the injection exactly
(`remove`: original modules, `requires_grad` flags and `peft_config` attribute restored).
"""

import warnings

import torch
from peft.functional import delete_adapter, inject_adapter_in_model, set_adapter
from peft.tuners.tuners_utils import BaseTunerLayer


_MISSING = object()


def lora_layers(module) -> list:
    """The LoRA-wrapped linears of `module`, in module order."""
    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def inject(module, lora_config, names: list[str], seed: int) -> dict:
    """Inject adapters `names` into `module` (seeded; PEFT freezes every non-LoRA weight). Returns what `remove`
    needs to undo it."""
    undo = {"trainable": [p for p in module.parameters() if p.requires_grad]}
    before = vars(module).get("peft_config", _MISSING)  # PEFT leaves `peft_config` on the model
    undo["peft_config"] = (before, dict(before) if isinstance(before, dict) else None)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # ensembles: on purpose
        torch.manual_seed(seed)
        for name in names:
            inject_adapter_in_model(lora_config, module, adapter_name=name)
    for n, p in module.named_parameters():
        if "lora_" not in n:
            p.requires_grad_(False)
    return undo


def remove(module, undo: dict) -> None:
    """Put back every original linear of `module` and what `inject` changed (its `undo`)."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, BaseTunerLayer):
                setattr(parent, child_name, child.get_base_layer())
    for p in undo["trainable"]:
        p.requires_grad_(True)
    before, entries = undo["peft_config"]
    if before is _MISSING:
        vars(module).pop("peft_config", None)
    else:
        if isinstance(before, dict):
            before.clear()
            before.update(entries)
        module.peft_config = before


def parameters(layers, name: str) -> list[torch.Tensor]:
    """A, B of adapter `name` in each of `layers`, in order (`persistence.lora_keys` names them)."""
    params = []
    for layer in layers:
        params += [layer.lora_A[name].weight, layer.lora_B[name].weight]
    return params


def activate(module, layers, names: list[str], base_scaling: dict[str, float],
             scales: dict[str, float] | None = None) -> None:
    """Make adapters `names` the active ones in `module`, each LoRA delta scaled by `scales[name]` (default 1)."""
    set_adapter(module, names)
    for layer in layers:
        for name in names:
            layer.scaling[name] = base_scaling[name] * (scales or {}).get(name, 1.0)


def copy(source_layers, target_layers, names: list[str]) -> None:
    """Copy adapters `names` from one drafter's LoRA layers into another's (same shapes)."""
    with torch.no_grad():
        for source, target in zip(source_layers, target_layers):
            for name in names:
                target.lora_A[name].weight.copy_(source.lora_A[name].weight)
                target.lora_B[name].weight.copy_(source.lora_B[name].weight)


def add_scratch(module, lora_config, name: str, seed: int) -> None:
    """Inject one more adapter `name` (B = 0) into a module that already has some."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # a second adapter, on purpose
        torch.manual_seed(seed)
        inject_adapter_in_model(lora_config, module, adapter_name=name)


def drop(module, keep: list[str], name: str) -> None:
    """Delete adapter `name` from `module`, leaving `keep` active."""
    set_adapter(module, keep)
    delete_adapter(module, name, prefix="lora_")


__all__ = ["activate", "add_scratch", "copy", "drop", "inject", "lora_layers", "parameters", "remove"]
