# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Checked command-line inputs, as argparse `type=` callables: bad input fails early, in one line.

argparse calls a `type=` callable while it parses the command line, i.e. before anything is loaded. On bad input
these print ONE line on stderr, `adaflash-hf: error: --FLAG 'VALUE': what is wrong`, and exit with status 2
(argparse's status for usage errors; argparse's own error report would print the whole usage first). The checks
themselves are plain functions that raise `ValueError` (`parse_positive_int`, `parse_positive_int_list`,
`read_prompt_records`, `parse_choice_list`), usable without argparse.

Parser hooks:

    --prompts FILE         type=prompts_file              JSONL of {"prompt", "domain"} records; returns the Path
    --concurrency 1,4,16   type=concurrency_levels        positive integers; returns the canonical "1,4,16"
    --max-new-tokens N     type=positive_int("--max-new-tokens")
    --drafter DIR          type=drafter_dir("--drafter")      a drafter checkpoint that passes the loader's checks
    --length-head DIR      type=length_head_dir("--length-head")  the same for a length head
    --drafters A,B         type=drafter_dir_list("--drafters")
    --algorithms a,b       type=choice_list("--algorithms", CHOICES)
    --cost-model FILE      type=cost_model_file        a saved TargetCostModel JSON, or the name of a shipped one
                                                       (adaflash_hf/cost_models/NAME.json); returns the Path

The checkpoint hooks run `check_pretrained` of the model class, the check `from_pretrained` runs first (required
config.json fields, truncated or corrupt weights, missing or mis-shaped tensors): a bad checkpoint is one line naming
the file and the field or tensor, before the target loads. `fail_on_load_error` does the same for what only loading
can tell (e.g. non-finite weights, a drafter that does not match the target). Everything else here is standard
library only; the checkpoint hooks import the models when called.
"""

import json
import sys
from pathlib import Path


PROG = "adaflash-hf"
PROMPT_FIELDS = ("prompt", "domain")  # what `adaflash_hf.testbed.read_prompts_jsonl` requires of a record


# ------------------------------------------------------------------------------------------------ plain checks
def parse_positive_int(text: str) -> int:
    """`"4"` -> 4; anything but an integer >= 1 is a `ValueError`."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError("not an integer") from None
    if value < 1:
        raise ValueError("must be a positive integer (>= 1)")
    return value


def parse_positive_int_list(text: str) -> list[int]:
    """`"1,4,16"` -> `[1, 4, 16]`: a non-empty comma-separated list of integers >= 1."""
    items = [item.strip() for item in str(text).split(",")]
    if not any(items):
        raise ValueError("expected a comma-separated list of positive integers, e.g. 1,4,16")
    values = []
    for item in items:
        if not item:
            raise ValueError("empty item in the comma-separated list")
        try:
            values.append(parse_positive_int(item))
        except ValueError as error:
            raise ValueError(f"{item!r} {error}") from None
    return values


def parse_choice_list(text: str, choices) -> list[str]:
    """`"a,b"` -> `["a", "b"]`, each one of `choices` (a non-empty list)."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    unknown = [item for item in items if item not in choices]
    if not items or unknown:
        raise ValueError(f"unknown {unknown}; choose from {', '.join(choices)}" if unknown else "empty list")
    return items


def read_prompt_records(path) -> list[dict]:
    """The records of a prompts JSONL file: one JSON object per non-blank line, each with non-empty string
    `prompt` and `domain` (`source` and `id`, if present, strings); at least one. `ValueError` naming the line."""
    path = Path(path)
    if not path.exists():
        raise ValueError("no such file")
    if not path.is_file():
        raise ValueError("not a file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"cannot be read ({error.strerror or error})") from None
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"line {lineno}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"line {lineno}: expected a JSON object like {{\"prompt\": ..., \"domain\": ...}}, "
                             f"got {type(record).__name__}")
        for field in PROMPT_FIELDS:
            if field not in record:
                raise ValueError(f"line {lineno}: no {field!r} key")
            if not isinstance(record[field], str) or not record[field].strip():
                raise ValueError(f"line {lineno}: {field!r} must be a non-empty string, got {record[field]!r}")
        for field in ("source", "id"):
            if field in record and not isinstance(record[field], str):
                raise ValueError(f"line {lineno}: {field!r} must be a string, got {record[field]!r}")
        records.append(record)
    if not records:
        raise ValueError('no prompts in the file (expected JSONL lines like {"prompt": "...", "domain": "code"})')
    return records


# ------------------------------------------------------------------------------------------------ argparse hooks
def fail(flag: str, value, problem: str):
    """Print `adaflash-hf: error: FLAG 'VALUE': PROBLEM` on stderr and exit with status 2."""
    print(f"{PROG}: error: {flag} {str(value)!r}: {problem}", file=sys.stderr)
    raise SystemExit(2)


def prompts_file(text: str) -> Path:
    """`--prompts FILE`: the whole file is read and checked now; returns its `Path`."""
    try:
        read_prompt_records(text)
    except ValueError as error:
        fail("--prompts", text, str(error))
    return Path(text)


def concurrency_levels(text: str) -> str:
    """`--concurrency 1,4,16`: returns the checked levels as the comma-separated text the bench splits."""
    try:
        return ",".join(str(v) for v in parse_positive_int_list(text))
    except ValueError as error:
        fail("--concurrency", text, str(error))


def positive_int(flag: str):
    """`type=positive_int("--max-new-tokens")`: an integer >= 1."""

    def check(text: str) -> int:
        try:
            return parse_positive_int(text)
        except ValueError as error:
            fail(flag, text, str(error))

    check.__name__ = "positive_int"
    return check


def existing_dir(flag: str):
    """`type=existing_dir("--drafter")`: a folder that exists; returns the text as given."""

    def check(text: str) -> str:
        if not Path(text).is_dir():
            fail(flag, text, "no such folder" if not Path(text).exists() else "not a folder")
        return text

    check.__name__ = "existing_dir"
    return check


def existing_dir_list(flag: str):
    """`type=existing_dir_list("--drafters")`: comma-separated folders that all exist; returns the list of texts."""

    def check(text: str) -> list[str]:
        folders = [part.strip() for part in text.split(",") if part.strip()]
        if not folders:
            fail(flag, text, "expected comma-separated folders")
        missing = [f for f in folders if not Path(f).is_dir()]
        if missing:
            fail(flag, text, "no such folder: " + ", ".join(missing))
        return folders

    check.__name__ = "existing_dir_list"
    return check


def _check_checkpoint(flag: str, text: str, kind: str) -> None:
    if not Path(text).is_dir():
        fail(flag, text, "no such folder" if not Path(text).exists() else "not a folder")
    from ..models import AdaFlashDrafterModel, AdaFlashLengthHead

    model_cls = AdaFlashDrafterModel if kind == "drafter" else AdaFlashLengthHead
    try:
        model_cls.check_pretrained(text)
    except (ValueError, OSError) as error:
        fail(flag, text, " ".join(str(error).split()))


def drafter_dir(flag: str):
    """`type=drafter_dir("--drafter")`: a drafter checkpoint folder that passes `check_pretrained`; returns the
    text as given."""

    def check(text: str) -> str:
        _check_checkpoint(flag, text, "drafter")
        return text

    check.__name__ = "drafter_dir"
    return check


def length_head_dir(flag: str):
    """`type=length_head_dir("--length-head")`: a length head checkpoint folder that passes `check_pretrained`."""

    def check(text: str) -> str:
        _check_checkpoint(flag, text, "length_head")
        return text

    check.__name__ = "length_head_dir"
    return check


def drafter_dir_list(flag: str):
    """`type=drafter_dir_list("--drafters")`: comma-separated drafter folders, each passing `check_pretrained`."""

    def check(text: str) -> list[str]:
        folders = existing_dir_list(flag)(text)
        for folder in folders:
            _check_checkpoint(flag, folder, "drafter")
        return folders

    check.__name__ = "drafter_dir_list"
    return check


def cost_model_file(text: str) -> Path:
    """`--cost-model FILE`: a `TargetCostModel` JSON that loads and has points, or the name of a shipped one
    (`h200-smollm2-135m`); returns its `Path`."""
    path = Path(text)
    shipped = Path(__file__).resolve().parent.parent / "cost_models"
    if not path.exists() and (shipped / f"{text}.json").is_file():
        path = shipped / f"{text}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in shipped.glob("*.json")))
        fail("--cost-model", text, f"no such file (shipped cost models: {names or 'none'})")
    from ..generation.cost_model import TargetCostModel

    try:
        cost = TargetCostModel.load(path)
        cost.seconds(1, 1)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as error:
        fail("--cost-model", text, f"not a cost model JSON ({type(error).__name__}: {error})")
    return path


def fail_on_load_error(load, *args, **kwargs):
    """`load(*args, **kwargs)`, but a checkpoint refused while loading (`ValueError` / `OSError`, whose message
    names the file) prints `adaflash-hf: error: MESSAGE` on stderr and exits with status 2, without a traceback."""
    try:
        return load(*args, **kwargs)
    except (ValueError, OSError) as error:
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from None


def choice_list(flag: str, choices):
    """`type=choice_list("--algorithms", CHOICES)`: comma-separated names from `choices`; returns "a,b"."""

    def check(text: str) -> str:
        try:
            return ",".join(parse_choice_list(text, tuple(choices)))
        except ValueError as error:
            fail(flag, text, str(error))

    check.__name__ = "choice_list"
    return check


__all__ = [
    "choice_list",
    "concurrency_levels",
    "cost_model_file",
    "drafter_dir",
    "drafter_dir_list",
    "existing_dir",
    "existing_dir_list",
    "fail",
    "fail_on_load_error",
    "length_head_dir",
    "parse_choice_list",
    "parse_positive_int",
    "parse_positive_int_list",
    "positive_int",
    "prompts_file",
    "read_prompt_records",
]
