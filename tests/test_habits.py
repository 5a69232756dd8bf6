"""Habits of transformers users, with the shipped drafter on the real testbed model (fp32, greedy): each gives
exactly what plain `generate` gives. `pipeline("text-generation")` with `assistant_model`, `TextIteratorStreamer`
in a thread, `stop_strings`, a list of `eos_token_id`s, `min_new_tokens`, `repetition_penalty`,
`no_repeat_ngram_size`, and two threads decoding with one drafter."""

import threading

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.checkpoints import default_drafter_dir

from .conftest import chat_inputs, plain_greedy_batch


pytestmark = pytest.mark.slow
NEW = 16


@pytest.fixture(scope="module")
def testbed(real_target):
    target, tokenizer = real_target  # loaded once per session (conftest)
    drafter = AdaFlashDrafterModel.from_pretrained(default_drafter_dir(), dtype=torch.float32).eval()
    return target, tokenizer, drafter


_inputs = chat_inputs

PROMPT = "List the first ten prime numbers, separated by commas, then explain what a prime number is."
OTHER = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def plain(testbed):
    """`{prompt: target.generate(**inputs, max_new_tokens=NEW, do_sample=False)}` for PROMPT and OTHER, decoded once
    (in one left-padded batch, cut back to the single-prompt output) and shared by the tests that compare with plain
    greedy decoding without other knobs."""
    target, tokenizer, _ = testbed
    return plain_greedy_batch(target, tokenizer, [PROMPT, OTHER], NEW)


def _both(target, drafter, inputs, **kwargs):
    with torch.inference_mode():
        plain = target.generate(**inputs, do_sample=False, **kwargs)
        spec = target.generate(**inputs, do_sample=False, assistant_model=drafter, **kwargs)
    return plain, spec


@pytest.mark.parametrize("knobs", [
    {"repetition_penalty": 1.3},
    {"no_repeat_ngram_size": 3},
    {"min_new_tokens": NEW},
], ids=lambda k: next(iter(k)))
def test_logits_processors_keep_greedy_exact(testbed, knobs):
    target, tokenizer, drafter = testbed
    plain, spec = _both(target, drafter, _inputs(tokenizer, PROMPT), max_new_tokens=NEW, **knobs)
    assert torch.equal(plain, spec)
    if "min_new_tokens" in knobs:
        assert spec.shape[1] - _inputs(tokenizer, PROMPT)["input_ids"].shape[1] == NEW


def test_stop_strings_and_a_list_of_eos_ids(testbed, plain):
    target, tokenizer, drafter = testbed
    inputs = _inputs(tokenizer, PROMPT)
    n = inputs["input_ids"].shape[1]
    reference = plain[PROMPT][0, n:]
    assert len(reference) == NEW  # no EOS within NEW tokens: the stops below are mid-answer
    # a stop string the target writes mid-answer: both stop at the same token
    stop = tokenizer.decode(reference[NEW // 2:NEW // 2 + 1]).strip()
    assert stop, tokenizer.decode(reference)
    plain, spec = _both(target, drafter, inputs, max_new_tokens=NEW, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(plain, spec) and spec.shape[1] <= n + NEW // 2 + 1 and stop in tokenizer.decode(spec[0, n:])
    # a second EOS id: a token the target writes mid-answer ends generation there, with the drafter too
    stop_token = int(reference[NEW // 2])
    plain, spec = _both(target, drafter, inputs, max_new_tokens=NEW, eos_token_id=[tokenizer.eos_token_id, stop_token])
    assert torch.equal(plain, spec) and int(spec[0, -1]) == stop_token and spec.shape[1] <= n + NEW // 2 + 1


def test_text_iterator_streamer_in_a_thread(testbed, plain):
    from transformers import TextIteratorStreamer

    target, tokenizer, drafter = testbed
    inputs = _inputs(tokenizer, PROMPT)
    plain = plain[PROMPT]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
    kwargs = dict(**inputs, max_new_tokens=NEW, do_sample=False, assistant_model=drafter, streamer=streamer)
    thread = threading.Thread(target=target.generate, kwargs=kwargs)
    thread.start()
    pieces = list(streamer)
    thread.join()
    expected = tokenizer.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(pieces) > 1 and "".join(pieces) == expected


def test_text_generation_pipeline_with_assistant_model(testbed):
    from transformers import pipeline

    target, tokenizer, drafter = testbed
    messages = [{"role": "user", "content": PROMPT}]
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    expected = plain(messages, max_new_tokens=NEW, do_sample=False)[0]["generated_text"][-1]["content"]
    got = assisted(messages, max_new_tokens=NEW, do_sample=False)[0]["generated_text"][-1]["content"]
    assert got == expected and got


def test_two_threads_decode_with_one_drafter(testbed, plain):
    target, tokenizer, drafter = testbed
    prompts = [PROMPT, OTHER]
    inputs = [_inputs(tokenizer, p) for p in prompts]
    expected = [plain[p] for p in prompts]
    results, errors = [None, None], []

    def run(i):
        try:
            with torch.inference_mode():
                results[i] = target.generate(**inputs[i], max_new_tokens=NEW, do_sample=False, assistant_model=drafter,
                                             return_dict_in_generate=True)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in zip(results, expected):
        assert torch.equal(got.sequences, want) and got.speculation_stats.rounds > 0
