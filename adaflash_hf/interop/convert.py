# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Load any DFlash-style drafter checkpoint as an `AdaFlashDrafterModel`, and export one to another layout.

Layouts (detected from `config.json`):

- `"adaflash"`: ours (`model_type: "adaflash_drafter"`, `auto_map`), loaded with `from_pretrained`; an optional
  `length_head/` subfolder (with `cost_model.json`) is attached to the drafter.
- `"zlab"`: z-lab DFlash (`architectures: ["DFlashDraftModel"]`), what vLLM (`--speculative-config '{"method":
  "dflash", "model": DIR, "num_speculative_tokens": N}'`) and SGLang (`--speculative-algorithm DFLASH
  --speculative-draft-model-path DIR`) serve. `"adaflash-zlab"`: the same with ZinYY/AdaFlash threshold heads.
- `"muse"`: transformers' `muse_glimmer_assistant` (`encoder.fc`, `encoder.output_norm_enc`).

Every foreign checkpoint is checked before anything big is built: only safetensors (pickle is refused), headers
parsed and bounds-checked (truncation), and tensor names/shapes compared with those the config implies.
"""

import json
import logging
from pathlib import Path

import torch

from ..generation.runtime import SpeculationRuntime
from ..models import AdaFlashDrafterConfig, AdaFlashDrafterModel, AdaFlashLengthHead
from ..models.drafter.modeling_adaflash_drafter import _check_loaded_weights
from .dflash import config_to_zlab, has_adaflash_heads, is_zlab_config, zlab_to_config
from .muse import MUSE_TO_OURS, OURS_TO_MUSE, config_to_muse, is_muse_config, muse_to_config
from .safety import CheckpointError, check_tensors, load_tensors, read_checkpoint_tensors


logger = logging.getLogger(__name__)
LAYOUTS = ("adaflash", "zlab", "muse")
LENGTH_HEAD_DIR, COST_MODEL_FILE = "length_head", "cost_model.json"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_config(path) -> dict:
    """The `config.json` of a checkpoint folder, as a dict (clear errors for a missing folder/file/bad JSON)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder.")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json.")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: not a JSON object.")
    return raw


def detect_layout(path) -> str:
    """`"adaflash"`, `"zlab"`, `"adaflash-zlab"` (z-lab layout with AdaFlash heads) or `"muse"`."""
    raw = read_config(path)
    if raw.get("model_type") == AdaFlashDrafterConfig.model_type:
        return "adaflash"
    if is_muse_config(raw):
        return "muse"
    if is_zlab_config(raw):
        return "adaflash-zlab" if has_adaflash_heads(raw) else "zlab"
    raise CheckpointError(
        f"{Path(path) / 'config.json'}: unknown drafter layout (model_type={raw.get('model_type')!r}, "
        f"architectures={raw.get('architectures')}); supported: adaflash_drafter, DFlashDraftModel (z-lab / "
        "AdaFlash), muse_glimmer_assistant."
    )


def _expected_shapes(config: AdaFlashDrafterConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a drafter built from `config` (on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = AdaFlashDrafterModel(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _checkpoint_dtype(infos) -> torch.dtype:
    """The floating dtype most tensors are stored in (`fc` decides ties)."""
    counts: dict[str, int] = {}
    for info in infos.values():
        if info.dtype in _DTYPES:
            counts[info.dtype] = counts.get(info.dtype, 0) + 1
    if not counts:
        raise CheckpointError("the checkpoint holds no floating-point tensors.")
    return _DTYPES[max(counts, key=counts.get)]


def _build(config: AdaFlashDrafterConfig, state: dict, dtype: torch.dtype, device) -> AdaFlashDrafterModel:
    """A drafter holding exactly `state` (no random init); built in `dtype` as `from_pretrained` would."""
    from transformers.initialization import no_init_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            model = AdaFlashDrafterModel(config)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    model.config.dtype = dtype
    return model.to(device).eval()


def load_dflash_checkpoint(path, *, dtype: torch.dtype | None = None, device="cpu",
                           drop_unsupported_heads: bool = False, load_length_head: bool = True,
                           **config_overrides) -> AdaFlashDrafterModel:
    """Load a drafter checkpoint of any supported layout (auto-detected) as an `AdaFlashDrafterModel`.

    Args:
        path: checkpoint folder (`config.json` + `*.safetensors`, sharded or not).
        dtype: cast to this dtype (default: the dtype the weights are stored in).
        drop_unsupported_heads: load an AdaFlash (ZinYY/AdaFlash) checkpoint without its threshold/prob heads,
            which cannot be mapped onto `AdaFlashLengthHead` (refused otherwise).
        load_length_head: for our layout, attach `length_head/` (and its `cost_model.json`) when present.
        config_overrides: config values a layout does not record or that should change, e.g.
            `vocab_size=target.config.vocab_size` (muse) or `mask_token_id=...`.
    Raises:
        CheckpointError: pickle weights, truncated/corrupt files, tensors that do not match the config, or
            unsupported features, each named with its file.
    """
    path = Path(path)
    layout = detect_layout(path)
    raw = read_config(path)
    infos = read_checkpoint_tensors(path)  # refuses pickle, truncated or corrupt files
    where = str(path / "config.json")
    if layout == "adaflash":
        try:
            config = AdaFlashDrafterConfig.from_pretrained(path, **config_overrides)
        except Exception as e:  # noqa: BLE001 - strict-config validation, re-raised with the file name
            raise CheckpointError(f"{where}: invalid AdaFlashDrafterConfig: {e}") from None
        try:  # `check_pretrained` (required config fields, tensors vs config), then the load and its checks
            model = AdaFlashDrafterModel.from_pretrained(path, config=config, use_safetensors=True,
                                                         dtype=dtype or "auto").to(device).eval()
        except ValueError as e:  # named by from_pretrained: re-raised as CheckpointError for the CLI
            raise e if isinstance(e, CheckpointError) else CheckpointError(str(e)) from None
        if load_length_head and (path / LENGTH_HEAD_DIR / "config.json").is_file():
            head, cost = load_length_head_folder(path / LENGTH_HEAD_DIR)
            SpeculationRuntime(length_head=head.to(device), cost_model=cost).attach(model)
        return model

    if layout == "muse":
        config, rename, ignored = muse_to_config(raw, where, **config_overrides), MUSE_TO_OURS, ()
    else:
        config, ignored = zlab_to_config(raw, where, drop_unsupported_heads=drop_unsupported_heads,
                                         **config_overrides)
        rename = {}
    if infos and all(n.startswith("model.") for n in infos):  # some exporters nest everything under `model.`
        infos = {n.removeprefix("model."): i for n, i in infos.items()}
    ignored = (*ignored, "rotary_emb.")
    dropped = sorted(n for n in infos if n.startswith(ignored) or ".rotary_emb." in n)
    kept = {n: i for n, i in infos.items() if n not in dropped}
    back = {ours: theirs for theirs, ours in rename.items()}
    check_tensors(kept, {back.get(n, n): s for n, s in _expected_shapes(config).items()}, str(path))
    not_float = sorted(f"{n} ({i.dtype}, in {i.file.name})" for n, i in kept.items() if i.dtype not in _DTYPES)
    if not_float:
        raise CheckpointError(f"{path}: tensors stored in non-float16/32/bf16 dtypes (quantized checkpoints are not "
                              f"supported): {not_float}.")
    if any(not n.endswith("inv_freq") for n in dropped):
        logger.warning("%s: dropped tensors of unsupported heads: %s", path, [n for n in dropped])
    state = {rename.get(n, n): t for n, t in load_tensors(kept).items()}
    model = _build(config, state, dtype or _checkpoint_dtype(kept), device)
    try:
        _check_loaded_weights(model, {}, path, "")  # the checks of `AdaFlashDrafterModel.from_pretrained`
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return model


def load_length_head_folder(folder):
    """`(AdaFlashLengthHead, TargetCostModel or None)` from a `length_head/` folder (safetensors only). The cost
    model arrived beside a checkpoint: it is `implicit`, applied only on the device it was measured on."""
    from ..generation.cost_model import TargetCostModel

    folder = Path(folder)
    try:  # `AdaFlashLengthHead.check_pretrained` first: required config fields, truncated files, missing tensors
        head = AdaFlashLengthHead.from_pretrained(folder, use_safetensors=True).eval()
    except ValueError as e:  # its own copy of the checks raises its own CheckpointError class
        raise CheckpointError(str(e)) from None
    cost_file = folder / COST_MODEL_FILE
    return head, (TargetCostModel.load(cost_file, implicit=True) if cost_file.is_file() else None)


def save_drafter_folder(drafter: AdaFlashDrafterModel, out_dir, *, length_head=None, cost_model=None) -> Path:
    """Our layout: the drafter (safetensors + `auto_map` code) and, if any, `length_head/` + its cost model."""
    out = Path(out_dir)
    drafter.save_pretrained(out, safe_serialization=True)
    runtime = getattr(drafter, "runtime", None)
    length_head = length_head if length_head is not None else getattr(runtime, "length_head", None)
    cost_model = cost_model if cost_model is not None else getattr(runtime, "cost_model", None)
    if length_head is not None:
        length_head.save_pretrained(out / LENGTH_HEAD_DIR, safe_serialization=True)
        if cost_model is not None:
            cost_model.save(out / LENGTH_HEAD_DIR / COST_MODEL_FILE)
    return out


def export_dflash_checkpoint(drafter: AdaFlashDrafterModel, out_dir, layout: str = "zlab", *,
                             drop_draft_vocab: bool = True, model_type: str = "qwen3",
                             overwrite: bool = False) -> Path:
    """Write `drafter` as `config.json` + `model.safetensors` in `layout` ("zlab", "muse" or "adaflash").

    The z-lab layout is what vLLM's and SGLang's DFlash loaders read; the muse layout loads with transformers'
    `MuseGlimmerAssistantModel.from_pretrained`. Only safetensors are written. Neither layout can express a draft
    vocabulary (`draft_vocab`): by default it is dropped with a warning of what that costs (`draft_vocab_warning`:
    the exported drafter drafts over the full vocabulary, a bigger LM-head product per drafting step and maybe
    lower acceptance; outputs stay exact); `drop_draft_vocab=False` refuses instead. An attached length head is not
    part of those layouts.
    """
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} already exists and is not empty; pass overwrite=True (CLI: --overwrite).")
    if layout == "adaflash":
        return save_drafter_folder(drafter, out)
    if drafter.draft_vocab is not None:
        if not drop_draft_vocab:
            raise CheckpointError(
                f"this drafter drafts from a {drafter.draft_vocab.numel()}-token draft vocabulary (`draft_vocab`), "
                f"which the {layout} layout cannot express, and drop_draft_vocab=False (CLI: --keep-draft-vocab) "
                "refuses to drop it. Without it the drafter is exported drafting over the full vocabulary."
            )
        logger.warning("%s", draft_vocab_warning(drafter, layout))
    dtype = drafter.fc.weight.dtype
    config = drafter.config  # draft_vocab_size is not written by either layout
    if layout == "zlab":
        config_json, rename = config_to_zlab(config, dtype, model_type=model_type), {}
    else:
        config_json, rename = config_to_muse(config, dtype), OURS_TO_MUSE
    if getattr(getattr(drafter, "runtime", None), "length_head", None) is not None:
        logger.warning("the attached length head is not exported: the %s layout has no place for it.", layout)
    state = {rename.get(k, k): t.detach().to("cpu").contiguous() for k, t in drafter.state_dict().items()
             if k != "draft_vocab"}
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors.index.json", "pytorch_model.bin"):
        (out / stale).unlink(missing_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return out


def draft_vocab_warning(drafter: AdaFlashDrafterModel, layout: str) -> str:
    """What exporting `drafter` without its draft vocabulary costs (the warning `export_dflash_checkpoint` logs)."""
    k, v = drafter.draft_vocab.numel(), drafter.config.vocab_size
    return (
        f"dropping the drafter's {k}-token draft vocabulary (`draft_vocab`): the {layout} layout cannot express "
        f"it, so the exported drafter drafts over the full {v}-token vocabulary. Cost: every drafting step "
        f"multiplies by the whole LM head ({v} rows) instead of {k} rows, and tokens outside the {k}-token draft "
        "vocabulary were never trained to be improbable, so acceptance may drop. Outputs stay exact: the target "
        "verifies every drafted token. (To refuse instead: drop_draft_vocab=False, CLI --keep-draft-vocab.)"
    )


def convert_checkpoint(src, dst, to: str, *, drop_unsupported_heads: bool = False, drop_draft_vocab: bool = True,
                       overwrite: bool = False, dtype: torch.dtype | None = None, **config_overrides) -> Path:
    """Load `src` (any layout) and write it to `dst` in layout `to`; a z-lab source keeps its `model_type`."""
    if to not in LAYOUTS:
        raise ValueError(f"--to must be one of {LAYOUTS}, got {to!r}.")
    layout = detect_layout(src)
    model_type = read_config(src).get("model_type", "qwen3") if layout in ("zlab", "adaflash-zlab") else "qwen3"
    drafter = load_dflash_checkpoint(src, dtype=dtype, drop_unsupported_heads=drop_unsupported_heads,
                                     **config_overrides)
    return export_dflash_checkpoint(drafter, dst, to, drop_draft_vocab=drop_draft_vocab, model_type=model_type,
                                    overwrite=overwrite)


__all__ = [
    "LAYOUTS",
    "convert_checkpoint",
    "detect_layout",
    "draft_vocab_warning",
    "export_dflash_checkpoint",
    "load_dflash_checkpoint",
    "load_length_head_folder",
    "read_config",
    "save_drafter_folder",
]
