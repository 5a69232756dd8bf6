# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The attention path of masked multi-token forwards on a CPU: SDPA's own grouped-query attention.

A verify forward of several tokens per row carries a 4D attention mask (padding, rejected slots, the causal block),
and transformers' SDPA integration (`integrations/sdpa_attention.py`, `use_gqa_in_sdpa`) then expands the key/value
heads to the query heads (`repeat_kv`: a copy of the whole cache, every layer) instead of passing `enable_gqa=True`,
because CUDA's fused kernels do not take a mask with GQA. Its switch `TRANSFORMERS_SDPA_FORCE_GQA=1` passes GQA to
SDPA anyway; torch's CPU flash-attention kernel takes a mask with GQA (torch >= 2.5) and gives the same outputs.

On this CPU (the testbed target, 3 KV heads for 9 query heads, 256-token context, fp32, 2 threads) the copy was most
of a many-row verify: 64 rows x 2 tokens 1,396 -> 539 ms, 64 x 8 2,774 -> 1,344 ms, 16 x 2 297 -> 228 ms, while a
one-token forward (no mask, or GQA already) was unchanged (16 x 1: 161 vs 163 ms). So on a CPU the costs that decide
whether a speculative round pays at many rows were set by a copy, not by the model.

`prefer_masked_gqa(device)` turns the switch on for the process on a CPU (never on CUDA, where it would select
SDPA's unfused math kernel) unless the user set the variable either way. It is transformers' own knob and applies to
every model in the process, plain `generate` included: the benches call it before loading models, so peers and our
engine run the same attention. The cost model records the state (`cost_key`): a calibration measured with the copy
is not used without it.
"""

import os

import torch


FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def masked_gqa() -> bool:
    """Whether transformers' SDPA integration passes GQA to SDPA under a mask (`TRANSFORMERS_SDPA_FORCE_GQA=1`)."""
    return os.environ.get(FORCE_GQA, "0") == "1"


def supports_masked_gqa(device) -> bool:
    """Whether SDPA on `device` takes an attention mask with GQA through its efficient kernel: a CPU with torch
    >= 2.5 (`enable_gqa`). CUDA falls back to the math kernel under a mask, so it does not count."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return torch.device(device).type == "cpu" and (major, minor) >= (2, 5)


def prefer_masked_gqa(device) -> bool:
    """Turn `TRANSFORMERS_SDPA_FORCE_GQA` on for this process where `device` supports it and the user has not set
    it (either way); returns whether masked GQA is on. Outputs are unchanged; on a CPU, masked multi-token forwards
    stop copying the KV cache per layer (module docstring)."""
    if FORCE_GQA not in os.environ and supports_masked_gqa(device):
        os.environ[FORCE_GQA] = "1"
    return masked_gqa()


__all__ = ["FORCE_GQA", "masked_gqa", "prefer_masked_gqa", "supports_masked_gqa"]
