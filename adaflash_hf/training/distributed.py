# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Data-parallel training on CPUs: what the example scripts call first.

`accelerate launch --multi_gpu --num_processes N examples/train_*.py ...` starts N processes through torchrun
(`WORLD_SIZE=N`). On a machine without GPUs, transformers' `TrainingArguments` only forms the gloo process group
(accelerate's `MULTI_CPU`) when told to use the CPU; otherwise each process silently trains alone on all the data
and every one saves. `use_cpu_when_data_parallel_without_gpus()` tells it (`ACCELERATE_USE_CPU=true`) before the
arguments set up their devices. Note: `accelerate launch --cpu --num_processes N` starts ONE process in accelerate
1.x (its CPU multi-process launcher is MPI's, with `--mpirun_hostfile`); use `--multi_gpu` as above instead.
"""

import os


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def use_cpu_when_data_parallel_without_gpus() -> bool:
    """Under a multi-process launcher (`WORLD_SIZE` > 1) with no CUDA device, make `TrainingArguments` form the
    gloo process group on CPU. Returns whether it did. Call before parsing `TrainingArguments`."""
    import torch

    if world_size() > 1 and not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"
        return True
    return False
