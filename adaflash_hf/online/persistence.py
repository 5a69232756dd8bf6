# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Saving and loading an `OnlineSpecAdapter` (`save_pretrained` / `from_pretrained`), learner state included.

A saved folder:

    online_config.json             the `OnlineSpecConfig`
    adapter_config.json            PEFT format: one adapter in the folder; an ensemble: one subfolder per member
    adapter_model.safetensors
    online_optimizer.safetensors   learner tensors (`OnlineSpecAdapter.training_state`): each member's Adam moments
                                   and optimistic hint, the safety rollback's good snapshot, kept feedback
    online_state.json              the rest of the learner state (request counter, gate, safety window, Hedge, step
                                   counts, stats); written last, it marks the folder complete and holds every other
                                   file's SHA-256, so a folder mixing files of two saves is refused

Resuming is exact: a loaded adapter takes the same next updates as the one that was saved (the request counter that
seeds each request's anchors is restored too). What decoding itself keeps across calls (the proposal policy in the
drafter's `SpeculationRuntime`) is not the adapter's and is not saved here.

Crash safety (old or new adapter loadable at every instant): everything is written and fsynced into a sibling
`.NAME.tmp-<id>`, whose `online_state.json` is written last (atomically: `.part`, then `os.replace`); then `folder`
is renamed aside to `.NAME.old-<id>`, the complete tmp folder renamed to `folder`, and the old one deleted. A crash
before the first rename leaves the old `folder`; between the two renames `folder` is missing and loading takes the
complete `.NAME.tmp-*` sibling (the new adapter), else the newest `.NAME.old-*` one (the previous adapter); after
the second, `folder` is the new adapter. The next save puts `folder` back and deletes the leftovers. Concurrent saves
to one folder are not supported.

Loading validates every file first (JSON, keys, tensor names and shapes against a data-free replica of the drafter,
finite values, checksums) and only then changes the drafter; a failure after that detaches the adapter again. A
failed load leaves the drafter as it was: same modules, same `requires_grad`, same weights.
"""

import copy
import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import fields
from pathlib import Path

import torch
from peft.functional import get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from ..generation.runtime import SpeculationRuntime
from .feedback import FEEDBACK_LAYOUT, feedback_tensor_names
from .learners import OnlineLearner
from .online_config import CONFIG_NAME, OnlineSpecConfig
from .stats import OnlineStats


STATE_NAME = "online_state.json"
WEIGHTS_NAME = "adapter_model.safetensors"
TENSORS_NAME = "online_optimizer.safetensors"
STATE_VERSION = 2  # 1 (no `version` key): LoRA weights and Hedge weights only


def lora_keys(module) -> list[str]:
    """Names of the LoRA matrices of `module`, in the order of `OnlineSpecAdapter.lora_parameters`:
    `<module name>.lora_A`, `<module name>.lora_B` of each wrapped linear."""
    return [f"{name}.lora_{ab}" for name, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)
            for ab in "AB"]


# ---------------------------------------------------------------------------------------------------------- save
def save_adapter(adapter, folder) -> Path:
    """Write `adapter` to `folder` crash-safely (module docstring). Returns `folder`."""
    state, tensors = adapter.training_state()  # waits for a background update and copies it in first
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = folder.with_name(f".{folder.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        names = adapter.config.adapter_names
        for name in names:
            sub = tmp if len(names) == 1 else tmp / name
            sub.mkdir(exist_ok=True)
            adapter.lora_config.save_pretrained(str(sub))
            save_file(_on_cpu(get_peft_model_state_dict(adapter.drafter, adapter_name=name)), str(sub / WEIGHTS_NAME))
        adapter.config.save_pretrained(tmp)
        save_file(_on_cpu(tensors), str(tmp / TENSORS_NAME))
        state["files"] = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        _fsync_tree(tmp)
        part = tmp / f".{STATE_NAME}.part"  # the state file goes last, atomically: it marks `tmp` complete
        part.write_text(json.dumps(state) + "\n")
        _fsync(part)
        os.replace(part, tmp / STATE_NAME)
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder.exists():
        os.replace(folder, folder.with_name(f".{folder.name}.old-{tag}"))
    os.replace(tmp, folder)
    _fsync(folder.parent)
    for leftover in _save_leftovers(folder):  # this save's old folder, and those of crashed saves
        shutil.rmtree(leftover, ignore_errors=True)
    return folder


def _on_cpu(tensors: dict) -> dict:
    """Own CPU copies (safetensors refuses tensors sharing memory)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------- load
def load_adapter(cls, drafter, folder, attach: bool = True):
    """`cls.from_pretrained`: validate everything in `folder`, then build the adapter on `drafter` (module
    docstring)."""
    from ..interop.safety import PICKLE_SUFFIXES, CheckpointError, _pickle_message

    runtime = getattr(drafter, "runtime", None)
    if runtime is not None and runtime.online_adapter is not None:
        raise ValueError("this drafter already carries an online adapter; detach() it first.")
    folder = _recover_saved_folder(Path(folder))
    config = OnlineSpecConfig.from_pretrained(folder)
    state_path = folder / STATE_NAME
    if not state_path.is_file():
        raise FileNotFoundError(f"{state_path} missing: incomplete OnlineSpec adapter folder (the learner state is "
                                "written last, so the save did not finish); refusing to resume from defaults.")
    state = _read_json(state_path)
    legacy = isinstance(state, dict) and "version" not in state
    problems = _legacy_problems(state, config) if legacy else _state_problems(state, config)
    if problems:
        raise ValueError(f"{state_path}: corrupt learner state: " + "; ".join(problems) + ".")

    weight_shapes, param_shapes = _lora_layout(drafter, config)
    names = config.adapter_names
    weights = {}
    for name in names:
        sub = folder if len(names) == 1 else folder / name
        path = sub / WEIGHTS_NAME
        if not path.is_file():
            pickles = sorted(p for p in sub.iterdir() if p.suffix in PICKLE_SUFFIXES) if sub.is_dir() else []
            if pickles:
                raise CheckpointError(_pickle_message(pickles))
            raise FileNotFoundError(f"{path} missing: incomplete OnlineSpec adapter folder.")
        weights[name] = found = _read_safetensors(path)
        missing, unexpected = sorted(set(weight_shapes) - set(found)), sorted(set(found) - set(weight_shapes))
        if missing:
            raise ValueError(f"{path}: incomplete adapter, missing {len(missing)} of {len(weight_shapes)} LoRA "
                             f"tensors: {missing}.")
        if unexpected:
            raise ValueError(f"{path}: weights do not fit this drafter (unexpected tensors {unexpected}).")
        _check_tensors(path, found, weight_shapes, finite=found)
    tensors = {}
    if legacy:
        warnings.warn(f"{state_path} was written before the learner state was saved: it holds no Adam moments, "
                      "optimistic hint, gate, safety window or request counter. Resuming from the LoRA and Hedge "
                      "weights only: the next updates differ from those of an uninterrupted run. Save again to "
                      "resume exactly from now on.", stacklevel=3)
    else:
        tensors = _read_safetensors(folder / TENSORS_NAME)
        expected = _expected_tensors(config, state, param_shapes)
        _check_tensors(folder / TENSORS_NAME, tensors, expected,
                       finite={k: t for k, t in tensors.items() if not k.startswith("feedback/")})
        _check_checksums(folder, state["files"], [CONFIG_NAME, TENSORS_NAME] + [
            (WEIGHTS_NAME if len(names) == 1 else f"{name}/{WEIGHTS_NAME}") for name in names])

    # Everything is validated: only now does the drafter change (and a failure from here on is undone).
    adapter = cls(drafter, config)
    try:
        for name in names:
            set_peft_model_state_dict(drafter, weights[name], adapter_name=name)
        adapter.load_training_state(state, tensors)
    except BaseException:
        adapter.detach()
        raise
    if attach:
        SpeculationRuntime.of(drafter).online_adapter = adapter
    return adapter


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: corrupt file, not valid JSON ({error}).") from None


def _read_safetensors(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: incomplete OnlineSpec adapter folder.")
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error type for a truncated or garbled file
        raise ValueError(f"{path}: corrupt safetensors file ({error}).") from None


def _lora_layout(drafter, config: OnlineSpecConfig) -> tuple[dict, dict]:
    """What the adapter will be on `drafter`, found without touching it: `(PEFT state-dict key -> shape of one
    member's weights, lora_keys -> shape)`, from a data-free replica of `drafter` (meta tensors) with one member
    injected by PEFT itself."""
    replica, name = _meta_replica(drafter, {}), config.adapter_names[0]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        inject_adapter_in_model(config.lora_config(), replica, adapter_name=name)
    weights = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(replica, adapter_name=name).items()}
    layers = [m for m in replica.modules() if isinstance(m, BaseTunerLayer)]
    shapes = [tuple(w.shape) for layer in layers for w in (layer.lora_A[name].weight, layer.lora_B[name].weight)]
    return weights, dict(zip(lora_keys(replica), shapes))


def _meta_replica(module: torch.nn.Module, done: dict) -> torch.nn.Module:
    """A structural copy of `module`: new module objects (dict attributes copied, so PEFT's injection changes only
    the copy), parameters and buffers as meta tensors (no data is copied); other attributes shared, read-only."""
    if id(module) in done:
        return done[id(module)]
    clone = done[id(module)] = copy.copy(module)
    attrs = vars(clone)
    for key, value in list(attrs.items()):
        if isinstance(value, dict):
            attrs[key] = copy.copy(value)
    attrs["_parameters"] = {k: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                                         requires_grad=p.requires_grad)
                            for k, p in module._parameters.items()}
    attrs["_buffers"] = {k: None if b is None else torch.empty_like(b, device="meta")
                         for k, b in module._buffers.items()}
    attrs["_modules"] = {k: None if m is None else _meta_replica(m, done) for k, m in module._modules.items()}
    return clone


def _expected_tensors(config: OnlineSpecConfig, state: dict, params: dict) -> dict:
    """Name -> shape (None: any) of every tensor `online_optimizer.safetensors` must hold."""
    rule = config.ensemble_base if config.algorithm == "ensemble" else config.algorithm
    kinds = OnlineLearner.buffers_of(rule, config.optimizer)
    expected = {}
    for name in config.adapter_names:
        for prefix, prefix_kinds in ((f"learner/{name}", kinds), (f"good/{name}", ("params", *kinds))):
            expected.update((f"{prefix}/{kind}/{key}", shape) for kind in prefix_kinds for key, shape in params.items())
    for i, meta in enumerate(state["feedback"]):
        expected.update((f"feedback/{i}/{f}", None) for f in feedback_tensor_names(meta))
    return expected


def _check_tensors(path: Path, found: dict, expected: dict, finite: dict) -> None:
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = [f"{k} {list(found[k].shape)} (expected {list(shape)})" for k, shape in expected.items()
             if k in found and shape is not None and tuple(found[k].shape) != tuple(shape)]
    bad = [k for k, t in finite.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    problems = ([f"missing tensors {missing}"] if missing else []) + (
        [f"unexpected tensors {unexpected}"] if unexpected else []) + ([f"wrong shapes {wrong}"] if wrong else []) + (
        [f"non-finite values in {bad}"] if bad else [])
    if problems:
        raise ValueError(f"{path}: corrupt adapter: " + "; ".join(problems))


def _check_checksums(folder: Path, files: dict, required: list[str]) -> None:
    """Every file the state lists has its checksum (a file of another save, or damaged, is refused)."""
    unlisted = sorted(set(required) - set(files))
    if unlisted:
        raise ValueError(f"{folder / STATE_NAME}: corrupt learner state: no checksum for {unlisted}.")
    for rel, digest in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: incomplete OnlineSpec adapter folder.")
        if _sha256(path) != digest:
            raise ValueError(f"{path} does not match {folder / STATE_NAME} (checksum differs): the file was changed "
                             "after the save or comes from another save.")


def _is_int(x, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _hedge_problem(where: str, value, n: int) -> list[str]:
    if isinstance(value, list) and len(value) == n and all(_is_number(x) for x in value):
        return []
    return [f"{where} must be a list of {n} numbers"]


def _legacy_problems(state, config: OnlineSpecConfig) -> list[str]:
    if "hedge_cumulative" not in state:
        return ["missing key 'hedge_cumulative'"]
    return _hedge_problem("hedge_cumulative", state["hedge_cumulative"], len(config.adapter_names))


def _state_problems(state, config: OnlineSpecConfig) -> list[str]:
    """What is wrong with an `online_state.json` (version 2) for an adapter of `config` (empty: nothing)."""
    if not isinstance(state, dict):
        return ["not a JSON object"]
    required = {"version", "requests_seen", "learn_interval", "reference", "checked", "hedge_cumulative",
                "learner_steps", "good", "stats", "feedback", "pending", "recent", "stream", "files"}
    missing = sorted(required - set(state))
    if missing:
        return [f"missing keys {missing}"]
    if state["version"] != STATE_VERSION:
        return [f"version {state['version']!r} is not supported (this adaflash_hf reads version {STATE_VERSION})"]
    members, problems = config.adapter_names, []
    for key, low in (("requests_seen", 0), ("checked", 0), ("learn_interval", 1)):
        if not _is_int(state[key], low):
            problems.append(f"{key} must be an integer >= {low}")
    if state["reference"] is not None and not _is_number(state["reference"]):
        problems.append("reference must be a number or null")
    good = state["good"] if isinstance(state["good"], dict) else {}
    for where, part in (("", state), ("good.", good)):
        problems += _hedge_problem(f"{where}hedge_cumulative", part.get("hedge_cumulative"), len(members))
        steps = part.get("learner_steps")
        if not (isinstance(steps, dict) and set(steps) == set(members) and all(map(_is_int, steps.values()))):
            problems.append(f"{where}learner_steps must map {members} to step counts")
    stats = state["stats"]
    names = {f.name for f in fields(OnlineStats)}
    # Counters added since a state was saved take their defaults (e.g. `vocab_added`); unknown keys are corrupt.
    if not (isinstance(stats, dict) and set(stats) <= names and {"losses", "updates"} <= set(stats)):
        problems.append(f"stats must have keys among {sorted(names)}, with losses and updates")
    else:
        defaults = OnlineStats()
        for key, value in stats.items():
            is_list = isinstance(getattr(defaults, key), list)
            if not (isinstance(value, list) if is_list else _is_number(value)):
                problems.append(f"stats.{key} must be a {'list' if is_list else 'number'}")
    kept = state["feedback"]
    if not isinstance(kept, list) or not all(
            isinstance(m, dict) and m.get("kind") in FEEDBACK_LAYOUT and all(
                _is_int(m.get(f)) for f in FEEDBACK_LAYOUT[m["kind"]][2]) for m in kept):
        problems.append("feedback must be a list of {kind, counts} entries")
        kept = []
    for key in ("pending", "recent", "stream"):
        if not (isinstance(state[key], list) and all(_is_int(i) and i < len(kept) for i in state[key])):
            problems.append(f"{key} must list indices into feedback")
    files = state["files"]
    if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values()) and all(
            not Path(k).is_absolute() and ".." not in Path(k).parts for k in files)):
        problems.append("files must map file names inside the folder to SHA-256 digests")
    return problems


# --------------------------------------------------------------------------------------------- crash leftovers
def _fsync(path) -> None:
    """Flush a file's or a folder's entry to disk (best effort: some filesystems refuse folder fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(root)


def _save_leftovers(folder: Path) -> list[Path]:
    """`.NAME.tmp-*` and `.NAME.old-*` siblings of `folder` (what interrupted or finished saves leave)."""
    prefix = f".{folder.name}."
    if not folder.parent.is_dir():
        return []
    return sorted(p for p in folder.parent.iterdir()
                  if p.name.startswith((prefix + "tmp-", prefix + "old-")) and p.is_dir())


def _recover_saved_folder(folder: Path) -> Path:
    """`folder`, or when a save was interrupted between its renames, the complete sibling to load instead."""
    if folder.exists():
        return folder
    leftovers = _save_leftovers(folder)
    new = [p for p in leftovers if p.name.startswith(f".{folder.name}.tmp-") and (p / STATE_NAME).is_file()]
    old = [p for p in leftovers if p.name.startswith(f".{folder.name}.old-") and (p / CONFIG_NAME).is_file()]
    for candidates, marker in ((new, STATE_NAME), (old, CONFIG_NAME)):
        if candidates:
            chosen = max(candidates, key=lambda p: (p / marker).stat().st_mtime)
            warnings.warn(f"{folder} is missing (a save was interrupted); loading {chosen.name} instead. The next "
                          "save_pretrained puts the folder back.", stacklevel=4)
            return chosen
    return folder


__all__ = ["STATE_NAME", "STATE_VERSION", "TENSORS_NAME", "WEIGHTS_NAME", "load_adapter", "lora_keys",
           "save_adapter"]
