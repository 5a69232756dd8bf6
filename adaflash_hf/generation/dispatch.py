# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""How `target.generate(..., assistant_model=drafter)` finds our candidate generator: the hook and its reach.

transformers picks a candidate generator in `GenerationMixin._get_candidate_generator` and has no registry for
new ones. `import adaflash_hf` therefore wraps exactly three private methods of `GenerationMixin`, process-wide, and
each wrapper acts ONLY when `assistant_model` is an AdaFlash drafter (`config.model_type == "adaflash_drafter"`, so
a drafter loaded with `trust_remote_code` counts too); in every other case it calls the original unchanged (plain
decoding, prompt lookup, ordinary assistant models, `speculation_type="dflash"`, ...):

* `_validate_generation_mode`: refuses a mismatched target/drafter pair with one clear `ValueError` before any
  compute (and before transformers' own checks, whose messages talk about tokenizers), and `num_return_sequences`
  > 1 with one pointing to `adaflash_hf.generate_batch` (transformers' assisted generation serves one sequence).
  A batch of several prompts is refused the same way when `_assisted_decoding` starts (the first point where the
  batch size is known), before any compute.
* `_get_candidate_generator`: returns `AdaFlashCandidateGenerator` when no other speculation mode was asked for.
  `speculation_type="dflash"` keeps transformers' own `DFlashTokenCandidateGenerator` (the native path).
* `_assisted_decoding`: adds this call's `SpeculationStats` to the output as `output.speculation_stats` when
  `return_dict_in_generate=True` (statistics are returned, never left on the drafter), and tells our generator when
  the request is served (an OnlineSpec adapter learns from the whole request then).

`install()` runs on `import adaflash_hf` and is idempotent; `uninstall()` restores the originals; `is_installed()`
tells. Without the hook, transformers' `custom_generate` route gives the same decoding for one call:
`target.generate(**inputs, custom_generate=adaflash_hf.speculative_decoding, drafter=drafter)` (the hook is
installed for the duration of that call only).

Knobs never travel as model attributes: the generator reads the drafter's `generation_config`
(`AdaFlashGenerationConfig`) and its `SpeculationRuntime`.
"""

import contextlib
import contextvars

import torch
from transformers.generation.utils import GenerationMixin

from .candidate_generator import AdaFlashCandidateGenerator
from .stats import SpeculationStats


DRAFTER_MODEL_TYPE = "adaflash_drafter"
_ORIGINALS: dict[str, object] = {}
# The `generate` call running in this context (set by the `_assisted_decoding` wrapper): its statistics, and the
# generators made for it (finished when the call ends: a served request is what sequence learning learns from).
_CALL: contextvars.ContextVar[dict | None] = contextvars.ContextVar("adaflash_call", default=None)


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


def _one_sequence_only(what: str) -> ValueError:
    return ValueError(
        f"generate(assistant_model=<AdaFlash drafter>) decodes one sequence per call (transformers' assisted "
        f"generation), got {what}: for batches use adaflash_hf.generate_batch(target, drafter, prompts, "
        f"max_new_tokens=...) (or adaflash_hf.batched_generate(target, input_ids, attention_mask, drafter=drafter) "
        f"for generate-style tensors); for several samples of one prompt, repeat the prompt in that batch.")


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    drafter = generation_mode_kwargs.get("assistant_model")
    if is_adaflash_drafter(drafter):
        check_pair(self, drafter, tokenizer=generation_mode_kwargs.get("tokenizer"),
                   assistant_tokenizer=generation_mode_kwargs.get("assistant_tokenizer"))
        if (generation_config.num_return_sequences or 1) > 1 and not _uses_other_speculation(generation_config):
            raise _one_sequence_only(f"num_return_sequences={generation_config.num_return_sequences}")
    return _ORIGINALS["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


def _get_candidate_generator(self, generation_config, *args, assistant_model=None, **kwargs):
    if is_adaflash_drafter(assistant_model) and not _uses_other_speculation(generation_config):
        call = _CALL.get()
        generator = AdaFlashCandidateGenerator(
            assistant_model=assistant_model,
            main_model_input_embeddings=self.get_input_embeddings(),
            main_model_output_embeddings=self.get_output_embeddings(),
            generation_config=generation_config,
            logits_processor=kwargs.get("logits_processor"),
            target=self,
            stats=None if call is None else call["stats"],
        )
        if call is not None:
            call["generators"].append(generator)
        return generator
    return _ORIGINALS["_get_candidate_generator"](self, generation_config, *args, assistant_model=assistant_model, **kwargs)


def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args,
                       assistant_model=None, **kwargs):
    original = _ORIGINALS["_assisted_decoding"]
    if not is_adaflash_drafter(assistant_model) or _uses_other_speculation(generation_config):
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config, *args,
                        assistant_model=assistant_model, **kwargs)
    if input_ids.shape[0] > 1:
        raise _one_sequence_only(f"a batch of {input_ids.shape[0]} sequences")
    call = {"stats": SpeculationStats(), "generators": []}
    token = _CALL.set(call)
    try:
        result = original(self, input_ids, logits_processor, stopping_criteria, generation_config, *args,
                          assistant_model=assistant_model, **kwargs)
        for generator in call["generators"]:
            generator.finish()
    finally:
        _CALL.reset(token)
    if not isinstance(result, torch.Tensor):
        result["speculation_stats"] = call["stats"]  # ModelOutput: a new key is also an attribute
    return result


_WRAPPERS = {
    "_validate_generation_mode": _validate_generation_mode,
    "_get_candidate_generator": _get_candidate_generator,
    "_assisted_decoding": _assisted_decoding,
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


@contextlib.contextmanager
def installed():
    """The hook for the duration of a `with` block (left installed if it already was)."""
    already = is_installed()
    install()
    try:
        yield
    finally:
        if not already:
            uninstall()


def speculative_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         synced_gpus: bool = False, streamer=None, drafter=None, **model_kwargs):
    """transformers `custom_generate` entry point: our speculative decoding for one `generate` call.

    `target.generate(**inputs, custom_generate=adaflash_hf.speculative_decoding, drafter=drafter, ...)` decodes
    exactly as `generate(assistant_model=drafter)` does, with or without the process-wide hook installed.
    """
    if not is_adaflash_drafter(drafter):
        raise ValueError("custom_generate=speculative_decoding needs `drafter=<an AdaFlash drafter>`.")
    check_pair(model, drafter)
    cache = model_kwargs.get("cache")
    if cache is not None and not hasattr(cache, "activate_past_recording"):
        raise ValueError(f"speculative decoding needs a DynamicCache-like cache, got {type(cache).__name__}.")
    with installed():
        return GenerationMixin._assisted_decoding(model, input_ids, logits_processor, stopping_criteria,
                                                  generation_config, synced_gpus=synced_gpus, streamer=streamer,
                                                  assistant_model=drafter, **model_kwargs)


__all__ = ["check_pair", "install", "installed", "is_adaflash_drafter", "is_installed", "speculative_decoding",
           "uninstall"]
