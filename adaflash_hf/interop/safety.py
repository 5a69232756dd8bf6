# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Safe reading of foreign checkpoints: safetensors only, headers checked before any tensor is read.

A safetensors file is `[8-byte little-endian header length N][N bytes of JSON header][data]`; the header maps each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data section). Reading the
header costs a few kilobytes, so a truncated or corrupt file, or one whose tensors do not match the config, is
refused with an error naming the file before anything big is allocated. Pickle-based weights (`*.bin`, `*.pt`,
...) are never opened: unpickling can run arbitrary code.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or exported (message names the file and the problem)."""


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_INDEX = "model.safetensors.index.json"
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


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
        raise CheckpointError(_pickle_message([path]))
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


def _pickle_message(files) -> str:
    names = ", ".join(str(f) for f in files)
    return (
        f"refusing to load pickle-based weights ({names}): unpickling can run arbitrary code. Only safetensors "
        "checkpoints are loaded; convert them first in a trusted environment, e.g. "
        "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')`."
    )


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
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e!r}).") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(_pickle_message(pickles))
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


def check_tensors(found: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Refuse, in one error, every missing, unexpected or wrongly shaped tensor (`expected`: name -> shape)."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        files = sorted({str(found[n].file) for n in unexpected})
        problems.append(f"unexpected tensors {unexpected} (in {', '.join(files)})")
    for name in sorted(set(found) & set(expected)):
        if tuple(found[name].shape) != tuple(expected[name]):
            problems.append(
                f"{name} has shape {list(found[name].shape)} in {found[name].file}, the config implies "
                f"{list(expected[name])}"
            )
    if problems:
        raise CheckpointError(f"{what}: the weights do not match the config: " + "; ".join(problems) + ".")


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
    "CheckpointError",
    "TensorInfo",
    "check_tensors",
    "find_weight_files",
    "load_tensors",
    "read_checkpoint_tensors",
    "read_safetensors_header",
]
