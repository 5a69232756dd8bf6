"""Lossless speculative decoding on the real testbed model (SmolLM2-135M-Instruct, fp32)."""

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.checkpoints import default_drafter_dir


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def testbed():
    from adaflash_hf.testbed import default_eval_prompts, load_testbed

    target, tokenizer = load_testbed(dtype=torch.float32)
    path = default_drafter_dir()
    if path is not None:
        drafter = AdaFlashDrafterModel.from_pretrained(path, dtype=torch.float32).eval()
    else:  # before a trained drafter is shipped, an untrained one still has to be lossless
        drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=8, tokenizer=tokenizer).eval()
    by_domain = {}
    for record in default_eval_prompts():
        by_domain.setdefault(record["domain"], []).append(record)
    prompts = [r for records in by_domain.values() for r in records[:2]]  # 2 per domain
    return target, tokenizer, drafter, prompts


def _inputs(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


@pytest.mark.parametrize("path", [None, "dflash"])
def test_greedy_speculative_equals_plain_on_eval_prompts(testbed, path):
    target, tokenizer, drafter, prompts = testbed
    accepted = 0
    with torch.inference_mode():
        for record in prompts:
            inputs = _inputs(tokenizer, record["prompt"])
            plain = target.generate(**inputs, max_new_tokens=40, do_sample=False)
            spec = target.generate(**inputs, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                                   speculation_type=path, tokenizer=tokenizer)
            assert torch.equal(spec, plain), f"[{record['domain']}] {record['prompt'][:80]!r}"
            if path is None:
                accepted += sum(drafter.generation_stats.accepted)
    if path is None and default_drafter_dir() is not None:
        assert accepted > 0  # the shipped drafter is trained: its drafts are accepted on real prompts


def test_sampling_runs_on_the_real_model(testbed):
    target, tokenizer, drafter, prompts = testbed
    inputs = _inputs(tokenizer, prompts[0]["prompt"])
    torch.manual_seed(0)
    with torch.inference_mode():
        out = target.generate(**inputs, max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.95,
                              assistant_model=drafter)
    n_new = out.shape[1] - inputs["input_ids"].shape[1]
    assert 0 < n_new <= 24
    assert drafter.generation_stats.rounds > 0


def test_wrong_tokenizer_is_refused_before_compute(testbed):
    target, tokenizer, drafter, prompts = testbed
    if drafter.config.tokenizer_fingerprint is None:
        pytest.skip("drafter carries no tokenizer fingerprint")

    class OtherTokenizer:
        mask_token_id = None

        def get_vocab(self):
            return {**tokenizer.get_vocab(), "<extra>": 10**6}

    inputs = _inputs(tokenizer, prompts[0]["prompt"])
    with pytest.raises(ValueError, match="tokenizer"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, tokenizer=OtherTokenizer())
