# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Safe reading of foreign checkpoints: safetensors only, headers checked before any tensor is read.

A safetensors file is `[8-byte little-endian header length N][N bytes of JSON header][data]`; the header maps each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data section). Reading the
header costs a few kilobytes, so a truncated or corrupt file, or one whose tensors do not match the config, is
refused with an error naming the file before anything big is allocated. Pickle-based weights (`*.bin`, `*.pt`,
...) are never opened: unpickling can run arbitrary code.

The checks are `adaflash_hf/models/drafter/checkpoint_checks.py` (re-exported here), the same functions
`AdaFlashDrafterModel.from_pretrained` and `AdaFlashLengthHead.from_pretrained` run.
"""

from pathlib import Path

# The one checker every loader uses (`from_pretrained` of the drafter and the length head, the CLI, `inspect`); it
# lives beside the model code because it is copied next to checkpoints with it (`auto_map`).
from ..models.drafter.checkpoint_checks import (
    PICKLE_SUFFIXES,
    SAFETENSORS_INDEX,
    CheckpointError,
    PickleWeightsError,
    TensorInfo,
    check_tensors,
    find_weight_files,
    pickle_message,
    read_checkpoint_tensors,
    read_safetensors_header,
)


_pickle_message = pickle_message  # the name older callers import


def load_tensors(infos: dict[str, TensorInfo], names=None) -> dict:
    """Read the named tensors (all by default) from their files, after their headers were checked."""
    from safetensors import safe_open

    names = list(infos) if names is None else list(names)
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(infos[name].file, []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


__all__ = [
    "PICKLE_SUFFIXES",
    "SAFETENSORS_INDEX",
    "CheckpointError",
    "PickleWeightsError",
    "TensorInfo",
    "check_tensors",
    "find_weight_files",
    "load_tensors",
    "read_checkpoint_tensors",
    "read_safetensors_header",
]
