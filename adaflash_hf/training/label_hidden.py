# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Hidden states for a selection of the label store: the training `datasets.Dataset` `DrafterTrainer` consumes.

The store (`label_store.py`) keeps token ids only; hidden states are large and depend on the drafter's
`target_layer_ids`, so they live in a derived, regenerable cache of Arrow shards next to the store, keyed per entry:
extending the store records only the new entries (one teacher-forced target forward per sequence).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .data import RECORDED_PER_TOKEN, fingerprint, recorded_features, teacher_forward
from .label_store import CORPUS_PROMPT_LEN, RECORD_FORMAT, LabelStore, _right_padded, fcntl, store_dir


logger = logging.getLogger(__name__)


def hidden_cache_dir(target_name: str, target, target_layer_ids: list[int], root: Path | None = None) -> Path:
    """Where the hidden states of `target` (name + dtype) at `target_layer_ids` are cached."""
    return store_dir(target_name, target.dtype, root) / "hidden" / (
        "layers-" + "-".join(map(str, target_layer_ids)) + "-" + fingerprint(RECORD_FORMAT, target_layer_ids)[:8])


def _cache_key(store: LabelStore, kind: str, entry: dict) -> str:
    return f"{store.name}/{kind}/{entry['key']}"


def _cached_shards(folder: Path) -> dict[str, tuple[Path, int]]:
    """`{cache key: (arrow file, row)}` of the complete shards in `folder`."""
    located = {}
    for keys_file in sorted(folder.glob("shard-*.keys.json")):
        arrow = keys_file.with_name(keys_file.name.replace(".keys.json", ".arrow"))
        if arrow.is_file():
            for row, key in enumerate(json.loads(keys_file.read_text())):
                located.setdefault(key, (arrow, row))
    return located


@torch.inference_mode()
def _record_shard(target, items, target_layer_ids, features, path: Path, batch_size: int,
                  label_tolerance: float, check: dict, bar) -> list[str]:
    """Record one shard: sorted by length, one forward per batch; corpus labels are checked against the forward."""
    from datasets.arrow_writer import ArrowWriter

    items = sorted(items, key=lambda item: len(item[3]["input_ids"]))
    tmp = path.with_name(path.name + ".tmp")
    keys = []
    writer = ArrowWriter(features=features, path=str(tmp), writer_batch_size=16)
    try:
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            ids, mask, lens = _right_padded([data["input_ids"] for *_, data in batch])
            recorded = teacher_forward(target, ids, mask, target_layer_ids)
            argmax = recorded["target_argmax"]
            for row, (store, kind, entry, data) in enumerate(batch):
                n = lens[row]
                if kind == "corpus":
                    check["tokens"] += n
                    check["mismatches"] += int((argmax[row, :n] != data["labels"]).sum())
                    if check["mismatches"] > label_tolerance * check["tokens"] + 2:
                        raise AssertionError(
                            f"stored corpus labels of {store.path} disagree with the recording target's argmax on "
                            f"{check['mismatches']}/{check['tokens']} positions: was the store labelled by a "
                            f"different model or dtype than {target.dtype}? (label_tolerance={label_tolerance})")
                writer.write({
                    "input_ids": data["input_ids"].astype(np.int32),
                    "prompt_len": int(entry["prompt_len"]) if kind == "responses" else CORPUS_PROMPT_LEN,
                    "domain": entry.get("domain", "unknown"),
                    **{name: recorded[name][row, :n] for name in RECORDED_PER_TOKEN},
                })
                keys.append(_cache_key(store, kind, entry))
            bar.update(sum(lens))
        writer.finalize()
    finally:
        writer.close()
    os.replace(tmp, path)
    keys_tmp = path.with_name(path.name.replace(".arrow", ".keys.tmp"))
    keys_tmp.write_text(json.dumps(keys))
    os.replace(keys_tmp, path.with_name(path.name.replace(".arrow", ".keys.json")))
    return keys


def build_label_dataset(target, target_layer_ids: list[int], target_name: str,
                        selection: list[tuple[LabelStore, str, dict]], *, record_batch_size: int = 4,
                        shard_size: int = 256, label_tolerance: float = 1e-3, root: Path | None = None,
                        progress: bool = True):
    """The training `datasets.Dataset` of `selection` (from `select_entries`), hidden states cached per entry.

    One teacher-forced forward of `target` per sequence records the hidden states at `target_layer_ids`
    (float16) and the greedy labels (`target_argmax`); corpus chunks get `prompt_len = CORPUS_PROMPT_LEN` so every
    position can anchor a block, and their stored labels must agree with the forward's argmax (up to
    `label_tolerance`, for near-ties under a different batch padding; the forward's are used). Recorded entries are
    cached as Arrow shards of `shard_size` sequences under `hidden_cache_dir(...)` (keyed by store, kind and entry
    key), so a later call with a larger selection records only what is new, and a killed call loses one shard.

    Returns the rows in selection order with the columns of `data.record_targets`.
    """
    import datasets

    width = len(target_layer_ids) * target.config.get_text_config().hidden_size
    features = recorded_features(width)
    folder = hidden_cache_dir(target_name, target, target_layer_ids, root)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".writer.lock", "a+") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        located = _cached_shards(folder)
        missing, seen = [], set()
        for store, kind, entry in selection:
            key = _cache_key(store, kind, entry)
            if key not in located and key not in seen:
                seen.add(key)
                missing.append((store, kind, entry))
        if missing:
            numbers = [int(p.name.split("-")[1].split(".")[0]) for p in folder.glob("shard-*.arrow")]
            next_number = max(numbers, default=-1) + 1
            total = sum(int(entry["n"]) for *_, entry in missing)
            logger.info("recording hidden states of %d sequences (%d tokens) into %s", len(missing), total, folder)
            check = {"tokens": 0, "mismatches": 0}
            with tqdm(total=total, desc="recording hidden states", unit="tok", unit_scale=True,
                      disable=not progress) as bar:
                for start in range(0, len(missing), shard_size):
                    items = [(store, kind, entry, store.read(kind, entry))
                             for store, kind, entry in missing[start : start + shard_size]]
                    path = folder / f"shard-{next_number:05d}.arrow"
                    next_number += 1
                    _record_shard(target, items, target_layer_ids, features, path, record_batch_size,
                                  label_tolerance, check, bar)
            if check["tokens"]:
                logger.info("corpus labels agree with the recording forward on %.4f%% of %d positions",
                            100 * (1 - check["mismatches"] / check["tokens"]), check["tokens"])
            located = _cached_shards(folder)
    files = sorted({located[_cache_key(*item)][0] for item in selection})
    if not files:
        return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    base = {path: 0 for path in files}
    parts = []
    for path in files:
        base[path] = sum(len(part) for part in parts)
        parts.append(datasets.Dataset.from_file(str(path)))
    full = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    indices = [base[located[_cache_key(*item)][0]] + located[_cache_key(*item)][1] for item in selection]
    return full.select(indices)


__all__ = ["build_label_dataset", "hidden_cache_dir"]
