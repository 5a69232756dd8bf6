# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The z-lab DFlash checkpoint layout (and AdaFlash checkpoints built on it) <-> `AdaFlashDrafterConfig`.

Sources read to pin this layout down (public repositories, read through the code index, not copied):

- z-lab/dflash `dflash/model.py`: `DFlashDraftModel(Qwen3PreTrainedModel)` with modules `layers.N.self_attn.
  {q,k,v,o}_proj` (bias = `attention_bias`), `layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.{gate,up,down}_proj`
  (Qwen3MLP, no bias), `layers.N.{input,post_attention}_layernorm`, `fc` (no bias), `hidden_norm`, `norm`; no
  embeddings, no LM head. Config values are read from the nested `dflash_config` dict with a fallback to the top
  level: `target_layer_ids`, `block_size` (default 16), `mask_token_id`, `input_embedding_scale` (default 1), and
  for logits `output_multiplier`, `final_logit_softcapping`. Layers are non-causal unless `is_causal` is set or the
  layer is `sliding_attention`. `DFlash2DraftModel` adds `layers.N.{attention,mlp}_conv.*` and
  `candidate_selector.*` (not supported here).
- z-lab/dflash `tests/fixtures/dflash2-config.json`, `tests/fixtures/dflash2-safetensors-header.json`: a transformers
  5.x config (`model_type: "qwen3"` although the target is not a Qwen3 model, `rope_parameters`, nested
  `dflash_config.{block_size, mask_token_id, target_layer_ids}`, top-level `num_target_layers`, `layer_types`).
- sgl-project/SpecForge `configs/qwen3-8b-dflash.json`: older layout (`rope_theta` + `rope_scaling`, top-level
  `block_size` and `num_target_layers`, no `dflash_config`: target layers then follow `build_target_layer_ids`).
- sgl-project/sglang `python/sglang/srt/models/dflash.py` and `python/sglang/srt/speculative/dflash_utils.py`
  (`parse_dflash_draft_config`: nested-then-top-level lookup of `block_size`, `num_target_layers`,
  `target_layer_ids`, `mask_token_id`, `mask_token`; `build_target_layer_ids`; refuses non-silu activations).
- vllm-project/vllm `vllm/model_executor/models/qwen3_dflash.py` (`DFlashQwen3Model`: same tensor names, also maps
  `encoder.fc`/`encoder.output_norm_enc`; `dflash_config.{causal, use_swa, swa_window_size, attention_sink_bias}`,
  top-level `is_causal`, `is_neox_style`).
- ZinYY/AdaFlash `SpecForge/modeling/draft/dflash.py` and `configs/qwen3-8b-dflash-thresh-head.json`: AdaFlash
  checkpoints set `dflash_config.{use_thresh_head_two_model, thresh_head_bottleneck_dim, thresh_head_direct_len}`
  and add `thresh_head_two_model.{down, res.0, out}.{weight, bias}` (`ThreshHeadTwoModel`: Linear(2H -> d) on
  `[mean over the block, last position]` of the drafter states, SiLU, residual Linear(d -> d)+SiLU, Linear(d -> 1),
  sigmoid: ONE value per block), or `thresh_head_subsequent.proj.*` (softmax statistics pooled over the block ->
  one sigmoid), or `prob_head.*` (`use_prob_head`). None of these maps onto `AdaFlashLengthHead`, which predicts a
  conditional acceptance per drafted position from that position's normed state, a position embedding and the
  token-distribution features: loading refuses them by name unless `drop_unsupported_heads=True` (drafter only).
"""

import torch

from ..models import AdaFlashDrafterConfig
from .safety import CheckpointError


ARCHITECTURE = "DFlashDraftModel"
# dflash_config keys this loader understands without changing the computation.
_PLAIN_KEYS = {"block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "mask_token",
               "tokenizer_fingerprint", "target_model_type"}
# Keys (nested or top level) that change the computation, with the values that do not.
_NEUTRAL = {
    "input_embedding_scale": (1, 1.0), "output_multiplier": (1, 1.0), "final_logit_softcapping": (0, 0.0),
    "conv_kernel_size": (0,), "conv_group_size": (0,), "selector_rank": (0,), "selector_top_k": (0,),
    "causal": (False,), "use_swa": (False,), "attention_sink_bias": (False,), "attention_value_scale": (1, 1.0),
    "projector_type": (), "sample_from_anchor": (True,), "is_causal": (False,), "is_neox_style": (True,),
    "has_embed_tokens": (False,), "has_lm_head": (False,), "use_aux_hidden_state": (True,),
    "quantization_config": (),
}
# AdaFlash (ZinYY/AdaFlash) heads: flag in dflash_config -> (tensor prefix, description).
_HEADS = {
    "use_thresh_head_two_model": (
        "thresh_head_two_model.",
        "ThreshHeadTwoModel (`thresh_head_two_model.{down,res.0,out}`): one sigmoid per block from the [mean, last] "
        "pooled block states (a confidence threshold, or with thresh_head_direct_len the fraction of the block "
        "to verify)",
    ),
    "use_thresh_head_subsequent": (
        "thresh_head_subsequent.",
        "ThreshHeadSubsequent (`thresh_head_subsequent.proj.*`): one sigmoid per block from softmax statistics "
        "pooled over the block",
    ),
    "use_prob_head": (
        "prob_head.",
        "ProbHead (`prob_head.*`): per-position acceptance logits from the raw drafter states, without the "
        "RMSNorm, position embedding and probability features of AdaFlashLengthHead",
    ),
}
_HEAD_CONFIG_KEYS = {"thresh_head_bottleneck_dim", "thresh_head_direct_len", "thresh_head_topk", "prob_head_model",
                     "prob_head_num_layers", "prob_head_bottleneck_dim"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default context layers of SpecForge/SGLang when a config names none (`dflash_utils.build_target_layer_ids`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def is_zlab_config(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or []) or "DFlash2DraftModel" in (raw.get("architectures") or [])


def has_adaflash_heads(raw: dict) -> bool:
    dcfg = raw.get("dflash_config") or {}
    return any(dcfg.get(flag) for flag in _HEADS) or any(k.startswith("thresh_head") for k in dcfg)


def rope_parameters_from(parsed, default_theta: float) -> dict:
    """`rope_parameters` of a parsed transformers config (legacy `rope_theta`/`rope_scaling` already folded in)."""
    params = dict(getattr(parsed, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(params.get("rope_theta", getattr(parsed, "rope_theta", None) or default_theta))
    return params


def zlab_to_config(raw: dict, where: str, *, drop_unsupported_heads: bool = False, **overrides):
    """Parse a z-lab / AdaFlash `config.json` dict.

    Returns `(AdaFlashDrafterConfig, ignored_tensor_prefixes)`: the prefixes of head tensors that are dropped (only
    when `drop_unsupported_heads`). Raises `CheckpointError` listing every unsupported feature.
    """
    from transformers import CONFIG_MAPPING, Qwen3Config

    dcfg = dict(raw.get("dflash_config") or {})

    def get(key, default=None):
        return dcfg.get(key, raw.get(key, default))

    problems = []
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        problems.append("DFlash2DraftModel (grouped dynamic convolutions `layers.N.{attention,mlp}_conv` and the "
                        "`candidate_selector`)")
    for key, neutral in _NEUTRAL.items():
        value = get(key)
        if value is not None and value not in neutral:
            problems.append(f"{key}={value!r}")
    unknown = sorted(set(dcfg) - _PLAIN_KEYS - set(_NEUTRAL) - set(_HEADS) - _HEAD_CONFIG_KEYS)
    if unknown:
        problems.append(f"unknown dflash_config keys {unknown} (they may change the computation)")
    ignored = []
    for flag, (prefix, description) in _HEADS.items():
        if dcfg.get(flag):
            if drop_unsupported_heads:
                ignored.append(prefix)
            else:
                problems.append(
                    f"the AdaFlash head {description}. AdaFlashLengthHead predicts a conditional acceptance for each "
                    "drafted position, so these weights cannot be mapped onto it; pass drop_unsupported_heads=True "
                    "(CLI: --drop-unsupported-heads) to load the drafter alone and train a length head for it"
                )

    model_type = raw.get("model_type", "qwen3")
    config_cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else Qwen3Config
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type",
                                                        "transformers_version", "dtype", "torch_dtype")}
    try:
        parsed = config_cls(**fields)
    except Exception as e:  # noqa: BLE001 - report any parsing failure with the file name
        raise CheckpointError(f"{where}: does not parse as a {config_cls.__name__} (model_type {model_type!r}): {e}")
    n = parsed.num_hidden_layers
    layer_types = list(getattr(parsed, "layer_types", None) or ["full_attention"] * n)
    if any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types {layer_types} (sliding_window={getattr(parsed, 'sliding_window', None)}): "
                        "AdaFlashDrafterModel has full bidirectional attention only")
    if getattr(parsed, "mlp_bias", False):
        problems.append("mlp_bias=True (DFlash drafters use bias-free Qwen3 MLPs)")
    if problems:
        raise CheckpointError(f"{where}: unsupported DFlash checkpoint features: " + "; ".join(problems) + ".")

    target_layer_ids = get("target_layer_ids")
    num_target_layers = get("num_target_layers")
    if target_layer_ids is None and "target_layer_ids" not in overrides:
        if num_target_layers is None:
            raise CheckpointError(f"{where}: names neither dflash_config.target_layer_ids nor num_target_layers.")
        target_layer_ids = build_target_layer_ids(int(num_target_layers), n)
    mask_token_id = get("mask_token_id")
    if mask_token_id is None and "mask_token_id" not in overrides:
        raise CheckpointError(
            f"{where}: no mask_token_id (SGLang would look up {get('mask_token', '<|MASK|>')!r} in the target "
            "tokenizer); pass mask_token_id=... explicitly."
        )
    kwargs = dict(
        vocab_size=parsed.vocab_size,
        hidden_size=parsed.hidden_size,
        intermediate_size=parsed.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=parsed.num_attention_heads,
        num_key_value_heads=parsed.num_key_value_heads or parsed.num_attention_heads,
        head_dim=getattr(parsed, "head_dim", None) or parsed.hidden_size // parsed.num_attention_heads,
        hidden_act=parsed.hidden_act,
        rms_norm_eps=float(parsed.rms_norm_eps),
        rope_parameters=rope_parameters_from(parsed, getattr(config_cls, "default_theta", 10_000.0)),
        max_position_embeddings=parsed.max_position_embeddings,
        attention_bias=bool(getattr(parsed, "attention_bias", False)),
        mlp_bias=False,
        attention_dropout=getattr(parsed, "attention_dropout", 0.0),
        layer_types=layer_types,
        block_size=int(get("block_size", 16)),
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        target_layer_ids=None if target_layer_ids is None else [int(i) for i in target_layer_ids],
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        target_model_type=dcfg.get("target_model_type"),
        tokenizer_fingerprint=dcfg.get("tokenizer_fingerprint"),
        initializer_range=float(getattr(parsed, "initializer_range", 0.02)),
        bos_token_id=parsed.bos_token_id,
        eos_token_id=parsed.eos_token_id,
        pad_token_id=parsed.pad_token_id,
    )
    kwargs.update(overrides)
    return _make_config(kwargs, where), tuple(ignored)


def _make_config(kwargs: dict, where: str) -> AdaFlashDrafterConfig:
    try:
        return AdaFlashDrafterConfig(**kwargs)
    except Exception as e:  # noqa: BLE001 - strict-config validation errors, re-raised with the file name
        raise CheckpointError(f"{where}: cannot build an AdaFlashDrafterConfig from it: {e}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_zlab(config: AdaFlashDrafterConfig, dtype: torch.dtype, model_type: str = "qwen3") -> dict:
    """The `config.json` of the z-lab layout for `config` (what vLLM's and SGLang's DFlash loaders read).

    `model_type` is the drafter's architecture family as z-lab writes it ("qwen3" even for non-Qwen targets), not
    the target's; our `target_model_type` and tokenizer fingerprint ride along in `dflash_config`, where the z-lab,
    SGLang and vLLM readers ignore unknown keys.
    """
    if config.mlp_bias:
        raise CheckpointError("cannot export to the z-lab layout: mlp_bias=True (DFlash MLPs have no bias).")
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.default_theta})
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    dflash_config = {"block_size": config.block_size, "mask_token_id": config.mask_token_id,
                     "target_layer_ids": list(config.target_layer_ids)}
    for key in ("target_model_type", "tokenizer_fingerprint"):
        if getattr(config, key) is not None:
            dflash_config[key] = getattr(config, key)
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": model_type,
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "block_size": config.block_size,
        "bos_token_id": getattr(config, "bos_token_id", None),
        "dflash_config": dflash_config,
        "dtype": dtype_name(dtype),
        "eos_token_id": getattr(config, "eos_token_id", None),
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "layer_types": list(config.layer_types),
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "pad_token_id": getattr(config, "pad_token_id", None),
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "rope_scaling": rope_scaling if rope_scaling.get("rope_type", "default") != "default" else None,
        "rope_theta": rope.get("rope_theta"),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": config.vocab_size,
    }
    if config.num_target_layers is not None:
        out["num_target_layers"] = config.num_target_layers
    return out


__all__ = ["build_target_layer_ids", "config_to_zlab", "has_adaflash_heads", "is_zlab_config", "zlab_to_config"]
