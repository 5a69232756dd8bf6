"""The proposers behind one row-batched interface (`generation/proposers.py`), and both engines drafting through
the one `BlockDraftProposer`."""

import pytest
import torch

from adaflash_hf.generation.batch import AdaFlashBatchGenerator, BatchRun, generate_batch
from adaflash_hf.generation.proposers import (
    BlockDraftProposer,
    DraftRows,
    LookupProposer,
    NoDraftProposer,
    Proposals,
    swap_in_lookup,
)
from adaflash_hf.generation.sampler import SpeculativeSampler
from adaflash_hf.generation.stats import BatchStats

from .conftest import VOCAB, build_drafter, make_tiny_target, speculate
from .test_batch import _prompts, _reference


BLOCK = 4


def _prefilled(target, drafter, prompts, do_sample=False, hybrid=False):
    """`(runner, run, batch)`: the engine after prefilling `prompts` (a `BatchState` of live rows)."""
    drafter.generation_config.hybrid_lookup = hybrid
    runner = AdaFlashBatchGenerator(target, drafter)
    sampler = SpeculativeSampler.for_target(target, do_sample=do_sample)
    run = BatchRun(prompts, 12, set(), sampler, BatchStats.for_prompts(len(prompts)),
                   outputs=[[] for _ in prompts], done=[False] * len(prompts))
    runner._setup(run, len(prompts))
    return runner, run, runner._prefill(run, list(range(len(prompts))))


def _rows(runner, run, batch, budgets=None):
    budgets = budgets or [BLOCK - 1] * batch.size
    return DraftRows(batch, budgets, batch.prompt_idx, runner._sequences(run, batch.prompt_idx))


def _check_verifiable(runner, run, batch, proposals: Proposals, budgets):
    """The engine verifies and accepts the proposals as they are."""
    b, m = proposals.drafts.shape
    assert b == batch.size and proposals.lengths.shape == (b,) and len(proposals.sources) == b
    assert proposals.lengths_list() == proposals.lengths.tolist()
    assert all(0 <= n <= cap for n, cap in zip(proposals.lengths_list(), budgets))
    assert m == max(proposals.lengths_list(), default=0)
    out = runner._verify(batch, proposals)
    assert out.logits.shape[:2] == (b, m + 1)
    accepted, next_tok = run.sampler.accept(out.logits, proposals.drafts, proposals.lengths, proposals.q,
                                            proposals.one_hot, _rows(runner, run, batch).sequences)
    assert (accepted <= proposals.lengths).all() and next_tok.shape == (b,)


def test_no_draft_proposer_proposes_nothing():
    target = make_tiny_target(seed=40)
    runner, run, batch = _prefilled(target, build_drafter(target, block_size=BLOCK, seed=40), _prompts(3, seed=40))
    proposals = NoDraftProposer(runner.device).propose(_rows(runner, run, batch))
    assert proposals.arm == "plain" and proposals.drafts.shape == (3, 0) and proposals.sources == ["none"] * 3
    _check_verifiable(runner, run, batch, proposals, [0] * 3)


def test_lookup_proposer_returns_each_rows_continuation():
    target = make_tiny_target(seed=41)
    prompts = [list(range(VOCAB)), [1, 2, 3], [9, 9, 9, 9]]  # row 0 holds every token: its lookup matches
    runner, run, batch = _prefilled(target, build_drafter(target, block_size=BLOCK, seed=41), prompts, hybrid=True)
    budgets = [2, 3, 1]
    proposals = LookupProposer(run.lookup).propose(_rows(runner, run, batch, budgets))
    assert proposals.arm == "lookup"
    lengths = proposals.lengths_list()
    assert any(lengths)
    for r, (n, source) in enumerate(zip(lengths, proposals.sources)):
        assert source == ("lookup" if n else "none")
        text = prompts[r] + run.outputs[r]
        assert proposals.drafts[r, :n].tolist() == _lookup_reference(text, budgets[r], run.lookup.max_ngram,
                                                                      run.lookup.num_tokens)
    _check_verifiable(runner, run, batch, proposals, budgets)


def _lookup_reference(text, cap, max_ngram, num_tokens):
    """transformers' prompt lookup, by hand: the first earlier occurrence of the longest matching tail n-gram."""
    for n in range(min(max_ngram, len(text) - 1), 0, -1):
        tail = text[-n:]
        for start in range(len(text) - n):
            if text[start: start + n] == tail:
                return text[start + n: start + n + num_tokens][:cap]
    return []


@pytest.mark.parametrize("do_sample", [False, True])
def test_block_draft_proposer_shapes_and_cache(do_sample):
    target = make_tiny_target(seed=42)
    drafter = build_drafter(target, block_size=BLOCK, seed=42)
    runner, run, batch = _prefilled(target, drafter, _prompts(4, seed=42), do_sample=do_sample)
    context_width = batch.ctx.shape[1]
    budgets = [3, 1, 2, 3]
    proposals = run.drafting.propose(_rows(runner, run, batch, budgets))
    b, m = proposals.drafts.shape
    assert proposals.arm == "draft" and b == 4 and proposals.noise.shape[:2] == (4, BLOCK)
    assert batch.ctx is None  # the pending context was consumed
    # The drafter's cache holds the context only: the block's entries were cropped right after the forward.
    assert batch.drafter.num_slots == context_width == batch.drafter.cache.get_seq_length()
    if do_sample:
        assert proposals.q.shape == (4, m, target.config.vocab_size)
        torch.testing.assert_close(proposals.q.sum(-1), torch.ones(4, m))
    else:
        assert proposals.q is None
    _check_verifiable(runner, run, batch, proposals, budgets)


def test_block_draft_proposer_logits_for_transformers_loop():
    """`return_logits` (the bs=1 adapter): processed draft logits `[b, m, V]` whose argmax are the drafts."""
    target = make_tiny_target(seed=43)
    drafter = build_drafter(target, block_size=BLOCK, seed=43)
    runner, run, batch = _prefilled(target, drafter, _prompts(1, seed=43))
    proposer = BlockDraftProposer(drafter, runner.embeddings, runner.lm_head, run.sampler, run.lengths,
                                  return_logits=True)
    proposals = proposer.propose(_rows(runner, run, batch, [BLOCK - 1]))
    assert proposals.logits.shape == (1, BLOCK - 1, target.config.vocab_size)
    assert torch.equal(proposals.logits.argmax(-1), proposals.drafts)


def test_swap_in_lookup_cuts_to_the_round_width():
    class PreferLookup:
        def row_source(self, key, lookup_len, draft_len):
            return "lookup" if lookup_len > draft_len else "drafter"

    draft = Proposals("draft", torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]), ["drafter", "drafter"],
                      host_lengths=[2, 1])
    lookup = Proposals("lookup", torch.tensor([[7, 8, 9], [5, 6, 4]]), torch.tensor([0, 3]), ["none", "lookup"],
                       host_lengths=[0, 3])
    swapped = swap_in_lookup(draft, lookup, PreferLookup(), [0, 1])
    assert swapped.drafts.tolist() == [[1, 2], [5, 6]] and swapped.lengths.tolist() == [2, 2]
    assert swapped.lengths_list() == [2, 2] and swapped.sources == ["drafter", "lookup"]
    assert swapped.one_hot.tolist() == [False, True]


def test_both_engines_draft_through_the_one_proposer(monkeypatch):
    """bs=1 `generate` and `generate_batch` both call `BlockDraftProposer.forward`, draft the same blocks for the
    same row at the same anchors, and give plain greedy `generate`'s tokens."""
    target = make_tiny_target(seed=44)
    drafter = build_drafter(target, block_size=BLOCK, seed=44)
    prompt = _prompts(1, seed=44, min_len=6)[0]
    forward, blocks = BlockDraftProposer.forward, {"bs1": {}, "batch": {}}
    engine = ["bs1"]

    def recording(self, state):
        queries, states = forward(self, state)
        blocks[engine[0]][int(state.next_pos[0])] = states[0].detach().clone()
        return queries, states

    monkeypatch.setattr(BlockDraftProposer, "forward", recording)
    max_new = 16
    out, stats = speculate(target, torch.tensor([prompt]), drafter, max_new_tokens=max_new, do_sample=False)
    assert out[0, len(prompt):].tolist() == _reference(target, prompt, max_new)
    engine[0] = "batch"
    assert generate_batch(target, drafter, [prompt], max_new) == [_reference(target, prompt, max_new)]
    common = set(blocks["bs1"]) & set(blocks["batch"])
    assert len(blocks["bs1"]) == stats.proposers.count("drafter") > 0 and len(common) >= len(blocks["bs1"]) - 1
    for anchor in common:
        torch.testing.assert_close(blocks["bs1"][anchor], blocks["batch"][anchor], atol=1e-5, rtol=1e-5)


def test_both_engines_look_up_through_the_one_proposer(monkeypatch):
    """Hybrid bs=1 `generate` and `generate_batch` both take lookup continuations from `LookupProposer`; at bs=1 each
    one equals transformers' `PromptLookupCandidateGenerator` on the same sequence (cut to the round's budget), and
    the output is plain greedy's."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    target = make_tiny_target(seed=45)
    drafter = build_drafter(target, block_size=BLOCK, seed=45, hybrid_lookup=True)
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]  # repetitive: lookup matches from the first round
    propose, calls = LookupProposer.propose, {"bs1": [], "batch": []}
    engine = ["bs1"]

    def recording(self, rows):
        found = propose(self, rows)
        calls[engine[0]].append((torch.tensor(self.lookup.text(rows.state.prompt_idx[0])), rows.budgets[0],
                                 found.drafts[0, : found.lengths_list()[0]].tolist()))
        return found

    monkeypatch.setattr(LookupProposer, "propose", recording)
    max_new = 16
    out, stats = speculate(target, torch.tensor([prompt]), drafter, max_new_tokens=max_new, do_sample=False)
    assert out[0, len(prompt):].tolist() == _reference(target, prompt, max_new)
    knobs = drafter.generation_config
    for sequence, budget, proposed in calls["bs1"]:
        matcher = PromptLookupCandidateGenerator(num_output_tokens=knobs.prompt_lookup_num_tokens,
                                                 max_matching_ngram_size=knobs.max_matching_ngram_size,
                                                 max_length=len(prompt) + max_new)
        candidates, _ = matcher.get_candidates(sequence[None])
        assert proposed == candidates[0, len(sequence) : len(sequence) + budget].tolist()
    assert calls["bs1"] and any(proposed for _, _, proposed in calls["bs1"]) and "lookup" in stats.proposers
    engine[0] = "batch"
    assert generate_batch(target, drafter, [prompt], max_new) == [_reference(target, prompt, max_new)]
    assert calls["batch"]


def test_lookup_hindsight_scores_rows_that_verified_nothing_against_their_committed_tokens():
    """Matched = leading continuation tokens equal to the committed ones (within both lengths); only rows whose round
    verified no proposal count (a drafter's accepted tokens are the easy stretches: a biased sample)."""
    from adaflash_hf.generation.proposers import Proposals, lookup_hindsight

    lookup = Proposals("lookup", torch.tensor([[4, 5, 6], [4, 5, 6], [7, 8, 0], [1, 2, 3]]),
                       torch.tensor([3, 3, 2, 3]), ["lookup"] * 4)
    committed = [[4, 9, 0], [4], [7, 8, 9], [1, 2, 3]]
    matched, known, lengths = lookup_hindsight(lookup, committed, ["none", "none", "none", "drafter"])
    assert matched == [1, 1, 2, 3] and known == [3, 1, 3, 3] and lengths == [3, 3, 2, 0]
    assert lookup_hindsight(None, committed, ["none"] * 4) is None
