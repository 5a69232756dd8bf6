# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""transformers' own DFlash-style drafter layout (`muse_glimmer_assistant`) <-> `AdaFlashDrafterConfig`.

Sources: transformers 5.24 `models/muse_glimmer_assistant/{configuration,modeling}_muse_glimmer_assistant.py`
(installed here) and z-lab/dflash `tests/fixtures/assistant-config.json` + `assistant-safetensors-header.json`.
Same decoder tensors as ours (`layers.N.*`, `norm`), but the context projection lives in `encoder`:
`encoder.fc.weight` [H, len(target_layer_ids) * H] (ours: `fc.weight`) and `encoder.output_norm_enc.weight` [H]
(ours: `hidden_norm.weight`). The config keeps `block_size`, `mask_token_id`, `target_layer_ids` at the top level,
has no `vocab_size`, `head_dim` defaults to 128, `layer_types` to all `sliding_attention` and `rope_theta` to
500000. Attention and MLP have no biases. vLLM's DFlash loader maps these names too
(vllm-project/vllm `vllm/model_executor/models/qwen3_dflash.py`).
"""

import torch

from ..models import AdaFlashDrafterConfig
from .dflash import _make_config, dtype_name, rope_parameters_from
from .safety import CheckpointError


MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"
OURS_TO_MUSE = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
MUSE_TO_OURS = {v: k for k, v in OURS_TO_MUSE.items()}


def is_muse_config(raw: dict) -> bool:
    return raw.get("model_type") == MODEL_TYPE or ARCHITECTURE in (raw.get("architectures") or [])


def muse_to_config(raw: dict, where: str, **overrides) -> AdaFlashDrafterConfig:
    """Parse a `muse_glimmer_assistant` `config.json` dict (transformers' defaults fill missing keys).

    The layout records no vocabulary size: it is taken from a `vocab_size` key if present (our exports write
    one), else it must be given (`vocab_size=target.config.vocab_size`).
    """
    from transformers import MuseGlimmerAssistantConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version",
                                                        "dtype", "torch_dtype", "vocab_size", "auto_map")}
    try:
        parsed = MuseGlimmerAssistantConfig(**fields)
    except Exception as e:  # noqa: BLE001 - report any parsing failure with the file name
        raise CheckpointError(f"{where}: does not parse as a MuseGlimmerAssistantConfig: {e}") from None
    layer_types = list(parsed.layer_types)
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(
            f"{where}: unsupported layer_types {layer_types} (sliding_window={parsed.sliding_window}; muse assistants "
            "default to sliding attention when the key is absent): AdaFlashDrafterModel has full bidirectional "
            "attention only."
        )
    vocab_size = overrides.pop("vocab_size", raw.get("vocab_size"))
    if vocab_size is None:
        raise CheckpointError(
            f"{where}: muse_glimmer_assistant configs do not record the vocabulary size; pass vocab_size= "
            "(the target's, e.g. target.config.vocab_size; CLI: --vocab-size)."
        )
    kwargs = dict(
        vocab_size=int(vocab_size),
        hidden_size=parsed.hidden_size,
        intermediate_size=parsed.intermediate_size,
        num_hidden_layers=parsed.num_hidden_layers,
        num_attention_heads=parsed.num_attention_heads,
        num_key_value_heads=parsed.num_key_value_heads,
        head_dim=parsed.head_dim,
        hidden_act=parsed.hidden_act,
        rms_norm_eps=float(parsed.rms_norm_eps),
        rope_parameters=rope_parameters_from(parsed, MuseGlimmerAssistantConfig.default_theta),
        max_position_embeddings=parsed.max_position_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=parsed.attention_dropout,
        layer_types=layer_types,
        block_size=parsed.block_size,
        mask_token_id=parsed.mask_token_id,
        target_layer_ids=list(parsed.target_layer_ids),
        num_target_layers=raw.get("num_target_layers"),
        bos_token_id=parsed.bos_token_id,
        eos_token_id=parsed.eos_token_id,
        pad_token_id=parsed.pad_token_id,
    )
    kwargs.update(overrides)
    return _make_config(kwargs, where)


def config_to_muse(config: AdaFlashDrafterConfig, dtype: torch.dtype) -> dict:
    """The `config.json` of the muse layout for `config`, every field written (the class defaults would differ).

    `vocab_size` (and `num_target_layers` when known) are extra keys transformers keeps as attributes: they make
    the round trip back to our layout exact.
    """
    if config.attention_bias or config.mlp_bias:
        raise CheckpointError("cannot export to the muse_glimmer_assistant layout: it has no attention/MLP biases.")
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.default_theta})
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "attention_dropout": config.attention_dropout,
        "block_size": config.block_size,
        "bos_token_id": getattr(config, "bos_token_id", None),
        "dtype": dtype_name(dtype),
        "eos_token_id": getattr(config, "eos_token_id", None),
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "mask_token_id": config.mask_token_id,
        "max_position_embeddings": config.max_position_embeddings,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "pad_token_id": getattr(config, "pad_token_id", None),
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "sliding_window": 2048,  # unused (every layer is full attention) but the field must be an int
        "target_layer_ids": list(config.target_layer_ids),
        "vocab_size": config.vocab_size,
    }
    if config.num_target_layers is not None:
        out["num_target_layers"] = config.num_target_layers
    return out


__all__ = ["MUSE_TO_OURS", "OURS_TO_MUSE", "config_to_muse", "is_muse_config", "muse_to_config"]
