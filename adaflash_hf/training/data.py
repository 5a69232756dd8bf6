# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Training data for drafters: target responses, their hidden states and greedy labels, cached as `datasets`.

Two steps, each cached on disk under a key of everything that determines it:

1. `generate_responses`: the target answers the training prompts (batched, left-padded, greedy by default).
   The drafter must imitate the *target*, so its training text is the target's own output.
2. `record_targets`: one teacher-forced forward of the target over `prompt + response` records, per token, the
   hidden states at the drafter's `target_layer_ids` (float16 on disk) and the target's greedy next token.
   The same step labels any corpus text by prefill alone (no generation): see `blocks.block_labels`.

The result is a `datasets.Dataset` with columns `input_ids`, `prompt_len`, `domain`, `target_argmax`,
`hidden_states` (`[T, len(target_layer_ids) * H]`) and the target's top-`RECORDED_TOPK` next-token logits
(`target_topk_ids` / `target_topk_logits`, `[T, RECORDED_TOPK]`: the soft labels of `soft_label_weight`).
"""

import hashlib
import json
import logging
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm

from ..utils.prompts import encode_prompt
from .blocks import gather_context


logger = logging.getLogger(__name__)


def fingerprint(*parts) -> str:
    """Stable short hash of JSON-serialisable parts (cache keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@torch.inference_mode()
def generate_responses(
    target,
    tokenizer,
    records: list[dict],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    max_prompt_tokens: int = 384,
    do_sample: bool = False,
    temperature: float = 1.0,
    chat_template: bool = True,
    desc: str = "generating target responses",
) -> list[dict]:
    """Target responses for `records` (`{"prompt", "domain"}`), batched by prompt length to limit padding.

    Returns one dict per record (in input order) with `input_ids` (prompt + response, no padding), `prompt_len`
    and `domain`. Prompts longer than `max_prompt_tokens` are cut from the left (the end of a prompt matters most).
    """
    encoded = [encode_prompt(tokenizer, r["prompt"], chat_template)[-max_prompt_tokens:] for r in records]
    order = sorted(range(len(records)), key=lambda i: len(encoded[i]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results: list[dict | None] = [None] * len(records)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        idx = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        out = target.generate(
            input_ids=ids.to(target.device),
            attention_mask=mask.to(target.device),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
        ).cpu()
        eos = set(_as_list(target.generation_config.eos_token_id))
        for row, i in enumerate(idx):
            response = out[row, width:].tolist()
            for j, tok in enumerate(response):  # keep up to and including the first EOS
                if tok in eos:
                    response = response[: j + 1]
                    break
            results[i] = {
                "input_ids": list(encoded[i]) + response,
                "prompt_len": len(encoded[i]),
                "domain": records[i].get("domain", "unknown"),
            }
    return results  # type: ignore[return-value]


RECORDED_TOPK = 16
"""Next-token logits kept per recorded position (the target's top-k, float16): enough mass for soft labels at a
small fraction of the hidden states' size (16 x 6 bytes vs 5 x 576 x 2 bytes per token for the testbed)."""


def recorded_features(width: int) -> datasets.Features:
    """The columns `DrafterTrainer` consumes, as `record_targets` and `label_hidden` write them."""
    return datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "prompt_len": datasets.Value("int32"),
        "domain": datasets.Value("string"),
        "target_argmax": datasets.Sequence(datasets.Value("int32")),
        "hidden_states": datasets.Array2D(shape=(None, width), dtype="float16"),
        "target_topk_ids": datasets.Array2D(shape=(None, RECORDED_TOPK), dtype="int32"),
        "target_topk_logits": datasets.Array2D(shape=(None, RECORDED_TOPK), dtype="float16"),
    })


@torch.inference_mode()
def teacher_forward(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    target_layer_ids: list[int]) -> dict[str, np.ndarray]:
    """One teacher-forced target forward over right-padded `input_ids [b, T]`: per position the hidden states at
    `target_layer_ids` (`hidden_states [b, T, L*H]` float16), the greedy next token (`target_argmax [b, T]`) and the
    top-`RECORDED_TOPK` next-token logits (`target_topk_ids` int32 / `target_topk_logits` float16, `[b, T, k]`)."""
    out = target(input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
                 output_hidden_states=[i + 1 for i in target_layer_ids])
    top = out.logits.float().topk(RECORDED_TOPK, dim=-1)
    return {
        "hidden_states": gather_context(out.hidden_states, target_layer_ids).to(torch.float16).cpu().numpy(),
        "target_argmax": out.logits.argmax(dim=-1).cpu().numpy().astype(np.int32),
        "target_topk_ids": top.indices.cpu().numpy().astype(np.int32),
        "target_topk_logits": top.values.to(torch.float16).cpu().numpy(),
    }


RECORDED_PER_TOKEN = ("target_argmax", "hidden_states", "target_topk_ids", "target_topk_logits")


@torch.inference_mode()
def record_targets(
    target,
    sequences: list[dict],
    target_layer_ids: list[int],
    batch_size: int = 8,
    desc: str = "recording target hidden states",
) -> datasets.Dataset:
    """Teacher-forced target forward over `sequences` -> a `datasets.Dataset` ready for `DrafterTrainer`."""
    features = recorded_features(len(target_layer_ids) * target.config.get_text_config().hidden_size)

    def rows():
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["input_ids"]))
        for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
            idx = order[start : start + batch_size]
            lens = [len(sequences[i]["input_ids"]) for i in idx]
            ids = torch.zeros((len(idx), max(lens)), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):
                ids[row, : lens[row]] = torch.tensor(sequences[i]["input_ids"])
                mask[row, : lens[row]] = 1
            recorded = teacher_forward(target, ids, mask, target_layer_ids)
            for row, i in enumerate(idx):
                n = lens[row]
                yield {
                    "input_ids": sequences[i]["input_ids"],
                    "prompt_len": sequences[i]["prompt_len"],
                    "domain": sequences[i]["domain"],
                    **{name: recorded[name][row, :n] for name in RECORDED_PER_TOKEN},
                }

    return datasets.Dataset.from_generator(rows, features=features, cache_dir=None, keep_in_memory=False)


def build_training_dataset(
    target,
    tokenizer,
    records: list[dict],
    target_layer_ids: list[int],
    cache_root: Path,
    target_name: str,
    max_new_tokens: int = 256,
    gen_batch_size: int = 16,
    record_batch_size: int = 8,
    gen_dtype: torch.dtype | None = None,
) -> datasets.Dataset:
    """Generate (cached) then record (cached) the training data of `records` for `target`.

    `gen_dtype` (e.g. `torch.bfloat16`) generates the responses with a cast copy of the target, which is ~2x
    faster on CPU; the hidden states and labels are always recorded with `target` as given.
    """
    key_gen = fingerprint(target_name, [r["prompt"] for r in records], max_new_tokens, str(gen_dtype))
    gen_path = cache_root / f"responses-{key_gen}.jsonl"
    if gen_path.is_file():
        sequences = [json.loads(line) for line in gen_path.read_text().splitlines()]
    else:
        generator_model = target
        if gen_dtype is not None and gen_dtype != target.dtype:
            import copy

            generator_model = copy.deepcopy(target).to(gen_dtype)
        sequences = generate_responses(generator_model, tokenizer, records, max_new_tokens, gen_batch_size)
        gen_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = gen_path.with_suffix(".tmp")
        tmp.write_text("\n".join(json.dumps(s) for s in sequences))
        tmp.replace(gen_path)
    key_rec = fingerprint(key_gen, target_layer_ids, str(target.dtype), "topk", RECORDED_TOPK)
    rec_path = cache_root / f"recorded-{key_rec}"
    if (rec_path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(rec_path))
    dataset = record_targets(target, sequences, target_layer_ids, record_batch_size)
    tmp_path = rec_path.with_name(rec_path.name + ".tmp")
    dataset.save_to_disk(str(tmp_path))
    tmp_path.replace(rec_path)
    return datasets.load_from_disk(str(rec_path))


def frequent_tokens(dataset, k: int, always: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, float]:
    """The `k` most frequent response tokens of a recorded dataset (a drafter's draft vocabulary).

    Returns `(token_ids [k] sorted by id, coverage)` where coverage is the share of response tokens they cover.
    Ids in `always` (e.g. EOS) are included whatever their frequency.
    """
    responses = [torch.as_tensor(ids[start:], dtype=torch.long) for ids, start in
                 zip(dataset["input_ids"], dataset["prompt_len"])]
    tokens = torch.cat(responses) if responses else torch.zeros(0, dtype=torch.long)
    size = max([int(tokens.max()) + 1 if tokens.numel() else 0, *[t + 1 for t in always]])
    counts = torch.bincount(tokens, minlength=size)
    boosted = counts.clone()
    boosted[list(always)] = counts.max() + 1
    top = torch.topk(boosted, min(k, size)).indices
    coverage = float(counts[top].sum()) / max(int(counts.sum()), 1)
    return top.sort().values, coverage


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


__all__ = [
    "build_training_dataset",
    "encode_prompt",
    "fingerprint",
    "frequent_tokens",
    "generate_responses",
    "record_targets",
    "recorded_features",
    "teacher_forward",
]
