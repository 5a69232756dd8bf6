# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""How `target.generate(..., assistant_model=drafter)` finds our candidate generator.

transformers picks a candidate generator in `GenerationMixin._get_candidate_generator` and has no registry for
new ones; `custom_generate` would make every user pass an extra argument. We therefore wrap two private methods
of `GenerationMixin`, narrowly: both wrappers act only when `assistant_model` is an AdaFlash drafter
(`config.model_type == "adaflash_drafter"`, so a drafter loaded with `trust_remote_code` counts too) and call the
original method unchanged in every other case (plain decoding, prompt lookup, ordinary assistant models, ...).

* `_validate_generation_mode`: refuses a mismatched target/drafter pair with one clear `ValueError` before any
  compute (and before transformers' own checks, whose messages talk about tokenizers).
* `_get_candidate_generator`: returns `AdaFlashCandidateGenerator` when no other speculation mode was asked for.
  `speculation_type="dflash"` keeps transformers' own `DFlashTokenCandidateGenerator` (the native path).

`install()` runs on `import adaflash_hf` and is idempotent; `uninstall()` restores the originals.
"""

from transformers.generation.utils import GenerationMixin

from .candidate_generator import AdaFlashCandidateGenerator


DRAFTER_MODEL_TYPE = "adaflash_drafter"
_ORIGINALS: dict[str, object] = {}


def is_adaflash_drafter(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == DRAFTER_MODEL_TYPE


def check_pair(target, drafter, tokenizer=None, assistant_tokenizer=None) -> None:
    """Raise one `ValueError` naming every mismatch between `target` and `drafter` (no compute)."""
    errors = list(drafter.compatibility_errors(target, tokenizer)) if hasattr(drafter, "compatibility_errors") else []
    if assistant_tokenizer is not None:
        errors.append("an AdaFlash drafter shares the target's tokenizer: do not pass `assistant_tokenizer`")
    if errors:
        raise ValueError(
            f"{type(drafter).__name__} cannot draft for {type(target).__name__}: " + "; ".join(errors) + "."
        )


def _uses_other_speculation(generation_config) -> bool:
    return (
        generation_config.speculation_type is not None
        or generation_config.prompt_lookup_num_tokens is not None
        or generation_config.assistant_early_exit is not None
        or getattr(generation_config, "use_mtp", False)
    )


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    drafter = generation_mode_kwargs.get("assistant_model")
    if is_adaflash_drafter(drafter):
        check_pair(
            self,
            drafter,
            tokenizer=generation_mode_kwargs.get("tokenizer"),
            assistant_tokenizer=generation_mode_kwargs.get("assistant_tokenizer"),
        )
    return _ORIGINALS["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


def _get_candidate_generator(self, generation_config, *args, assistant_model=None, **kwargs):
    if is_adaflash_drafter(assistant_model) and not _uses_other_speculation(generation_config):
        return AdaFlashCandidateGenerator(
            assistant_model=assistant_model,
            main_model_input_embeddings=self.get_input_embeddings(),
            main_model_output_embeddings=self.get_output_embeddings(),
            generation_config=generation_config,
            logits_processor=kwargs.get("logits_processor"),
        )
    return _ORIGINALS["_get_candidate_generator"](self, generation_config, *args, assistant_model=assistant_model, **kwargs)


_WRAPPERS = {
    "_validate_generation_mode": _validate_generation_mode,
    "_get_candidate_generator": _get_candidate_generator,
}


def install() -> None:
    """Route `generate(assistant_model=<AdaFlash drafter>)` to `AdaFlashCandidateGenerator` (idempotent)."""
    for name, wrapper in _WRAPPERS.items():
        if name not in _ORIGINALS:
            _ORIGINALS[name] = getattr(GenerationMixin, name)
            setattr(GenerationMixin, name, wrapper)


def uninstall() -> None:
    """Restore transformers' original methods."""
    for name, original in list(_ORIGINALS.items()):
        setattr(GenerationMixin, name, original)
        del _ORIGINALS[name]


def is_installed() -> bool:
    return all(getattr(GenerationMixin, name) is wrapper for name, wrapper in _WRAPPERS.items())
