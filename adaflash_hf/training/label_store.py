# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""A durable, compact, append-only store of target labels, and the training dataset built from it.

The drafter learns to imitate the target, so its data is *target-labelled* tokens. Labels are expensive (the
target's greedy generation, or at least a prefill over real text), hidden states are large and depend on the
drafter's `target_layer_ids`. This module therefore keeps the two apart:

* a `LabelStore` (token ids only, ~2-4 bytes per token) that later runs EXTEND instead of regenerating, with two
  kinds of entries:

  - `responses`: the target's greedy response to a prompt (chat template applied, batched, left-padded, sorted
    by prompt length within a window), stored as `prompt ids + response ids` with `prompt_len`. This is what
    DFlash trains on: every block of a response is on the target's greedy path.
  - `corpus`: real text (chunks of up to 512 tokens) teacher-forced through the target, with its argmax next
    token at every position, at prefill cost. `blocks.block_labels` masks the block positions where the text
    leaves the target's greedy path, so only the labels the drafter could be asked about are trained on.

* `build_label_dataset` (in `label_hidden.py`): a selection of the store (responses plus corpus chunks at a token ratio) turned into the
  `datasets.Dataset` `DrafterTrainer` consumes (the columns of `data.record_targets`), with the hidden states
  recorded by one teacher-forced target forward per sequence into a derived, regenerable cache of Arrow shards
  keyed per entry, so extending the store records only the new entries.

Store layout (`store_dir(target_name, dtype)` = `<cache>/labels/<target_key>`; the key names the target and the
dtype that produced the labels, e.g. `testbed-SmolLM2-135M-Instruct-bf16-<hash>`):

```
store.json            format, target name, dtype, vocab size, token dtype (uint16 when the vocab fits)
responses.bin         flat token ids of every response entry (prompt + response)
responses.jsonl       one line per entry: key, offset, n, prompt_len, domain, source, id, settings
corpus.bin            per entry: n input ids, then the target's n argmax labels
corpus.jsonl          one line per entry: key, offset, n, domain, source, doc, part
.writer.lock          one writer at a time (fcntl); readers need no lock
```

Training on the store (the testbed: responses generated in bf16, corpus labelled by the fp32 target):

```python
name = "testbed:SmolLM2-135M-Instruct"
responses, corpus = LabelStore.open(name, torch.bfloat16), LabelStore.open(name, torch.float32)
selection = select_entries(responses, corpus, corpus_ratio=1.0)      # corpus tokens : response tokens
dataset = build_label_dataset(target_fp32, drafter.config.target_layer_ids, name, selection)
```

Appends write the tokens (flushed and fsynced) before the index line, so a killed job loses at most the batch in
flight: a half-written index line is dropped on the next open and orphan token bytes are never referenced.
Entries are keyed by a stable hash of what determines them (the prompt and the generation settings; the chunk's
token ids), so re-running skips what is done and duplicates are labelled once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .data import _as_list, encode_prompt, fingerprint


try:  # POSIX only
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


logger = logging.getLogger(__name__)

STORE_FORMAT = 1
RECORD_FORMAT = 2  # 2: + the target's top-k next-token logits (soft labels)
KINDS = ("responses", "corpus")
CORPUS_PROMPT_LEN = 1
"""`prompt_len` of corpus chunks in the training dataset: the collator's first anchor is `max(prompt_len - 1, 1)`,
so every position with at least one context token can anchor a block."""

_DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# ------------------------------------------------------------------------------------------------ keys
def dtype_tag(dtype) -> str:
    """`torch.float32` / `"float32"` / `"fp32"` -> `"fp32"` (`bf16`, `fp16` likewise)."""
    name = str(dtype).replace("torch.", "")
    if name in _DTYPE_TAGS.values():
        return name
    if name not in _DTYPE_TAGS:
        raise ValueError(f"Unsupported dtype {dtype!r}; use one of {list(_DTYPE_TAGS)}")
    return _DTYPE_TAGS[name]


def target_key(target_name: str, dtype) -> str:
    """Directory name of a target's store: a readable slug of the name, the dtype tag and a hash of the name."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", target_name).strip("-.")[-64:] or "target"
    return f"{slug}-{dtype_tag(dtype)}-{fingerprint(target_name)[:8]}"


def labels_root() -> Path:
    """`<cache>/labels` (the cache root, `$ADAFLASH_HF_CACHE` or `~/.cache/adaflash_hf`)."""
    from ..utils.cache import cache_dir

    return cache_dir() / "labels"


def store_dir(target_name: str, dtype, root: Path | None = None) -> Path:
    return Path(root or labels_root()) / target_key(target_name, dtype)


def response_settings(max_new_tokens: int, max_prompt_tokens: int = 384, chat_template: bool = True) -> dict:
    """Everything besides the prompt that determines a greedy response (the store fixes target and dtype)."""
    return {"max_new_tokens": int(max_new_tokens), "max_prompt_tokens": int(max_prompt_tokens),
            "chat_template": bool(chat_template), "greedy": True}


def response_key(prompt: str, settings: dict) -> str:
    """Stable key of a response entry: hash of the prompt text and the generation settings."""
    return "r" + fingerprint("response", prompt, settings)


def corpus_key(input_ids) -> str:
    """Stable key of a corpus chunk: hash of its token ids."""
    data = np.asarray(input_ids, dtype=np.int64).tobytes()
    return "c" + hashlib.sha256(b"corpus:" + data).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ store
class LabelStore:
    """One target's labels (see the module docstring for the layout). Open with `LabelStore.open(name, dtype)`.

    Reading: `entries(kind)`, `keys(kind)`, `read(kind, entry)`, `summary()`. Writing (one process at a time):
    `add_responses`, `add_corpus`, or `append` inside `with store.writing():`.
    """

    def __init__(self, path: str | Path, *, target_name: str | None = None, dtype=None,
                 vocab_size: int | None = None):
        self.path = Path(path)
        meta_path = self.path / "store.json"
        if meta_path.is_file():
            self.meta = json.loads(meta_path.read_text())
            if self.meta.get("format") != STORE_FORMAT:
                raise ValueError(f"{self.path}: store format {self.meta.get('format')} != {STORE_FORMAT}")
            if vocab_size is not None and vocab_size > self.meta["vocab_size"]:
                raise ValueError(f"{self.path}: vocab size {vocab_size} > the store's {self.meta['vocab_size']}")
        else:
            if vocab_size is None:
                raise FileNotFoundError(f"No label store at {self.path} (pass vocab_size to create one)")
            self.path.mkdir(parents=True, exist_ok=True)
            self.meta = {
                "format": STORE_FORMAT,
                "target_name": target_name,
                "dtype": dtype_tag(dtype) if dtype is not None else None,
                "vocab_size": int(vocab_size),
                "token_dtype": "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32",
            }
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.meta, indent=2) + "\n")
            os.replace(tmp, meta_path)
        self.token_dtype = np.dtype(self.meta["token_dtype"])
        self._index: dict[str, tuple[int, list[dict]]] = {}
        self._lock_depth, self._lock_handle = 0, None

    @classmethod
    def open(cls, target_name: str, dtype, vocab_size: int | None = None, root: Path | None = None) -> "LabelStore":
        """The store of `target_name` labelled in `dtype` under `root` (default `labels_root()`), created if new."""
        return cls(store_dir(target_name, dtype, root), target_name=target_name, dtype=dtype, vocab_size=vocab_size)

    @property
    def name(self) -> str:
        return self.path.name

    def _files(self, kind: str) -> tuple[Path, Path]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.path / f"{kind}.bin", self.path / f"{kind}.jsonl"

    # -------------------------------------------------------------------------------------------- reading
    def entries(self, kind: str) -> list[dict]:
        """Index rows of `kind` in append order (complete lines only; the first entry of a key wins)."""
        _, index = self._files(kind)
        size = index.stat().st_size if index.is_file() else 0
        cached = self._index.get(kind)
        if cached is not None and cached[0] == size:
            return cached[1]
        rows, seen = [], set()
        if size:
            with open(index, "rb") as handle:
                text = handle.read(size)
            for line in text.split(b"\n")[:-1]:  # the piece after the last newline is incomplete
                if not line.strip():
                    continue
                row = json.loads(line)
                if row["key"] not in seen:
                    seen.add(row["key"])
                    rows.append(row)
        self._index[kind] = (size, rows)
        return rows

    def keys(self, kind: str) -> set[str]:
        return {row["key"] for row in self.entries(kind)}

    def read(self, kind: str, entry: dict) -> dict:
        """Token arrays of one entry: `input_ids` (int64) and, for corpus chunks, `labels` (the target's argmax)."""
        data, _ = self._files(kind)
        n, width = int(entry["n"]), 2 if kind == "corpus" else 1
        values = np.fromfile(data, dtype=self.token_dtype, count=n * width,
                             offset=int(entry["offset"]) * self.token_dtype.itemsize).astype(np.int64)
        if len(values) != n * width:
            raise ValueError(f"{data}: entry {entry['key']} is truncated")
        out = {"input_ids": values[:n]}
        if kind == "corpus":
            out["labels"] = values[n:]
        return out

    def iter_read(self, kind: str, entries: Iterable[dict] | None = None) -> Iterator[tuple[dict, dict]]:
        for entry in self.entries(kind) if entries is None else entries:
            yield entry, self.read(kind, entry)

    def summary(self) -> dict:
        """`{kind: {domain: {"sequences", "tokens", "label_tokens"}}}`: label tokens are response tokens (after the
        prompt) for responses and every position for corpus chunks."""
        out = {}
        for kind in KINDS:
            per = {}
            for row in self.entries(kind):
                d = per.setdefault(row.get("domain", "unknown"), {"sequences": 0, "tokens": 0, "label_tokens": 0})
                d["sequences"] += 1
                d["tokens"] += int(row["n"])
                d["label_tokens"] += int(row["n"]) - int(row.get("prompt_len", 0))
            if per:
                out[kind] = dict(sorted(per.items()))
        return out

    # -------------------------------------------------------------------------------------------- writing
    @contextlib.contextmanager
    def writing(self):
        """Hold the store's writer lock (re-entrant in one process; another process gets a `RuntimeError`)."""
        if self._lock_depth == 0:
            handle = open(self.path / ".writer.lock", "a+")
            if fcntl is not None:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    raise RuntimeError(f"Another process is writing to the label store {self.path}") from None
            self._lock_handle = handle
            for kind in KINDS:
                self._repair(kind)
        self._lock_depth += 1
        try:
            yield self
        finally:
            self._lock_depth -= 1
            if self._lock_depth == 0:
                self._lock_handle.close()  # releases the flock
                self._lock_handle = None

    def _repair(self, kind: str) -> None:
        """Drop an incomplete last index line (a job killed mid-append)."""
        _, index = self._files(kind)
        if not index.is_file():
            return
        with open(index, "rb+") as handle:
            text = handle.read()
            end = text.rfind(b"\n") + 1
            if end != len(text):
                logger.warning("%s: dropping an incomplete last line (%d bytes)", index, len(text) - end)
                handle.truncate(end)
        self._index.pop(kind, None)

    def append(self, kind: str, rows: list[dict]) -> int:
        """Append entries (each `{"key", "input_ids", ["labels"], **metadata}`); returns how many were new.

        Tokens go to `<kind>.bin` (flushed, fsynced), then one index line per entry to `<kind>.jsonl`.
        """
        if self._lock_depth == 0:
            raise RuntimeError("LabelStore.append needs `with store.writing():`")
        data, index = self._files(kind)
        done = self.keys(kind)
        fresh, seen = [], set()
        for row in rows:
            if row["key"] not in done and row["key"] not in seen:
                seen.add(row["key"])
                fresh.append(row)
        if not fresh:
            return 0
        itemsize, limit = self.token_dtype.itemsize, self.meta["vocab_size"]
        lines = []
        with open(data, "ab") as handle:
            end = handle.seek(0, os.SEEK_END)
            if end % itemsize:  # a torn write of a killed job: realign
                handle.write(b"\0" * (itemsize - end % itemsize))
                end += itemsize - end % itemsize
            offset = end // itemsize
            for row in fresh:
                ids = np.asarray(row["input_ids"], dtype=np.int64)
                parts = [ids] + ([np.asarray(row["labels"], dtype=np.int64)] if kind == "corpus" else [])
                if kind == "corpus" and len(parts[1]) != len(ids):
                    raise ValueError("corpus labels must have one label per input id")
                values = np.concatenate(parts)
                if len(values) and (values.min() < 0 or values.max() >= limit):
                    raise ValueError(f"token ids must lie in [0, {limit})")
                handle.write(values.astype(self.token_dtype).tobytes())
                meta = {k: v for k, v in row.items() if k not in ("input_ids", "labels")}
                lines.append(json.dumps({**meta, "offset": offset, "n": len(ids)}, sort_keys=True))
                offset += len(values)
            handle.flush()
            os.fsync(handle.fileno())
        with open(index, "a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in lines))
            handle.flush()
            os.fsync(handle.fileno())
        return len(fresh)

    # -------------------------------------------------------------------------------------------- labelling
    def add_responses(self, model, tokenizer, records: list[dict], *, max_new_tokens: int = 160,
                      batch_size: int = 32, max_prompt_tokens: int = 384, chat_template: bool = True,
                      window: int | None = None, allow_eval: bool = False, progress: bool = True,
                      mininterval: float = 0.1) -> dict:
        """Generate and store the greedy responses of `model` to the `records` (`{"prompt", "domain", ...}`) not
        in the store yet.

        Records are processed in their order, `window` at a time (default `8 * batch_size`), sorted by prompt
        length within a window (little padding, while any prefix of a round-robin record list stays balanced);
        every batch is appended as soon as it is generated. Records of the testbed's eval split are refused
        unless `allow_eval` (held-out evaluation must stay held out).

        Returns `{"sequences", "new_tokens", "seconds"}` of what was added.
        """
        if not allow_eval:
            _check_not_eval(records)
        settings = response_settings(max_new_tokens, max_prompt_tokens, chat_template)
        done, seen, pending = self.keys("responses"), set(), []
        for record in records:
            key = response_key(record["prompt"], settings)
            if key not in done and key not in seen:
                seen.add(key)
                pending.append((key, record))
        window = window or 8 * batch_size
        stats = {"sequences": 0, "new_tokens": 0, "seconds": 0.0}
        bar = tqdm(total=len(pending), desc="target responses", unit="prompt", disable=not progress,
                   mininterval=mininterval)
        with self.writing(), bar:
            for w in range(0, len(pending), window):
                encoded = [(key, record, encode_prompt(tokenizer, record["prompt"], chat_template)[-max_prompt_tokens:])
                           for key, record in pending[w : w + window]]
                encoded.sort(key=lambda item: len(item[2]))
                for b in range(0, len(encoded), batch_size):
                    batch = encoded[b : b + batch_size]
                    start = time.perf_counter()
                    responses = generate_greedy(model, tokenizer, [ids for _, _, ids in batch], max_new_tokens)
                    stats["seconds"] += time.perf_counter() - start
                    rows = []
                    for (key, record, ids), (response, finished) in zip(batch, responses):
                        rows.append({"key": key, "input_ids": list(ids) + response, "prompt_len": len(ids),
                                     "domain": record.get("domain", "unknown"), "source": record.get("source"),
                                     "id": record.get("id"), "finished": finished, **settings})
                        stats["new_tokens"] += len(response)
                    stats["sequences"] += self.append("responses", rows)
                    bar.update(len(batch))
                    bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.0f}", refresh=False)
        return stats

    def add_corpus(self, model, chunks: Iterable[dict], *, max_tokens: int | None = None, batch_size: int = 4,
                   progress: bool = True, mininterval: float = 0.1) -> dict:
        """Label corpus chunks (`{"input_ids", "domain", "source", "doc", "part"}`) not in the store yet with the
        argmax of a teacher-forced forward of `model`, until `max_tokens` new tokens were added.

        Chunks are pulled from `chunks` only as a batch is about to be labelled, so a shared iterator can be passed
        again later and continues where it stopped. Returns `{"sequences", "tokens", "seconds", "exhausted"}`.
        """
        done = self.keys("corpus")
        stats = {"sequences": 0, "tokens": 0, "seconds": 0.0, "exhausted": False}
        iterator = iter(chunks)
        bar = tqdm(total=max_tokens, desc="corpus labels", unit="tok", unit_scale=True, disable=not progress,
                   mininterval=mininterval)
        with self.writing(), bar:
            while max_tokens is None or stats["tokens"] < max_tokens:
                batch, keys = [], set()
                for chunk in iterator:
                    key = corpus_key(chunk["input_ids"])
                    if key in done or key in keys or len(chunk["input_ids"]) < 2:
                        continue
                    keys.add(key)
                    batch.append((key, chunk))
                    if len(batch) == batch_size:
                        break
                if not batch:
                    stats["exhausted"] = True
                    break
                start = time.perf_counter()
                labels = teacher_forced_argmax(model, [chunk["input_ids"] for _, chunk in batch])
                stats["seconds"] += time.perf_counter() - start
                rows = [{"key": key, "input_ids": chunk["input_ids"], "labels": label,
                         **{k: v for k, v in chunk.items() if k != "input_ids"}}
                        for (key, chunk), label in zip(batch, labels)]
                stats["sequences"] += self.append("corpus", rows)
                added = sum(len(chunk["input_ids"]) for _, chunk in batch)
                stats["tokens"] += added
                done |= keys
                bar.update(added)
                bar.set_postfix(tok_s=f"{stats['tokens'] / max(stats['seconds'], 1e-9):.0f}", refresh=False)
        return stats


def _check_not_eval(records: list[dict]) -> None:
    """Refuse records of the testbed's eval split (only for records of the testbed's own prompt sources)."""
    from ..testbed import split_of
    from ..testbed.sources import default_sources

    names = {source.name for source in default_sources()}
    bad = [r for r in records if r.get("source") in names and r.get("id") is not None
           and split_of(r["source"], str(r["id"])) == "eval"]
    if bad:
        raise ValueError(f"{len(bad)} record(s) belong to the testbed's EVAL split (e.g. {bad[0]['source']}/"
                         f"{bad[0]['id']}); pass allow_eval=True only if you mean to label held-out prompts")


# ------------------------------------------------------------------------------------------------ model calls
@torch.inference_mode()
def generate_greedy(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], bool]]:
    """Greedy responses to token-id prompts in one left-padded batch (as `data.generate_responses`).

    Returns `(response ids up to and including the first EOS, finished)` per prompt.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else pad_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                         pad_token_id=pad_id).cpu()
    eos = set(_as_list(model.generation_config.eos_token_id))
    results = []
    for row in range(len(prompts)):
        response, finished = out[row, width:].tolist(), False
        for j, tok in enumerate(response):
            if tok in eos:
                response, finished = response[: j + 1], True
                break
        results.append((response, finished))
    return results


def _right_padded(sequences: list) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    lens = [len(s) for s in sequences]
    ids = torch.zeros((len(sequences), max(lens)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : lens[row]] = torch.as_tensor(np.asarray(seq, dtype=np.int64))
        mask[row, : lens[row]] = 1
    return ids, mask, lens


@torch.inference_mode()
def teacher_forced_argmax(model, sequences: list) -> list[np.ndarray]:
    """The target's greedy next token at every position of each sequence (one right-padded forward)."""
    ids, mask, lens = _right_padded(sequences)
    logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
    argmax = logits.argmax(dim=-1).cpu().numpy()
    return [argmax[row, :n].astype(np.int64) for row, n in enumerate(lens)]


# ------------------------------------------------------------------------------------------------ dataset
def select_entries(responses: LabelStore | None = None, corpus: LabelStore | None = None, *,
                   corpus_ratio: float = 1.0, max_responses_per_domain: int | None = None,
                   max_corpus_tokens: int | None = None, domains: Iterable[str] | None = None,
                   corpus_domains: Iterable[str] | None = None) -> list[tuple[LabelStore, str, dict]]:
    """A deterministic selection `(store, kind, entry)` of the stores for a training dataset.

    Responses: all (or the first `max_responses_per_domain` per domain, in append order) of `domains`. Corpus:
    chunks taken round-robin over the corpus domains in append order until their tokens reach
    `corpus_ratio` x the selected response tokens (all of them, counted in whole sequences; with no responses,
    `max_corpus_tokens` alone bounds them), capped by `max_corpus_tokens`.
    """
    domains = set(domains) if domains is not None else None
    corpus_domains = set(corpus_domains) if corpus_domains is not None else domains
    chosen, counts, response_tokens = [], {}, 0
    if responses is not None:
        for entry in responses.entries("responses"):
            domain = entry.get("domain", "unknown")
            if domains is not None and domain not in domains:
                continue
            if max_responses_per_domain is not None and counts.get(domain, 0) >= max_responses_per_domain:
                continue
            counts[domain] = counts.get(domain, 0) + 1
            response_tokens += int(entry["n"])
            chosen.append((responses, "responses", entry))
    if corpus is not None and corpus_ratio > 0:
        budget = corpus_ratio * response_tokens if responses is not None else float("inf")
        if max_corpus_tokens is not None:
            budget = min(budget, max_corpus_tokens)
        per_domain: dict[str, list[dict]] = {}
        for entry in corpus.entries("corpus"):
            domain = entry.get("domain", "unknown")
            if corpus_domains is None or domain in corpus_domains:
                per_domain.setdefault(domain, []).append(entry)
        columns, row, taken = [per_domain[d] for d in sorted(per_domain)], 0, 0
        while taken < budget and any(row < len(column) for column in columns):
            for column in columns:
                if row < len(column) and taken < budget:
                    chosen.append((corpus, "corpus", column[row]))
                    taken += int(column[row]["n"])
            row += 1
    return chosen


__all__ = [
    "CORPUS_PROMPT_LEN",
    "LabelStore",
    "corpus_key",
    "generate_greedy",
    "labels_root",
    "response_key",
    "response_settings",
    "select_entries",
    "store_dir",
    "target_key",
    "teacher_forced_argmax",
]
