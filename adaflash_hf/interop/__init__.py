# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Interop with other DFlash drafter checkpoints: z-lab DFlash (served by vLLM and SGLang), AdaFlash
(ZinYY/AdaFlash, z-lab layout + threshold heads) and transformers' `muse_glimmer_assistant`.

    from adaflash_hf.interop import load_dflash_checkpoint, export_dflash_checkpoint
    drafter = load_dflash_checkpoint("path/to/Qwen3-8B-DFlash-b16")          # any supported layout
    export_dflash_checkpoint(drafter, "out/zlab", layout="zlab")            # vLLM / SGLang can serve it

CLI: `python -m adaflash_hf.interop convert SRC DST --to {adaflash,zlab,muse}` and
`python -m adaflash_hf.interop inspect SRC`. The layouts and the sources they were checked against are described
in `dflash.py` and `muse.py`.
"""

from .convert import (
    LAYOUTS,
    convert_checkpoint,
    detect_layout,
    export_dflash_checkpoint,
    load_dflash_checkpoint,
    load_length_head_folder,
    read_config,
    save_drafter_folder,
)
from .dflash import build_target_layer_ids
from .safety import CheckpointError, read_checkpoint_tensors, read_safetensors_header


__all__ = [
    "LAYOUTS",
    "CheckpointError",
    "build_target_layer_ids",
    "convert_checkpoint",
    "detect_layout",
    "export_dflash_checkpoint",
    "load_dflash_checkpoint",
    "load_length_head_folder",
    "read_checkpoint_tensors",
    "read_config",
    "read_safetensors_header",
    "save_drafter_folder",
]
