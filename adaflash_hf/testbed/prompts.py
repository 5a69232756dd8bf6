"""Prompt sets of the testbed: four domains, a fixed train/eval split, JSONL input and output.

Records are ``{"prompt": str, "domain": str, "source": str, "id": str}`` dicts built by the sources
in :mod:`adaflash_hf.testbed.sources` and cached as one JSONL file per source under
``<cache>/prompts/v1/``.

The split is a pure function of a record's ``source`` and ``id`` (:func:`split_of`: a sha1 bucket
below :data:`EVAL_PERCENT` means eval), so adding sources or records never moves an existing record
between train and eval. Each source contributes at most :data:`EVAL_MAX_PER_SOURCE` eval records
(those with the smallest hashes); eval records beyond that cap are dropped, never used for training.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import time
from pathlib import Path
from typing import Iterable, Sequence

from ..utils.prompts import encode_prompt  # noqa: F401  (re-exported: the testbed's prompts are encoded so)
from .cache import atomic_file, cache_dir, file_lock, logger
from .sources import PromptSource, default_sources


DOMAINS = ("code", "math", "chat", "prose")
"""The four prompt domains of the testbed."""
SPLITS = ("train", "eval")
EVAL_PERCENT = 10
"""A record is in the eval split iff ``sha1(source/id) mod 100 < EVAL_PERCENT``."""
EVAL_MAX_PER_SOURCE = 200
"""Cap on eval records per source (keeps large sources from dominating the eval set)."""
PROMPTS_FORMAT_VERSION = 1
REQUIRED_FIELDS = ("prompt", "domain")


def _hash_int(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16)


def split_of(source: str, record_id: str) -> str:
    """Return ``"eval"`` or ``"train"`` for a record; depends on nothing but ``source`` and ``id``."""
    return "eval" if _hash_int(f"{source}/{record_id}") % 100 < EVAL_PERCENT else "train"


def _check_record(record: object, where: str) -> dict:
    """Validate one record; raise a ``ValueError`` that starts with ``where``."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in REQUIRED_FIELDS:
        if field not in record:
            raise ValueError(f"{where}: missing required field {field!r}")
        if not isinstance(record[field], str) or not record[field].strip():
            raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {record[field]!r}")
    for field in ("source", "id"):
        if field in record and not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {record[field]!r}")
    return record


def read_prompts_jsonl(path: str | Path) -> list[dict]:
    """Read prompt records from a JSONL file (one JSON object per line, blank lines skipped).

    Every record needs non-empty string fields ``prompt`` and ``domain``; ``source`` and ``id``
    default to the file stem and the line number. Extra fields are kept.

    Raises:
        ValueError: on invalid JSON or a bad record, naming the file and line.
    """
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error.msg})") from None
            record = _check_record(record, where)
            record.setdefault("source", path.stem)
            record.setdefault("id", str(lineno))
            records.append(record)
    return records


def _dump_jsonl(path: Path, records: Iterable[dict]) -> int:
    count = 0
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for count, record in enumerate(records, start=1):
            _check_record(record, f"record {count}")
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return count


def load_source_records(source: PromptSource) -> list[dict]:
    """All records of one source, from its cached JSONL (built and cached on first use)."""
    path = cache_dir() / "prompts" / f"v{PROMPTS_FORMAT_VERSION}" / f"{source.cache_name}.jsonl"
    if not path.is_file():
        with file_lock(path.with_name(f".{path.name}.lock")):
            if not path.is_file():
                start = time.perf_counter()
                logger.info("Building %s prompts (%s) ...", source.name, source.domain)
                count = _dump_jsonl(path, source.build())
                logger.info("Built %d %s prompts in %.1f s.", count, source.name, time.perf_counter() - start)
    return read_prompts_jsonl(path)


def _resolve(
    sources: Sequence[PromptSource] | None, domains: Iterable[str] | None
) -> tuple[list[PromptSource], list[str]]:
    """Available sources of the requested domains, and those domains in canonical order."""
    sources = [s for s in (default_sources() if sources is None else sources) if s.available()]
    present = {s.domain for s in sources}
    known = [d for d in DOMAINS if d in present] + sorted(present - set(DOMAINS))
    if domains is None:
        return sources, known
    domains = [domains] if isinstance(domains, str) else list(domains)
    unknown = [d for d in domains if d not in known]
    if unknown:
        raise ValueError(f"Unknown domain(s) {unknown}; available: {known}")
    return [s for s in sources if s.domain in domains], [d for d in known if d in domains]


def _split_records(records: list[dict], split: str) -> list[dict]:
    """Records of one source in ``split``, applying the per-source eval cap."""
    chosen = [r for r in records if split_of(r["source"], r["id"]) == split]
    if split == "eval":
        chosen.sort(key=lambda r: _hash_int(f"{r['source']}/{r['id']}"))
        chosen = chosen[:EVAL_MAX_PER_SOURCE]
    return chosen


def _round_robin(columns: list[list[dict]]) -> list[dict]:
    """Interleave lists: first items of each, then second items, ... (exhausted lists drop out)."""
    merged = []
    for row in range(max((len(column) for column in columns), default=0)):
        merged.extend(column[row] for column in columns if row < len(column))
    return merged


def load_prompts(
    split: str = "eval",
    domains: Iterable[str] | None = None,
    max_per_domain: int | None = None,
    seed: int = 0,
    *,
    sources: Sequence[PromptSource] | None = None,
) -> list[dict]:
    """Return the prompt records of one split, building and caching the prompt sets if needed.

    Args:
        split: ``"eval"`` or ``"train"``; the two never share a record.
        domains: domains to include (default: all of :data:`DOMAINS` that have a source).
        max_per_domain: keep at most this many records per domain.
        seed: picks the (deterministic) order within each domain, hence which records a
            ``max_per_domain`` cap keeps. The same arguments always give the same list.
        sources: prompt sources to use (default: :func:`~adaflash_hf.testbed.sources.default_sources`).

    Returns:
        Records ``{"prompt", "domain", "source", "id"}``. Within a domain the sources are interleaved
        round-robin (each in a seed-dependent hash order) before the ``max_per_domain`` cap, so
        small real sources are not drowned by large ones; the domains are then interleaved
        round-robin too (code, math, chat, prose, code, ...), so any prefix is balanced.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if max_per_domain is not None and max_per_domain < 0:
        raise ValueError(f"max_per_domain must be >= 0, got {max_per_domain}")
    sources, domains = _resolve(sources, domains)
    per_domain: dict[str, list[list[dict]]] = {domain: [] for domain in domains}
    for source in sources:
        records = _split_records(load_source_records(source), split)
        records.sort(key=lambda r: _hash_int(f"{seed}/{r['source']}/{r['id']}"))
        per_domain[source.domain].append(records)
    columns = []
    for domain in domains:
        records = _round_robin(per_domain[domain])
        columns.append(records[:max_per_domain] if max_per_domain is not None else records)
    return _round_robin(columns)


def write_prompts_jsonl(
    path: str | Path,
    split: str = "eval",
    *,
    records: Iterable[dict] | None = None,
    domains: Iterable[str] | None = None,
    max_per_domain: int | None = None,
    seed: int = 0,
) -> int:
    """Write prompt records to a JSONL file (atomically) and return how many were written.

    Writes ``records`` if given, else ``load_prompts(split, domains, max_per_domain, seed)``.
    """
    if records is None:
        records = load_prompts(split, domains=domains, max_per_domain=max_per_domain, seed=seed)
    return _dump_jsonl(Path(path), records)


def default_eval_prompts() -> list[dict]:
    """The small fixed held-out set shipped with the package (12 eval prompts per domain).

    It needs no download. It was generated with
    ``python -m adaflash_hf.testbed prompts --split eval --max-per-domain 12 --out <file>``.
    """
    resource = importlib.resources.files("adaflash_hf.testbed").joinpath("data/eval_prompts.jsonl")
    with importlib.resources.as_file(resource) as path:
        return read_prompts_jsonl(path)


def prompt_counts(sources: Sequence[PromptSource] | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """Counts ``{split: {domain: {source: n}}}`` of the full prompt sets (builds them if needed)."""
    counts: dict[str, dict[str, dict[str, int]]] = {split: {} for split in SPLITS}
    for source in _resolve(sources, None)[0]:
        records = load_source_records(source)
        for split in SPLITS:
            domain = counts[split].setdefault(source.domain, {})
            domain[source.name] = len(_split_records(records, split))
    return counts
