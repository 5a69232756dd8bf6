"""Multi-candidate (tree) verification (`adaflash_hf.generation.candidates`): the tree's mask and acceptance by
hand, how many candidates a device's costs allow, and the engine's rows equal to plain greedy with trees on."""

import pytest
import torch

from adaflash_hf.generation import SpeculationRuntime
from adaflash_hf.generation.batch import generate_batch
from adaflash_hf.generation.candidates import (CandidateTree, FirstTokenHits, first_token_alternatives,
                                               free_candidates, tree_shape)

from .conftest import build_drafter, device_cost, make_tiny_target
from .test_batch import BatchedOracle, _oracle_runner, _prompts, _reference

FLAT = device_cost({1: {1: 1.0, 4: 1.0, 16: 1.0}, 64: {1: 1.0, 4: 1.0, 16: 1.0}}, draft=0.1)  # launch-bound device
CPU_LIKE = device_cost({1: {1: 1.0, 4: 1.6, 16: 4.0}, 64: {1: 2.0, 4: 3.2, 16: 8.0}}, draft=0.1)


def test_free_candidates_fill_the_flat_width_and_never_extrapolate():
    assert free_candidates(FLAT, 1, 3, most=8) == 5  # 1 + 5 * 3 = 16, the widest measured verify
    assert free_candidates(FLAT, 32, 4, most=8) == 3  # 13 tokens; 17 would be past the measurements
    assert free_candidates(FLAT, 1, 1, most=4) == 4  # capped by the knob
    assert free_candidates(CPU_LIKE, 1, 3, most=8) == 1  # every extra token costs: one block
    assert free_candidates(None, 1, 3, most=8) == 1 and free_candidates(FLAT, 1, 0, most=8) == 1
    sloped = device_cost({1: {1: 1.0, 4: 1.0, 8: 1.04, 16: 1.2}})
    assert free_candidates(sloped, 1, 3, most=8) == 2  # 7 tokens cost 1.03 (within 5%), 10 cost 1.07
    assert free_candidates(sloped, 1, 3, most=8, tolerance=0.25) == 5


def test_first_token_hits_learn_what_each_rank_adds():
    hits = FirstTokenHits(decay=0.5)
    assert hits.gain(1) is None
    firsts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]])
    rows = torch.tensor([True, True, True, False])  # the last row verified a lookup continuation
    hits.record(firsts, torch.tensor([1, 5, 0, 1]), rows)  # rank 0 right once, rank 1 once, rank 2 never
    assert hits.hits == pytest.approx([1 / 3, 1 / 3, 0.0])
    assert hits.gain(2) == pytest.approx(2.0) and hits.gain(3) == pytest.approx(2.0) and hits.gain(4) is None
    hits.record(firsts, torch.tensor([1, 4, 7, 0]), rows)  # rank 0 right everywhere: the averages move halfway
    assert hits.hits == pytest.approx([2 / 3, 1 / 6, 0.0])


def _curve(*rates, width=7):
    """`[expected accepted tokens of one block verified w deep for w in 0 .. width]` for per-position rates."""
    totals, alive = [0.0], 1.0
    for k in range(width):
        alive *= rates[min(k, len(rates) - 1)]
        totals.append(totals[-1] + alive)
    return totals


def test_tree_shape_trades_depth_for_candidates_where_width_is_free():
    expected = _curve(0.5, 0.5)  # short blocks: position 1 half the time, each later one half of that
    assert tree_shape(CPU_LIKE, 1, 7, 8, None, expected) == (1, 7)  # width costs: one block, whatever is known
    assert tree_shape(FLAT, 1, 7, 8, None, expected) == (2, 7)  # nothing known: what fits at the chosen width
    hits = FirstTokenHits()
    assert tree_shape(FLAT, 1, 7, 8, hits, expected) == (8, 1)  # no rank measured yet: every candidate, 1 deep
    hits.hits = [0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.01, 0.01]
    k, m = tree_shape(FLAT, 1, 7, 8, hits, expected)
    # 3 x 5: 1 + 1.6 x 0.97 = 2.55 beats 5 x 3 (1 + 1.74 x 0.875), 2 x 7 (1 + 1.4 x 0.99) and 8 x 1 (1 + 1.8 x 0.5)
    assert 1 + k * m <= 16 and (k, m) == (3, 5)
    assert tree_shape(FLAT, 1, 7, 8, hits, _curve(0.95)) == (2, 7)  # a drafter right deep into the block: depth
    hits.hits = [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # the other candidates never right: one block
    assert tree_shape(FLAT, 1, 7, 8, hits, expected) == (1, 7)


def test_alternatives_are_the_next_most_likely_first_tokens():
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0, 1.0], [9.0, 1.0, 2.0, 3.0, 8.0]])
    drafted = torch.tensor([1, 2])  # row 1's drafted token is not its argmax (a processor changed it)
    assert first_token_alternatives(logits, None, drafted, 3).tolist() == [[3, 2], [0, 4]]
    vocab_ids = torch.tensor([10, 11, 12, 13, 14])  # a draft vocabulary: ids map to the target's vocabulary
    assert first_token_alternatives(logits, vocab_ids, drafted + 10, 2).tolist() == [[13], [10]]


def _tree():
    drafts = torch.tensor([[5, 6, 7], [1, 2, 0]])
    return CandidateTree.from_proposals(drafts, torch.tensor([3, 2]), torch.tensor([[8], [9]]), ["drafter", "lookup"])


def test_tree_layout_mask_and_validity():
    tree = _tree()
    assert tree.width == 7 and tree.depth().tolist() == [0, 1, 2, 3, 1, 2, 3]
    assert tree.input_ids(torch.tensor([4, 3]))[0].tolist() == [4, 5, 6, 7, 8, 6, 7]
    # Row 1 verifies a lookup continuation: one candidate of 2 tokens.
    assert tree.valid.tolist() == [[True] * 7, [True, True, True, False, False, False, False]]
    past = torch.tensor([[True, False], [True, True]])
    mask = tree.attention_mask(past, torch.float32)
    assert mask.shape == (2, 1, 7, 9)
    seen = (mask[:, 0] == 0)
    # Candidate 1's second token (slot 5) sees the valid cache, the anchor, its own first token and itself.
    assert seen[0, 5].tolist() == [True, False, True, False, False, False, True, True, False]
    assert seen[0, 0].tolist() == [True, False, True] + [False] * 6  # the anchor: cache and itself
    assert not seen[1, :, 6:].any()  # row 1's dead candidate is nobody's key


def test_tree_accept_keeps_the_longest_candidate():
    tree = _tree()
    # Target's argmax per slot: after the anchor 8 (candidate 1's first token), after 8 -> 6, after 6 -> 9.
    target = torch.tensor([[8, 0, 0, 0, 6, 9, 3], [1, 2, 4, 0, 0, 0, 0]])
    verdict = tree.accept(target)
    assert verdict.chosen.tolist() == [1, 0] and verdict.accepted.tolist() == [2, 2]
    assert verdict.next_tok.tolist() == [9, 4]  # the target's token after each kept prefix
    assert verdict.drafts.tolist() == [[8, 6, 7], [1, 2, 0]]
    assert verdict.path.tolist() == [[0, 4, 5, 6], [0, 1, 2, 3]]
    assert verdict.cache_valid().tolist() == [[True, False, False, False, True, True, False],
                                              [True, True, True, False, False, False, False]]
    values = torch.arange(14).view(2, 7)
    assert verdict.along_path(values).tolist() == [[0, 4, 5, 6], [7, 8, 9, 10]]
    # A tie keeps the drafter's own block (candidate 0).
    assert tree.accept(torch.zeros(2, 7, dtype=torch.long)).chosen.tolist() == [0, 0]


class RunnerUpOracle(BatchedOracle):
    """A batched oracle whose wrong tokens keep the right one as the runner-up (a drafter that was nearly right):
    the case the other candidates are for."""

    def forward(self, noise_embeds, context_hidden_states=None, attention_mask=None, position_ids=None, cache=None,
                **kw):
        out = super().forward(noise_embeds, context_hidden_states, attention_mask, position_ids, cache, **kw)
        block, rows = noise_embeds.shape[1], self._runner_fn().active_prompt_indices
        for r, prompt_idx in enumerate(rows):
            pos = int(position_ids[r, -block]) + 1
            reference = self._references[prompt_idx]
            right = reference[pos] if pos < len(reference) else 0
            out.last_hidden_state[r, 1] = out.last_hidden_state[r, 1] + 9.0 * self._head[right]
        return out


def _oracle(target, prompts, max_new, candidates, cls=BatchedOracle):
    runner = _oracle_runner(target, prompts, max_new, block_size=5, error_rate=0.4, seed=7,
                            knobs={"draft_candidates": candidates})
    if cls is not BatchedOracle:
        runner.drafter.__class__ = cls
    runner.runtime.cost_model = FLAT
    return runner


def test_trees_commit_plain_greedy_and_accept_more():
    target = make_tiny_target(seed=7)
    prompts = _prompts(10, seed=7)
    expected = [_reference(target, p, 24) for p in prompts]
    runs = {}
    for k in (1, 8):
        out, stats = _oracle(target, prompts, 24, k, RunnerUpOracle).generate(prompts, 24, return_stats=True)
        assert out == expected, f"draft_candidates={k}: a row differs from plain greedy"
        runs[k] = stats
    assert not runs[1].candidates and set(runs[8].candidates) >= {3}  # 1 + 3 * 4 = 13 <= 16 tokens
    assert max(runs[8].verify_widths) == 13
    accepted = {k: sum(map(sum, s.accepted)) for k, s in runs.items()}
    assert accepted[8] > accepted[1] and runs[8].rounds < runs[1].rounds


def test_trees_stay_exact_with_rejections_eos_and_continuous_batching():
    target = make_tiny_target(seed=8)
    prompts = _prompts(9, seed=8)
    drafter = build_drafter(target, block_size=4, seed=2, draft_candidates=4)  # random: nearly everything rejected
    flat = SpeculationRuntime(cost_model=FLAT)
    out, stats = generate_batch(target, drafter, prompts, 16, max_batch_size=4, continuous=True, runtime=flat,
                                return_stats=True)
    assert out == [_reference(target, p, 16) for p in prompts]
    assert stats.candidates and stats.compactions > 0  # the dead candidates' slots were compacted away
    # Sampling verifies one candidate (multi-draft rejection sampling is not implemented).
    _, sampled = generate_batch(target, drafter, prompts[:3], 6, do_sample=True, runtime=flat, return_stats=True)
    assert not sampled.candidates


def test_one_candidate_when_the_device_charges_for_width():
    target = make_tiny_target(seed=9)
    prompts = _prompts(4, seed=9)
    drafter = build_drafter(target, block_size=4, seed=3, draft_candidates=8)
    cpu_like = SpeculationRuntime(cost_model=CPU_LIKE)
    out, stats = generate_batch(target, drafter, prompts, 10, runtime=cpu_like, return_stats=True)
    assert out == [_reference(target, p, 10) for p in prompts] and not stats.candidates
