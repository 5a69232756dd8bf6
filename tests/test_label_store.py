"""The target-label store (`training/label_store.py`) and the testbed corpus's eval hold-out (`testbed/corpus.py`)."""

import ast
import json

import numpy as np
import pytest
import torch

from adaflash_hf.testbed import split_of
from adaflash_hf.training import DrafterDataCollator, record_targets
from adaflash_hf.testbed.corpus import (
    _window_end,
    chunk_documents,
    cut_eval_functions,
    cut_eval_passages,
    cut_matching_functions,
    eval_function_signatures,
    filter_sharegpt,
)
from adaflash_hf.training.label_hidden import build_label_dataset, hidden_cache_dir
from adaflash_hf.training.label_store import (
    CORPUS_PROMPT_LEN,
    LabelStore,
    corpus_key,
    response_key,
    response_settings,
    select_entries,
    target_key,
)

from .conftest import VOCAB, make_tiny_target


LAYERS = [0, 2]


class FakeTokenizer:
    """Characters -> ids 3..92 (fits the tiny vocab); no chat template, so prompts are encoded as plain text."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def apply_chat_template(self, messages, tokenize=True, return_dict=False, add_generation_prompt=False):
        ids = []
        for message in messages:
            ids += [1] + self(f"{message['role']}:{message['content']}")["input_ids"] + [2]
        return ids


def prompts(n, start=0):
    return [{"prompt": f"prompt number {i} " + "x" * (i % 5), "domain": ["code", "chat"][i % 2], "source": "fake",
             "id": str(i)} for i in range(start, start + n)]


def random_chunks(n, length=40, seed=0, domain="prose"):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (length - i % 7,), generator=g).tolist(), "domain": domain,
             "source": "fake-corpus", "doc": f"d{i}", "part": 0} for i in range(n)]


@pytest.fixture
def stores(tmp_path):
    responses = LabelStore.open("tiny", torch.bfloat16, vocab_size=VOCAB, root=tmp_path)
    corpus = LabelStore.open("tiny", torch.float32, vocab_size=VOCAB, root=tmp_path)
    return responses, corpus


# ------------------------------------------------------------------------------------------------ keys and layout
def test_keys_are_stable_and_name_what_determines_them(tmp_path):
    settings = response_settings(16)
    assert response_key("hello", settings) == response_key("hello", response_settings(16))
    assert response_key("hello", settings) != response_key("hello", response_settings(17))
    assert response_key("hello", settings) != response_key("hello!", settings)
    assert corpus_key([5, 6, 7]) == corpus_key(np.array([5, 6, 7], dtype=np.int32))
    assert corpus_key([5, 6, 7]) != corpus_key([5, 6])
    assert response_key("hello", settings) == "rd5714b1dbe957c78"  # pinned: stores written earlier stay valid
    assert corpus_key([5, 6, 7]) == "c4870d5b8af9f11ca"
    assert target_key("testbed:SmolLM2-135M-Instruct", torch.float32).startswith("testbed-SmolLM2-135M-Instruct-fp32-")
    assert target_key("a/b", "bfloat16") != target_key("a:b", "bfloat16")  # the name's hash separates slugs
    store = LabelStore.open("tiny", torch.float32, vocab_size=VOCAB, root=tmp_path)
    assert store.path == tmp_path / target_key("tiny", torch.float32)
    assert store.meta["token_dtype"] == "uint16"
    assert LabelStore.open("big", torch.float32, vocab_size=70_000, root=tmp_path).meta["token_dtype"] == "int32"
    reopened = LabelStore(store.path)
    assert reopened.meta == store.meta
    with pytest.raises(FileNotFoundError):
        LabelStore(tmp_path / "missing")


# ------------------------------------------------------------------------------------------------ responses
def test_responses_are_greedy_and_resumable(stores):
    target, (store, _) = make_tiny_target(), stores
    tok = FakeTokenizer()
    first = store.add_responses(target, tok, prompts(4), max_new_tokens=6, batch_size=2, progress=False)
    assert first["sequences"] == 4 and first["new_tokens"] == 24
    again = store.add_responses(target, tok, prompts(6), max_new_tokens=6, batch_size=2, progress=False)
    assert again["sequences"] == 2, "a second run adds only the missing entries"
    entries = store.entries("responses")
    assert len(entries) == 6 and len(store.keys("responses")) == 6
    settings = response_settings(6)
    by_key = {e["key"]: e for e in entries}
    for record in prompts(6):
        entry = by_key[response_key(record["prompt"], settings)]
        ids = store.read("responses", entry)["input_ids"]
        prompt_ids = tok(record["prompt"])["input_ids"]
        assert entry["prompt_len"] == len(prompt_ids) and list(ids[: len(prompt_ids)]) == prompt_ids
        assert len(ids) == len(prompt_ids) + 6 and entry["domain"] == record["domain"]
        assert (entry["source"], entry["id"]) == ("fake", record["id"])
        with torch.no_grad():  # the response is the target's greedy path
            argmax = target(torch.as_tensor(ids)[None]).logits.argmax(-1)[0]
        assert argmax[len(prompt_ids) - 1 : -1].tolist() == ids[len(prompt_ids):].tolist()
    # other settings are other entries; the summary counts kinds and domains
    assert store.add_responses(target, tok, prompts(1), max_new_tokens=3, progress=False)["sequences"] == 1
    summary = store.summary()["responses"]
    assert sum(d["sequences"] for d in summary.values()) == 7 and set(summary) == {"code", "chat"}


def test_eval_split_prompts_are_refused(stores):
    store, _ = stores
    eval_id = next(f"HumanEval/{i}" for i in range(164) if split_of("human-eval", f"HumanEval/{i}") == "eval")
    record = {"prompt": "p", "domain": "code", "source": "human-eval", "id": eval_id}
    with pytest.raises(ValueError, match="EVAL split"):
        store.add_responses(make_tiny_target(), FakeTokenizer(), [record], max_new_tokens=2, progress=False)
    assert store.entries("responses") == []


# ------------------------------------------------------------------------------------------------ corpus
def test_corpus_labels_are_the_target_argmax_and_resumable(stores):
    target, (_, store) = make_tiny_target(), stores
    chunks = random_chunks(10)
    iterator = iter(chunks)
    first = store.add_corpus(target, iterator, max_tokens=100, batch_size=3, progress=False)
    assert first["sequences"] == 3 and not first["exhausted"], "stops after the batch that reaches the budget"
    rest = store.add_corpus(target, iterator, batch_size=3, progress=False)  # the shared iterator continues
    assert rest["exhausted"] and first["sequences"] + rest["sequences"] == 10
    assert store.add_corpus(target, chunks, progress=False)["sequences"] == 0, "nothing left to label"
    for entry, data in store.iter_read("corpus"):
        with torch.no_grad():
            argmax = target(torch.as_tensor(data["input_ids"])[None]).logits.argmax(-1)[0].numpy()
        assert entry["key"] == corpus_key(data["input_ids"])
        np.testing.assert_array_equal(data["labels"], argmax)
    assert [e["doc"] for e in store.entries("corpus")] == [c["doc"] for c in chunks]


def test_a_killed_append_loses_only_its_batch(stores):
    target, (_, store) = make_tiny_target(), stores
    store.add_corpus(target, random_chunks(4), batch_size=2, progress=False)
    before = [(e["key"], store.read("corpus", e)["labels"].tolist()) for e in store.entries("corpus")]
    with open(store.path / "corpus.bin", "ab") as handle:  # torn tokens and a torn index line of a killed job
        handle.write(b"\x01\x02\x03")
    with open(store.path / "corpus.jsonl", "a") as handle:
        handle.write('{"key": "cdeadbeef", "offset": 99')
    reopened = LabelStore(store.path)
    assert [e["key"] for e in reopened.entries("corpus")] == [k for k, _ in before]
    added = reopened.add_corpus(target, random_chunks(6), batch_size=2, progress=False)
    assert added["sequences"] == 2
    after = {e["key"]: store.read("corpus", e)["labels"].tolist() for e in LabelStore(store.path).entries("corpus")}
    assert len(after) == 6 and all(after[k] == labels for k, labels in before)


def test_one_writer_at_a_time(stores):
    _, store = stores
    other = LabelStore(store.path)
    with store.writing():
        with store.writing():  # re-entrant in one object
            pass
        with pytest.raises(RuntimeError, match="Another process"):
            with other.writing():
                pass
    with other.writing():
        pass


# ------------------------------------------------------------------------------------------------ dataset
def test_dataset_builder_columns_labels_and_incremental_cache(stores, tmp_path):
    target, (responses, corpus) = make_tiny_target(), stores
    tok = FakeTokenizer()
    responses.add_responses(target, tok, prompts(4), max_new_tokens=8, batch_size=4, progress=False)
    corpus.add_corpus(target, random_chunks(6, seed=1, domain="prose") + random_chunks(6, seed=2, domain="code"),
                      progress=False)
    selection = select_entries(responses, corpus, corpus_ratio=1.0)
    kinds = [kind for _, kind, _ in selection]
    response_tokens = sum(int(e["n"]) for _, kind, e in selection if kind == "responses")
    corpus_tokens = sum(int(e["n"]) for _, kind, e in selection if kind == "corpus")
    assert kinds.count("responses") == 4 and response_tokens <= corpus_tokens < response_tokens + 40
    assert {e["domain"] for _, kind, e in selection if kind == "corpus"} == {"prose", "code"}, "round robin"

    dataset = build_label_dataset(target, LAYERS, "tiny", selection, record_batch_size=3, shard_size=5,
                                  root=tmp_path, progress=False)
    assert len(dataset) == len(selection)
    width = len(LAYERS) * target.config.hidden_size
    sequences = []
    for row, (store, kind, entry) in zip(dataset, selection):
        data = store.read(kind, entry)
        assert row["input_ids"] == data["input_ids"].tolist() and row["domain"] == entry["domain"]
        assert np.asarray(row["hidden_states"]).shape == (entry["n"], width)
        if kind == "corpus":
            assert row["prompt_len"] == CORPUS_PROMPT_LEN
            assert row["target_argmax"] == data["labels"].tolist()
        else:
            assert row["prompt_len"] == entry["prompt_len"]
        sequences.append({"input_ids": row["input_ids"], "prompt_len": row["prompt_len"], "domain": row["domain"]})
    # `record_targets` fingerprints (pickles) its model, which fails on a model that already ran: a fresh copy
    reference = record_targets(make_tiny_target(), sequences, LAYERS, batch_size=2)
    assert dataset.features == reference.features
    reference = {tuple(ref["input_ids"]): ref for ref in reference}  # `record_targets` sorts by length
    for row in dataset:
        ref = reference[tuple(row["input_ids"])]
        assert row["target_argmax"] == ref["target_argmax"]
        np.testing.assert_allclose(np.asarray(row["hidden_states"], dtype=np.float32),
                                   np.asarray(ref["hidden_states"], dtype=np.float32), atol=2e-2, rtol=1e-2)

    # the collator consumes it; corpus chunks anchor from position 1
    collator = DrafterDataCollator(block_size=4, num_anchors=6, max_length=64, seed=0)
    batch = collator([dataset[i] for i in range(len(dataset)) if selection[i][1] == "corpus"][:2])
    assert batch["context"].shape[-1] == width and batch["label_mask"][:, :, 0].any()
    assert int(batch["anchors"][batch["anchor_valid"]].min()) >= 1

    # a larger selection records only the new entries; the cached ones are reused
    folder = hidden_cache_dir("tiny", target, LAYERS, tmp_path)
    shards = sorted(folder.glob("shard-*.arrow"))
    responses.add_responses(target, tok, prompts(2, start=4), max_new_tokens=8, progress=False)
    bigger = select_entries(responses, corpus, corpus_ratio=0.0)
    extended = build_label_dataset(target, LAYERS, "tiny", bigger, root=tmp_path, progress=False)
    new_shards = sorted(set(folder.glob("shard-*.arrow")) - set(shards))
    assert len(extended) == 6 and len(new_shards) == 1
    keys_file = new_shards[0].with_name(new_shards[0].name.replace(".arrow", ".keys.json"))
    assert len(json.loads(keys_file.read_text())) == 2
    assert extended[0]["target_argmax"] == dataset[0]["target_argmax"]
    only_prose = select_entries(None, corpus, domains=["prose"], max_corpus_tokens=50)
    assert {e["domain"] for *_, e in only_prose} == {"prose"} and 50 <= sum(e["n"] for *_, e in only_prose) < 90


def test_labels_from_another_model_are_caught(stores, tmp_path):
    _, corpus = stores
    corpus.add_corpus(make_tiny_target(seed=3), random_chunks(4), progress=False)
    with pytest.raises(AssertionError, match="disagree"):
        build_label_dataset(make_tiny_target(), LAYERS, "tiny", select_entries(None, corpus), root=tmp_path,
                            progress=False)


# ------------------------------------------------------------------------------------------------ eval hold-out
def test_stdlib_eval_functions_are_cut():
    names = [f"helper_{i}" for i in range(60)]
    doc = "Return a value computed from the arguments, documented at length for the prompt miner."
    template = "@staticmethod\ndef {n}(a, b):\n    \"\"\"{doc}\"\"\"\n    return a + b + {i}\n\n\n"
    source = "import os\n\n" + "".join(template.format(n=n, doc=doc, i=i) for i, n in enumerate(names))
    source += f"class Thing:\n    def method_a(self):\n        \"\"\"{doc}\"\"\"\n        return 1\n\n" \
              f"    def method_b(self):\n        \"\"\"{doc}\"\"\"\n        return 2\n"
    is_eval = {n for n in names + ["Thing.method_a", "Thing.method_b"]
               if split_of("python-stdlib", f"fakemod:{n}") == "eval"}
    assert 0 < len(is_eval) < len(names)
    cut = cut_eval_functions("fakemod", source)
    ast.parse(cut)
    for name in names:
        assert (f"def {name}(" in cut) == (name not in is_eval)
    for name in ("method_a", "method_b"):
        assert (f"def {name}(" in cut) == (f"Thing.{name}" not in is_eval)
    assert cut.count("@staticmethod") == len(names) - len(is_eval & set(names)), "decorators go with their function"
    # verbatim copies of an eval function (same name and docstring) are cut from any other file, at any depth
    signatures = eval_function_signatures({"fakemod": source})
    assert {name for name, _ in signatures} == {n.split(".")[-1] for n in is_eval}
    name = sorted(is_eval)[0].split(".")[-1]
    other = (f"class Copy:\n    def {name}(self):\n        \"\"\"{doc}\"\"\"\n        return 3\n\n"
             f"    def keep_me(self):\n        return 4\n\n\ndef {name}(x):\n    \"\"\"Another docstring.\"\"\"\n")
    cut_other = cut_matching_functions(other, signatures)
    assert "return 3" not in cut_other and "keep_me" in cut_other and "Another docstring" in cut_other


def test_sharegpt_eval_conversations_are_dropped():
    items, eval_bases, train_bases = [], [], []
    for i in range(80):
        base = f"conv{i}"
        (eval_bases if split_of("sharegpt", f"{base}_0") == "eval" else train_bases).append(base)
        for part in (0, 1):
            items.append({"id": f"{base}_{part}", "conversations": [
                {"from": "human", "value": f"question {i} part {part}"}, {"from": "gpt", "value": f"answer {i}"}]})
    assert eval_bases and train_bases
    leaked, longer = train_bases[0], train_bases[1]
    items[2 * int(longer[4:]) + 1]["conversations"][0]["value"] = "Please: eval   prompt text, and more"
    # an eval prompt's text reused in a train conversation, or inside a longer user turn
    eval_texts = {f"question {leaked[4:]} part 1", "eval prompt text,"}
    kept = {doc["doc"] for doc in filter_sharegpt(items, eval_texts)}
    assert not any(doc.rsplit("_", 1)[0] in eval_bases for doc in kept)
    assert f"{leaked}_0" in kept and f"{leaked}_1" not in kept
    assert f"{longer}_0" in kept and f"{longer}_1" not in kept
    assert all(f"{b}_0" in kept for b in train_bases if split_of("sharegpt", f"{b}_1") == "train")
    doc = next(filter_sharegpt(items, set()))
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"]


def test_shakespeare_eval_passages_are_cut():
    lines = []
    for speech in range(400):
        lines += [f"SPEAKER{speech % 7}. line a of speech {speech}", f"line b of speech {speech}",
                  f"line c of speech {speech}", ""]
    stride = 40
    eval_offsets = [o for o in range(stride, len(lines), stride) if split_of("shakespeare", f"play:{o}") == "eval"]
    assert eval_offsets
    pieces = cut_eval_passages(lines, "play", stride=stride)
    kept = {first + j for first, piece in pieces for j in range(len(piece))}
    for offset in eval_offsets:
        end = _window_end(lines, "play", offset)
        assert end > offset + 8
        assert not kept & set(range(offset, end + stride))
    assert len(kept) > len(lines) // 2
    assert all(piece == lines[first : first + len(piece)] for first, piece in pieces)


def test_chunk_documents_packs_and_splits_deterministically():
    tok = FakeTokenizer()
    docs = [{"text": "a" * 30, "domain": "code", "source": "s", "doc": "long"},
            {"text": "b" * 5, "domain": "code", "source": "s", "doc": "short1"},
            {"messages": [{"role": "user", "content": "hi"}], "domain": "code", "source": "s", "doc": "chat"},
            {"text": "c" * 3, "domain": "code", "source": "s", "doc": "tail"}]
    chunks = list(chunk_documents(docs, tok, max_len=12, min_len=4))
    assert chunks == list(chunk_documents(docs, tok, max_len=12, min_len=4))
    assert all(len(c["input_ids"]) <= 12 for c in chunks) and all(len(c["input_ids"]) == 12 for c in chunks[:-1])
    flat = [t for c in chunks for t in c["input_ids"]]
    sep = tok("\n\n")["input_ids"]
    expected = tok("a" * 30)["input_ids"] + sep + tok("b" * 5)["input_ids"] + sep + \
        tok.apply_chat_template(docs[2]["messages"]) + sep + tok("c" * 3)["input_ids"]
    assert len(chunks) == 4 and flat == expected[: len(flat)]
    assert len(expected) - len(flat) == len(sep) + 3, "a short tail (under min_len) is dropped"
    assert [c["doc"] for c in chunks[:3]] == ["long", "long", "long"] and [c["part"] for c in chunks[:3]] == [0, 1, 2]


@pytest.mark.slow
def test_testbed_train_prompts_near_eval_ones_are_dropped():
    from adaflash_hf.testbed import load_prompts
    from adaflash_hf.testbed.corpus import drop_near_eval

    records = load_prompts(split="train", max_per_domain=400)
    kept, dropped = drop_near_eval(records)
    assert len(kept) + len(dropped) == len(records) and len(dropped) < 0.01 * len(records)
    assert kept == [r for r in records if r not in dropped], "order kept"
