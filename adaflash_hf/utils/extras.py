# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Optional dependencies (pip extras): a core install (torch, transformers, safetensors, huggingface_hub) decodes;
training, OnlineSpec, benches' plots and the testbed's GGUF conversion need an extra each.

`require("adaflash_hf.training", "datasets", ...)` raises `MissingExtraError`, an `ImportError` whose message is one
line naming the extra to install; `missing_extra_message(exc)` turns a `ModuleNotFoundError` of an optional module
(raised deeper, e.g. by a lazy `import matplotlib`) into the same line, for the CLI.
"""

import importlib.util


# optional module -> the extra that installs it
EXTRAS = {
    "trl": "train",
    "datasets": "train",
    "accelerate": "train",
    "peft": "online",
    "matplotlib": "bench",
    "gguf": "testbed",
    "faker": "testbed",
}


class MissingExtraError(ImportError):
    pass


def _line(feature: str, module: str) -> str:
    extra = EXTRAS.get(module, "dev")
    return (f"{feature} needs the optional dependency `{module}`, which is not installed: "
            f"pip install 'adaflash-hf[{extra}]'")


def require(feature: str, *modules: str) -> None:
    """Raise `MissingExtraError` (one line, naming the extra) unless every module in `modules` is importable."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtraError(_line(feature, module), name=module)


def missing_extra_message(exc: BaseException, feature: str = "this command") -> str | None:
    """The one-line message for an `ImportError` of an optional module, else None."""
    if isinstance(exc, MissingExtraError):
        return str(exc)
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if isinstance(exc, ImportError) and name in EXTRAS:
        return _line(feature, name)
    return None
