"""Length rules besides the head: transformers' confidence threshold and heuristic schedule applied to the block."""

import pytest
import torch

from adaflash_hf import AdaFlashGenerationConfig, SpeculationRuntime
from adaflash_hf.bench.runner import run_benchmark, summarize
from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig

from .conftest import ALWAYS_DRAFT, device_cost, make_oracle, make_tiny_target, speculate, with_knobs
from .test_bench import RECORDS, CharTokenizer


def _setup(seed=2, block_size=6, error_rate=0.3):
    target = make_tiny_target(seed=seed)
    prompt = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(seed))
    reference = target.generate(prompt, max_new_tokens=60, do_sample=False)
    drafter = make_oracle(target, reference, block_size=block_size, error_rate=error_rate, seed=seed)
    return target, prompt, reference, drafter


def test_heuristic_schedule_follows_plus_two_minus_one():
    target, prompt, reference, drafter = _setup()
    with_knobs(drafter, length_policy="heuristic", **ALWAYS_DRAFT)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, reference[:, : out.shape[1]])
    cap = drafter.config.block_size - 1
    assert stats.drafted[0] == cap
    state = cap
    for i in range(len(stats.drafted) - 1):
        state = min(cap, state + 2) if stats.accepted[i] == stats.drafted[i] else max(1, state - 1)
        # tokens left after round i: the prefill committed 1, each round its accepted drafts + 1
        left = 40 - 1 - sum(a + 1 for a in stats.accepted[: i + 1])
        assert stats.drafted[i + 1] == max(0, min(state, left - 1)), i
    assert len(set(stats.drafted)) > 1  # the schedule moved


@pytest.mark.parametrize("threshold,shorter", [(0.0, False), (1.01, True)])
def test_confidence_threshold_cuts_after_the_first_unsure_token(threshold, shorter):
    target, prompt, reference, drafter = _setup()
    with_knobs(drafter, length_policy="confidence", assistant_confidence_threshold=threshold, **ALWAYS_DRAFT)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, reference[:, : out.shape[1]])
    if shorter:  # every token is below a threshold > 1: each block is cut after its first token
        assert set(stats.drafted) == {1}
    else:
        assert max(stats.drafted) == drafter.config.block_size - 1


def test_unknown_policy_and_missing_head_are_refused():
    target, prompt, _, drafter = _setup()
    with pytest.raises(ValueError, match="length_policy"):
        AdaFlashGenerationConfig(length_policy="sometimes")
    with_knobs(drafter, length_policy="head")
    with pytest.raises(ValueError, match="length head"):
        target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter)


def test_num_assistant_tokens_caps_the_block():
    target, prompt, reference, drafter = _setup(error_rate=0.0)
    with_knobs(drafter, num_assistant_tokens=2, **ALWAYS_DRAFT)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, reference[:, : out.shape[1]])
    assert max(stats.drafted) == 2


def test_bench_length_columns_are_lossless_and_restore_the_drafter():
    target, _, _, drafter = _setup(block_size=4)
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=64, block_size=4, head_dim=8)).eval()
    runtime = SpeculationRuntime(length_head=head, cost_model=device_cost({1: {1: 0.01, 4: 0.012}}, draft=0.001))
    runtime.attach(drafter)
    knobs = drafter.generation_config
    methods = ("plain", "drafter_only", "drafter_confidence", "drafter_heuristic", "drafter_head")
    summary = summarize(run_benchmark(target, CharTokenizer(), drafter, RECORDS, methods=methods, max_new_tokens=12,
                                      raw=True, progress=False), block_size=4)
    for method in methods:
        assert summary["methods"][method]["overall"]["identical"] == 3, method
    for method in methods[1:]:
        assert summary["methods"][method]["overall"]["verified_per_committed"] >= 1.0
    assert drafter.runtime is runtime and drafter.generation_config is knobs  # restored
    drafter.runtime = SpeculationRuntime()
    with pytest.raises(ValueError, match="length head"):
        run_benchmark(target, CharTokenizer(), drafter, RECORDS[:1], methods=("drafter_head",), max_new_tokens=4,
                      raw=True, progress=False)
