# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The transformers internals adaflash_hf relies on, checked on `import adaflash_hf` before anything is wrapped.

`import adaflash_hf` wraps three private `GenerationMixin` methods (`generation/dispatch.py`) and subclasses
transformers' `DFlashTokenCandidateGenerator` (calling its private `_get_noise_embeds`). Private methods change
without notice, so the package pins the transformers range it was tested with (`SUPPORTED_TRANSFORMERS`, the same
string as in pyproject.toml) and, at import, compares the parameter names of each of these methods with the ones
the wrappers were written for. On a mismatch the import raises `UnsupportedTransformersError` (an `ImportError`,
one line naming the supported versions) and nothing is wrapped: plain `generate` is untouched.
"""

import inspect


SUPPORTED_TRANSFORMERS = ">=5.24,<5.25"

# (module, class, method) -> parameter names, in order, of the transformers version(s) we support
EXPECTED_SIGNATURES = {
    ("transformers.generation.utils", "GenerationMixin", "_validate_generation_mode"): (
        "self", "generation_mode", "generation_config", "generation_mode_kwargs"),
    ("transformers.generation.utils", "GenerationMixin", "_get_candidate_generator"): (
        "self", "generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs",
        "assistant_model", "target_tokenizer", "assistant_tokenizer"),
    ("transformers.generation.utils", "GenerationMixin", "_assisted_decoding"): (
        "self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
        "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer", "model_kwargs"),
    ("transformers.generation.candidate_generator", "DFlashTokenCandidateGenerator", "__init__"): (
        "self", "assistant_model", "main_model_input_embeddings", "main_model_output_embeddings",
        "generation_config", "logits_processor", "kwargs"),
    ("transformers.generation.candidate_generator", "DFlashTokenCandidateGenerator", "_get_noise_embeds"): (
        "self", "noise_ids"),
    ("transformers.generation.candidate_generator", "DFlashTokenCandidateGenerator", "get_candidates"): (
        "self", "input_ids", "model_kwargs", "model_outputs", "is_first_iteration", "n_last_matches", "kwargs"),
    ("transformers.generation.candidate_generator", "DFlashTokenCandidateGenerator", "update_candidate_strategy"): (
        "self", "input_ids", "scores", "num_matches"),
}


class UnsupportedTransformersError(ImportError):
    pass


def incompatibilities() -> list[str]:
    """What differs from `EXPECTED_SIGNATURES` in the installed transformers (empty when compatible)."""
    import importlib

    problems = []
    for (module_name, class_name, method), expected in EXPECTED_SIGNATURES.items():
        qualname = f"{class_name}.{method}"
        try:
            function = getattr(getattr(importlib.import_module(module_name), class_name), method)
            if getattr(function, "__module__", None) == "adaflash_hf.generation.dispatch":  # our wrapper: installed
                function = importlib.import_module("adaflash_hf.generation.dispatch")._ORIGINALS[method]
        except (ImportError, AttributeError, KeyError):
            problems.append(f"{qualname} is missing")
            continue
        try:
            found = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            problems.append(f"{qualname} has no inspectable signature")
            continue
        if found != expected:
            problems.append(f"{qualname}{'(' + ', '.join(found) + ')'} is not the expected "
                            f"({', '.join(expected)})")
    return problems


def check_transformers() -> None:
    """Raise `UnsupportedTransformersError` (one line) if a transformers internal we wrap or call has changed."""
    problems = incompatibilities()
    if problems:
        import transformers

        raise UnsupportedTransformersError(
            f"adaflash_hf supports transformers{SUPPORTED_TRANSFORMERS} (installed: {transformers.__version__}), "
            f"whose private generation methods it wraps; here {'; '.join(problems)}. "
            f"Install a supported version: pip install 'transformers{SUPPORTED_TRANSFORMERS}'")
