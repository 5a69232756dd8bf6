# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Function-preserving depth growth: a deeper drafter warm-started from a trained one (issue 23's "deeper drafter"
lever).

`grow_drafter(drafter, num_layers)` appends decoder layers after the existing ones. Each new layer is a copy of the
last trained layer with its two output projections (`self_attn.o_proj`, `mlp.down_proj`) set to zero: a pre-norm
residual layer whose branches output zero is the identity, so the grown drafter drafts exactly what its parent
drafts (same logits) and training starts from the parent's acceptance, not from a random layer. The zeroed
projections get gradients at once (their inputs are non-zero), and the copied projections get gradients as soon as
the outputs move. This is the zero-init residual growth of Net2Net / stacking recipes; neither transformers nor PEFT
grows a model's depth, so it is written here (a dozen lines over `state_dict`).
"""

import copy

import torch


OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@torch.no_grad()
def grow_drafter(drafter, num_layers: int):
    """A new `AdaFlashDrafterModel` with `num_layers` decoder layers whose outputs equal `drafter`'s.

    Args:
        drafter: a trained `AdaFlashDrafterModel` (left unchanged).
        num_layers: the depth of the grown drafter, `>= drafter.config.num_hidden_layers`.
    Returns:
        The grown drafter, on `drafter`'s device and dtype, in eval mode; its config's `num_hidden_layers` is
        `num_layers` and every other field is the parent's.
    """
    have = drafter.config.num_hidden_layers
    if num_layers < have:
        raise ValueError(f"grow_drafter: num_layers={num_layers} is below the drafter's {have} layers "
                         "(growth only adds layers)")
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = num_layers
    config.layer_types = [*config.layer_types, *[config.layer_types[-1]] * (num_layers - have)]
    config.validate()
    param = next(drafter.parameters())
    grown = type(drafter)(config).to(device=param.device, dtype=param.dtype)
    state = dict(drafter.state_dict())  # the parent's layers keep their names; new layers come after them
    prefix = f"layers.{have - 1}."
    last = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    for i in range(have, num_layers):
        state.update({f"layers.{i}.{k}": torch.zeros_like(v) if k in OUTPUT_PROJECTIONS else v.clone()
                      for k, v in last.items()})
    grown.load_state_dict(state)
    grown.config._attn_implementation = getattr(drafter.config, "_attn_implementation", None) or "sdpa"
    return grown.eval()


__all__ = ["OUTPUT_PROJECTIONS", "grow_drafter"]
