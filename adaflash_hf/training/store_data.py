# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Drafter training data from the target-label store: a selection, a fixed held-out slice, the draft vocabulary.

`label_store.select_entries` picks responses (and corpus chunks at a token ratio) from the stores; this module
splits that selection into training and validation data that stay apart however much the store grows:

* an entry is *held out* when a hash of its key falls in the first `holdout_permille` of 1000 buckets. The test
  depends on the entry alone, so a held-out entry is never trained on, in this run or any later one on a larger
  store, and the validation set (the first `val_per_domain` held-out responses of each domain, in the store's
  append order) is the same in every run once the store holds that many;
* the draft vocabulary (the K most frequent target tokens) is counted on the training *responses* only (corpus
  text is real text, not the target's output, and would skew it), straight from the store's token ids.

Usage (the testbed: responses generated in bf16, corpus and hidden states from the fp32 target):

```python
data = store_training_data(target_fp32, "testbed:SmolLM2-135M-Instruct", drafter.config.target_layer_ids,
                           response_dtype=torch.bfloat16, corpus_ratio=1.0)
data.train, data.val, data.info            # datasets for DrafterTrainer, and what they hold
vocab, coverage = data.draft_vocab(8192, always=[eos_id])
```
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data import frequent_tokens
from .label_hidden import build_label_dataset
from .label_store import LabelStore, select_entries, store_dir


def is_held_out(entry: dict, holdout_permille: int) -> bool:
    """Whether a store entry belongs to the held-out slice (a pure function of its key)."""
    digest = hashlib.sha256(("holdout:" + entry["key"]).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < holdout_permille


def split_holdout(selection: list, holdout_permille: int = 50, val_per_domain: int | None = 32,
                  val_kinds: tuple[str, ...] = ("responses",), candidates: list | None = None) -> tuple[list, list]:
    """`(train, val)` of a `select_entries` selection.

    Every held-out entry is left out of `train`; `val` holds the first `val_per_domain` held-out entries of each
    domain among `val_kinds` (all of them with `None`), taken in order from `candidates` (default: the selection;
    pass every entry of the store so that caps on the training data do not shrink or move the validation set).
    """
    train = [item for item in selection if not is_held_out(item[2], holdout_permille)]
    val, counts = [], {}
    for item in selection if candidates is None else candidates:
        _, kind, entry = item
        if kind not in val_kinds or not is_held_out(entry, holdout_permille):
            continue
        domain = entry.get("domain", "unknown")
        if val_per_domain is None or counts.get(domain, 0) < val_per_domain:
            counts[domain] = counts.get(domain, 0) + 1
            val.append(item)
    return train, val


def response_tokens(selection: list) -> dict[str, list]:
    """`{"input_ids", "prompt_len"}` of the response entries of a selection, read from the store (no hidden
    states): the shape `data.frequent_tokens` counts."""
    ids, starts = [], []
    for store, kind, entry in selection:
        if kind == "responses":
            ids.append(store.read(kind, entry)["input_ids"])
            starts.append(int(entry["prompt_len"]))
    return {"input_ids": ids, "prompt_len": starts}


def _summarise(selection: list) -> dict:
    out: dict = {}
    for _, kind, entry in selection:
        d = out.setdefault(kind, {}).setdefault(entry.get("domain", "unknown"),
                                                {"sequences": 0, "tokens": 0, "label_tokens": 0})
        d["sequences"] += 1
        d["tokens"] += int(entry["n"])
        d["label_tokens"] += int(entry["n"]) - (int(entry.get("prompt_len", 0)) if kind == "responses" else 0)
    return out


@dataclass
class StoreTrainingData:
    """What `store_training_data` returns: the two datasets, their selections and a JSON-able summary."""

    train: object
    val: object
    train_selection: list = field(repr=False)
    val_selection: list = field(repr=False)
    info: dict = field(default_factory=dict)

    def draft_vocab(self, k: int, always=()) -> tuple[torch.Tensor, float]:
        """The `k` most frequent target tokens of the training responses (and their coverage of them)."""
        return frequent_tokens(response_tokens(self.train_selection), k, always=always)


def store_training_data(target, target_name: str, target_layer_ids: list[int], *, response_dtype=torch.bfloat16,
                        corpus_dtype=None, corpus_ratio: float = 1.0, max_responses_per_domain: int | None = None,
                        max_corpus_tokens: int | None = None, domains=None, holdout_permille: int = 50,
                        val_per_domain: int | None = 32, root: Path | None = None, record_batch_size: int = 4,
                        record_dtype=None, progress: bool = True) -> StoreTrainingData:
    """Training and validation datasets of the label stores of `target_name` (hidden states recorded by `target`,
    cached per entry, so a later call on a grown store records only the new entries).

    Args:
        target: the target whose hidden states the drafter reads (its dtype is the corpus store's by default).
        response_dtype / corpus_dtype: the dtypes that keyed the response and corpus stores (`label_data.py`'s
            `--gen_dtype` / `--label_dtype`).
        corpus_ratio, max_responses_per_domain, max_corpus_tokens, domains: as `select_entries` (the held-out
            entries are counted in the ratio, then left out).
        holdout_permille, val_per_domain: the held-out slice (see `split_holdout`).
        record_dtype: record the hidden states with a copy of `target` in this dtype (cached apart from the other
            dtypes' recordings). On a CPU with bf16 instructions a bf16 copy records ~2x faster than fp32; the
            drafter still trains against `target`'s own (e.g. fp32) embedding and LM head.
    """
    corpus_dtype = corpus_dtype or target.dtype
    stores = {}
    for kind, dtype in (("responses", response_dtype), ("corpus", corpus_dtype)):
        path = store_dir(target_name, dtype, root)
        stores[kind] = LabelStore(path) if (path / "store.json").is_file() else None
    if stores["responses"] is None and stores["corpus"] is None:
        raise FileNotFoundError(f"No label store for {target_name!r} under {store_dir(target_name, response_dtype, root).parent}"
                                " (fill one with examples/label_data.py)")
    selection = select_entries(stores["responses"], stores["corpus"] if corpus_ratio > 0 else None,
                               corpus_ratio=corpus_ratio, max_responses_per_domain=max_responses_per_domain,
                               max_corpus_tokens=max_corpus_tokens, domains=domains)
    candidates = None
    if stores["responses"] is not None:  # validation: from every response of the store, whatever the caps
        wanted = set(domains) if domains is not None else None
        candidates = [(stores["responses"], "responses", e) for e in stores["responses"].entries("responses")
                      if wanted is None or e.get("domain", "unknown") in wanted]
    train_sel, val_sel = split_holdout(selection, holdout_permille, val_per_domain, candidates=candidates)
    if not train_sel:
        raise ValueError(f"The label store selection of {target_name!r} holds no training entries")
    recorder = target
    if record_dtype is not None and record_dtype != target.dtype:
        if stores["corpus"] is not None and corpus_ratio > 0 and record_dtype != corpus_dtype:
            raise ValueError(f"record_dtype={record_dtype} differs from the corpus store's dtype {corpus_dtype}: the "
                             "recording forward checks the corpus labels, so it must run in the labelling dtype")
        recorder = copy.deepcopy(target).to(record_dtype)
    # One call records every missing entry; the two datasets are then read from the cache.
    build_label_dataset(recorder, target_layer_ids, target_name, train_sel + val_sel,
                        record_batch_size=record_batch_size, root=root, progress=progress)
    train = build_label_dataset(recorder, target_layer_ids, target_name, train_sel, root=root, progress=False)
    val = build_label_dataset(recorder, target_layer_ids, target_name, val_sel, root=root, progress=False)
    info = {"stores": {k: str(s.path) for k, s in stores.items() if s is not None},
            "corpus_ratio": corpus_ratio, "max_responses_per_domain": max_responses_per_domain,
            "max_corpus_tokens": max_corpus_tokens, "holdout_permille": holdout_permille,
            "val_per_domain": val_per_domain, "train": _summarise(train_sel), "val": _summarise(val_sel),
            "train_sequences": len(train_sel), "train_tokens": int(sum(int(e["n"]) for *_, e in train_sel)),
            "val_sequences": len(val_sel)}
    return StoreTrainingData(train, val, train_sel, val_sel, info)


@dataclass
class StoreDataArguments:
    """Command-line arguments of the training scripts that read the label store (`HfArgumentParser` dataclass)."""

    label_store: bool = field(default=False, metadata={
        "help": "train on the target-label store (examples/label_data.py) instead of --train_prompts"})
    corpus_ratio: float = field(default=1.0, metadata={"help": "label store: corpus tokens per response token"})
    max_responses_per_domain: int | None = field(default=None, metadata={
        "help": "label store: the first N responses of each domain (default: all)"})
    max_corpus_tokens: int | None = field(default=None, metadata={"help": "label store: cap on corpus tokens"})
    holdout_permille: int = field(default=50, metadata={
        "help": "label store: entries held out of training (by key hash, per 1000)"})
    val_per_domain: int = field(default=32, metadata={"help": "label store: held-out responses per domain to eval"})
    label_dtype: str = field(default="float32", metadata={
        "help": "label store: dtype of the corpus labels and hidden states (the target is loaded in it)"})
    record_dtype: str | None = field(default=None, metadata={
        "help": "label store: record hidden states with a copy of the target in this dtype (bfloat16: ~2x faster "
                "on CPUs with bf16 instructions; cached apart); default: the target's dtype"})

    def load(self, target, target_name: str, target_layer_ids: list[int], response_dtype,
             progress: bool = True) -> StoreTrainingData:
        """`store_training_data` with these arguments."""
        return store_training_data(
            target, target_name, target_layer_ids, response_dtype=response_dtype, corpus_ratio=self.corpus_ratio,
            max_responses_per_domain=self.max_responses_per_domain, max_corpus_tokens=self.max_corpus_tokens,
            holdout_permille=self.holdout_permille, val_per_domain=self.val_per_domain, progress=progress,
            record_dtype=getattr(torch, self.record_dtype) if self.record_dtype else None)


def numpy_rows(dataset):
    """`dataset` formatted as numpy (hidden states arrive as `[T, W]` arrays, not nested lists: much faster
    collation)."""
    return dataset.with_format("numpy")


__all__ = ["StoreDataArguments", "StoreTrainingData", "is_held_out", "numpy_rows", "response_tokens", "split_holdout",
           "store_training_data"]
