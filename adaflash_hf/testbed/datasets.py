# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The example scripts' recorded training data on the offline testbed (target responses + hidden states), cached.

Harness glue between the testbed's prompt sets and the library's `training.data.build_training_dataset`: the
library never imports the testbed, the testbed builds on the library.
"""

import datasets
import torch

from ..training.data import build_training_dataset


def testbed_training_dataset(target, tokenizer, target_layer_ids: list[int], prompts_per_domain: int = 300,
                             max_new_tokens: int = 160, gen_batch_size: int = 32,
                             gen_dtype: str = "bfloat16") -> datasets.Dataset:
    """The recorded training data of the offline testbed (train split of every domain), cached.

    Every example script calls this with the same defaults, so drafter, OPD and length-head training share one
    cached dataset.
    """
    import random

    from . import cache_dir, load_prompts

    records = load_prompts(split="train", max_per_domain=prompts_per_domain)
    random.Random(0).shuffle(records)
    return build_training_dataset(
        target, tokenizer, records, target_layer_ids, cache_root=cache_dir() / "datasets",
        target_name="testbed:SmolLM2-135M-Instruct", max_new_tokens=max_new_tokens,
        gen_batch_size=gen_batch_size, gen_dtype=getattr(torch, gen_dtype),
    )


def script_training_dataset(target, tokenizer, target_layer_ids: list[int], *, target_path: str | None = None,
                            train_prompts: str | None = None, prompts_per_domain: int = 300,
                            max_new_tokens: int = 160, gen_batch_size: int = 32,
                            gen_dtype: str = "bfloat16") -> datasets.Dataset:
    """The recorded training data of the example scripts (drafter, OPD, length head), cached.

    With a JSONL of prompts (`train_prompts`) or a target folder (`target_path`, then the testbed's train prompts):
    those prompts for that target; otherwise the testbed's dataset. The same arguments give the same cache entry in
    every script, so OPD and length-head training reuse the drafter's data.
    """
    if not (train_prompts or target_path):
        return testbed_training_dataset(target, tokenizer, target_layer_ids, prompts_per_domain, max_new_tokens,
                                        gen_batch_size, gen_dtype)
    import random

    from . import cache_dir, load_prompts, read_prompts_jsonl

    records = read_prompts_jsonl(train_prompts) if train_prompts else load_prompts(
        split="train", max_per_domain=prompts_per_domain)
    random.Random(0).shuffle(records)
    return build_training_dataset(
        target, tokenizer, records, target_layer_ids, cache_root=cache_dir() / "datasets",
        target_name=target_path or "testbed:SmolLM2-135M-Instruct", max_new_tokens=max_new_tokens,
        gen_batch_size=gen_batch_size, gen_dtype=getattr(torch, gen_dtype),
    )



__all__ = ["script_training_dataset", "testbed_training_dataset"]
