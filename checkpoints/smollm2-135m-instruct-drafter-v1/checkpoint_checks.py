# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Checks a checkpoint folder must pass before its weights are loaded: refuse, never load half.

One checker for every loader: `AdaFlashDrafterModel.from_pretrained`, `AdaFlashLengthHead.from_pretrained`, the
`adaflash-hf` command line (`--drafter`, `--length-head`) and `python -m adaflash_hf.interop inspect` all call
`read_pretrained_folder`, which reads only `config.json` and the safetensors headers (a few kilobytes):

- `config.json` exists, is a JSON object, has the loader's `model_type` and every field the weights depend on
  (`required_fields`: a default standing in for a missing value, e.g. `block_size` 16 for a drafter trained with
  8, would load the weights wrongly without a word);
- every weights file is safetensors (pickle is refused: unpickling can run arbitrary code), and not truncated or
  corrupt: a safetensors file is `[8-byte little-endian header length N][N bytes of JSON header][data]`, the header
  mapping each tensor to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data section);
- the stored tensors are exactly those the config implies, with the implied shapes (`check_tensors`).

Every refusal is one `CheckpointError` (a `ValueError`) whose one-line message names the file and the field or
tensor. Pickle refusals are `PickleWeightsError`, also an `OSError` (what transformers raises for missing weights).

Self-contained (standard library; torch lazily): this file is copied next to the drafter and length head
checkpoints (`auto_map`), and `models/length_head/checkpoint_checks.py` is a byte copy of it.
"""

import copy
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or exported (one-line message naming the file and the problem)."""


class PickleWeightsError(CheckpointError, OSError):
    """Pickle-based weights were refused (an `OSError` too, as transformers' error for absent weights)."""


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
_SHOWN = 6  # tensor names listed in one message before "(+N more)"


def pickle_message(files) -> str:
    names = ", ".join(str(f) for f in files)
    return (
        f"refusing to load pickle-based weights ({names}): unpickling can run arbitrary code. Only safetensors "
        "checkpoints are loaded; convert them first in a trusted environment, e.g. "
        "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')`."
    )


def _names(names) -> str:
    names = list(names)
    return str(names[:_SHOWN]) + (f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


# ------------------------------------------------------------------------------------------------ config.json
def read_config_file(folder, model_type: str, required_fields=()) -> dict:
    """The `config.json` of `folder` as a dict, refused (`CheckpointError`) when absent, empty, not a JSON object,
    of another `model_type`, or missing one of `required_fields` (a `null` value is a value: it is not missing)."""
    folder = Path(folder)
    file = folder / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file (a checkpoint folder holds {CONFIG_NAME} and its weights).")
    text = file.read_text(encoding="utf-8")
    if not text.strip():
        raise CheckpointError(f"{file}: empty file (expected a JSON object with model_type {model_type!r}).")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: not a JSON object.")
    if raw.get("model_type") != model_type:
        found = f"model_type {raw['model_type']!r}" if "model_type" in raw else "no 'model_type' field"
        raise CheckpointError(f"{file}: {found}, expected {model_type!r} (this folder does not hold that model).")
    missing = [name for name in required_fields if name not in raw]
    if missing:
        raise CheckpointError(
            f"{file}: missing required field(s) {missing}: the weights depend on them and a default would load them "
            "wrongly; write the values they were trained with."
        )
    return raw


# ------------------------------------------------------------------------------------------------ weights files
@dataclass(frozen=True)
class TensorInfo:
    """One tensor as declared by a safetensors header: `dtype` (e.g. "BF16"), `shape`, and the file holding it."""

    dtype: str
    shape: tuple[int, ...]
    file: Path


def read_safetensors_header(path) -> dict[str, TensorInfo]:
    """Parse and check the header of one safetensors file (reads only the header).

    Raises `CheckpointError` if the file is not a safetensors file, is truncated (a tensor's bytes lie past the
    end of the file), or declares inconsistent tensors (byte size != numel * itemsize, overlapping or unknown dtype).
    """
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise PickleWeightsError(pickle_message([path]))
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes; the header length alone is 8).")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file (declares a {header_len}-byte header, the file has "
                f"{size} bytes)."
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object).")
    data_size = size - 8 - header_len
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}.") from None
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}.")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end or end - begin != numel * _ITEMSIZE[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name!r} {dtype}{list(shape)} declares bytes [{begin}, {end}), which is not "
                f"{numel * _ITEMSIZE[dtype]} bytes (corrupt header)."
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated file: tensor {name!r} needs data bytes up to {end} but the file holds only "
                f"{data_size} data bytes ({size} bytes in all). Download or copy it again."
            )
        tensors[name] = TensorInfo(dtype, shape, path)
        spans.append((begin, end))
    spans.sort()
    for (_, e1), (b2, _) in zip(spans, spans[1:]):
        if b2 < e1:
            raise CheckpointError(f"{path}: corrupt safetensors file (tensor data regions overlap).")
    if spans and spans[-1][1] != data_size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file ({data_size} data bytes, tensors cover {spans[-1][1]})."
        )
    return tensors


def find_weight_files(folder) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded via `model.safetensors.index.json` or not).

    Refuses (`CheckpointError`) a folder whose only weights are pickle files, or one with no weights at all.
    """
    folder = Path(folder)
    if folder.is_file():
        raise CheckpointError(f"{folder}: expected a checkpoint folder (config.json + *.safetensors), got a file.")
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [folder / name for name in sorted(set(weight_map.values()))]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e!r}).") from None
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PickleWeightsError(pickle_message(pickles))
    raise CheckpointError(f"{folder}: no *.safetensors weights found.")


def read_checkpoint_tensors(folder) -> dict[str, TensorInfo]:
    """Headers of every weight file of `folder`, merged (a tensor stored twice is refused)."""
    tensors: dict[str, TensorInfo] = {}
    for file in find_weight_files(folder):
        for name, info in read_safetensors_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is stored twice: in {tensors[name].file} and in {file}.")
            tensors[name] = info
    return tensors


def check_tensors(found: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], what: str,
                  problems=()) -> None:
    """Refuse, in one error, every missing, unexpected or wrongly shaped tensor (`expected`: name -> shape), after
    the `problems` already found by the caller."""
    problems = list(problems)
    files = ", ".join(sorted({str(info.file) for info in found.values()})) or "the weights"
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {_names(missing)} (not in {files})")
    if unexpected:
        problems.append(f"unexpected tensors {_names(unexpected)} (in "
                        f"{', '.join(sorted({str(found[n].file) for n in unexpected}))})")
    for name in sorted(set(found) & set(expected)):
        if tuple(found[name].shape) != tuple(expected[name]):
            problems.append(
                f"{name} has shape {list(found[name].shape)} in {found[name].file}, the config implies "
                f"{list(expected[name])}"
            )
    if problems:
        raise CheckpointError(f"{what}: the weights do not match the config: " + "; ".join(problems) + ".")


# ------------------------------------------------------------------------------------------------ loaders
def local_folder(path, subfolder: str = "") -> str | None:
    """`path/subfolder` when it is a local folder, else None (a Hub repository id)."""
    folder = os.path.join(str(path), subfolder or "")
    return folder if os.path.isdir(folder) else None


def expected_shapes(model_cls, config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of `model_cls(config)`'s saved state (built on the meta device: nothing allocated)."""
    import torch

    with torch.device("meta"):
        model = model_cls(copy.deepcopy(config))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def read_pretrained_folder(model_cls, folder, required_fields=(), config=None):
    """`(config, tensors, expected)` of a checkpoint folder, checked without loading a weight.

    Checks `config.json` (`read_config_file`) and the safetensors headers (`read_checkpoint_tensors`), then builds
    the config (`config` when one is given, as `from_pretrained(..., config=...)` would use it) and the tensor
    shapes it implies. The caller compares the two with `check_tensors`. Raises `CheckpointError`.
    """
    config_folder = config if isinstance(config, (str, os.PathLike)) else folder
    raw = read_config_file(config_folder, model_cls.config_class.model_type, required_fields)
    tensors = read_checkpoint_tensors(folder)
    if config is None or isinstance(config, (str, os.PathLike)):
        try:
            config = model_cls.config_class.from_dict(raw)
        except Exception as e:  # noqa: BLE001 - strict validation of the fields' types and values (not ValueError)
            message = " ".join(str(e).split())
            raise CheckpointError(f"{Path(config_folder) / CONFIG_NAME}: invalid config: {message}") from None
    return config, tensors, expected_shapes(model_cls, config)


def refuse_explicit_pickle_file(path, subfolder: str, config) -> None:
    """A config's `transformers_weights` names the weights file and bypasses `use_safetensors`: refuse pickle."""
    name = None
    if config is not None and not isinstance(config, (str, os.PathLike)):
        name = getattr(config, "transformers_weights", None)
    folder = local_folder(path, subfolder)
    if name is None and folder is not None and os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        try:
            with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = None  # reported by `read_config_file`
        name = raw.get("transformers_weights") if isinstance(raw, dict) else None
    if name is not None and not str(name).endswith((".safetensors", ".safetensors.index.json")):
        raise PickleWeightsError(pickle_message([os.path.join(folder or str(path), str(name))]))


def safetensors_only_error(path, subfolder: str, error: OSError) -> OSError:
    """Our message when transformers found no safetensors weights (pickle files named); else `error` itself."""
    folder = local_folder(path, subfolder)
    if folder is not None:
        files = sorted(os.listdir(folder))
        if any(f.endswith((".safetensors", ".safetensors.index.json")) for f in files):
            return error
        pickles = [os.path.join(folder, f) for f in files if f.endswith(PICKLE_SUFFIXES)]
        return PickleWeightsError(pickle_message(pickles)) if pickles else error
    if "safetensors" in str(error):
        return OSError(f"{error} Only safetensors weights are loaded: " + pickle_message([path]))
    return error


def weights_file(path, subfolder: str, tensor: str) -> str:
    """The file a tensor was read from, for error messages (the repo id / folder when it cannot be told)."""
    folder = local_folder(path, subfolder)
    if folder is None:
        return f"{path}/{subfolder}".rstrip("/")
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                return os.path.join(folder, json.load(f)["weight_map"].get(tensor, os.path.basename(index)))
        except (OSError, ValueError, KeyError, TypeError):
            return index
    return os.path.join(folder, "model.safetensors")


def loaded_weight_problems(model, info: dict, where, skip=()) -> list[str]:
    """What a finished load left wrong: tensors transformers reported missing, unexpected or mismatched (outside
    `skip`), and floating-point weights that are not finite. `where(name)` names the file of a tensor."""
    problems = []
    for kind in ("missing", "unexpected", "mismatched"):
        names = sorted({k[0] if isinstance(k, (tuple, list)) else k for k in info.get(f"{kind}_keys") or ()})
        names = [n for n in names if n not in skip]
        if names:
            problems.append(f"{where(names[0])}: {kind} tensors {_names(names)}")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor is None or not tensor.is_floating_point() or tensor.device.type == "meta":
            continue
        finite = tensor.detach().isfinite()
        if not bool(finite.all()):
            problems.append(f"{where(name)}: tensor {name!r} has non-finite values "
                            f"({int((~finite).sum())} of {tensor.numel()})")
    return problems


__all__ = [
    "CheckpointError",
    "PickleWeightsError",
    "TensorInfo",
    "check_tensors",
    "expected_shapes",
    "find_weight_files",
    "loaded_weight_problems",
    "read_checkpoint_tensors",
    "read_config_file",
    "read_pretrained_folder",
    "read_safetensors_header",
]
