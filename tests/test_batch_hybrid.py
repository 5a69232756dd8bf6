"""Batched engine: hybrid n-gram lookup proposals per row (`generation/lookup.py`) and OnlineSpec feedback
(`generation/feedback.py`)."""

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from adaflash_hf.generation import SpeculationRuntime
from adaflash_hf.generation.batch import AdaFlashBatchGenerator, generate_batch, rejection_sample
from adaflash_hf.generation.lookup import BatchLookup
from adaflash_hf.generation.policy import ProposalPolicy
from adaflash_hf.generation.proposers import BlockDraftProposer
from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig

from .conftest import VOCAB, build_drafter, device_cost, make_tiny_target, speculate
from .test_batch import COST, _prompts, _reference


def _drafter(target, hybrid=True, block_size=4, seed=1, **knobs):
    """A random drafter; by default lookup continuations may replace its blocks but every round drafts."""
    return build_drafter(target, block_size=block_size, seed=seed, **{"hybrid_lookup": hybrid, **knobs})


def _mixed_prompts(n, seed, vocab=VOCAB):
    """Random prompts of mixed lengths, half of them repeating a short phrase (n-gram lookup finds matches)."""
    prompts = _prompts(n, seed=seed, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 100)
    for r in range(0, n, 2):
        phrase = torch.randint(0, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        prompts[r] = (phrase * 6)[: 4 + 3 * r]
    return prompts


def _lookup_stats(stats):
    pairs = [(a, v) for srcs, acc, ver in zip(stats.sources, stats.accepted, stats.verified)
             for s, a, v in zip(srcs, acc, ver) if s == "lookup"]
    return sum(a for a, _ in pairs), sum(v for _, v in pairs)


# ---------------------------------------------------------------------------------------------------- lookup


def test_batch_lookup_equals_transformers_matcher_row_by_row():
    """The vectorised lookup proposes, for every row, what transformers' bs=1 matcher proposes for its text."""
    import sys

    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    eos = {7}
    for trial in range(30):
        prompts = [torch.randint(0, 9, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(6)]
        lookup = BatchLookup(prompts, num_tokens=5, max_ngram=3, eos=eos, device="cpu")
        texts = [list(p) for p in prompts]
        for step in range(3):  # rows grow by different amounts, as committed tokens do
            caps = torch.randint(0, 7, (6,), generator=g)
            idx = torch.arange(6)
            proposals, lengths = lookup.propose(idx, caps)
            matcher = PromptLookupCandidateGenerator(eos_token_id=torch.tensor(sorted(eos)), num_output_tokens=5,
                                                     max_matching_ngram_size=3, max_length=sys.maxsize)
            for r, text in enumerate(texts):
                expected = []
                if len(text) >= 2:
                    candidates, _ = matcher.get_candidates(torch.tensor([text]))
                    expected = candidates[0, len(text):].tolist()[: int(caps[r])]
                assert proposals[r, : int(lengths[r])].tolist() == expected, (trial, step, r, text)
            new = torch.randint(0, 9, (6, 3), generator=g)
            counts = torch.randint(0, 4, (6,), generator=g)
            lookup.append(idx, new, counts)
            for r in range(6):
                texts[r] += new[r, : int(counts[r])].tolist()


def test_row_source_uses_each_rows_own_averages():
    policy = ProposalPolicy()
    # Untried sources: the proposal lengths decide; afterwards the per-row averages of accepted tokens.
    assert policy.row_source(0, 3, 3) == "lookup" and policy.row_source(0, 2, 3) == "drafter"
    assert policy.row_source(0, 0, 0) == "drafter"
    policy.record([0, 1], ["lookup", "drafter"], [0, 3])
    assert policy.row_source(0, 3, 1) == "drafter"  # row 0: lookup accepted nothing, the batch's drafter: 3
    # A row's averages start from the batch's (a prior) and follow its own rounds: row 0's drafter keeps missing
    # while row 1's hits, and row 0's lookup finds something once.
    for _ in range(4):
        policy.record([0, 1], ["drafter", "drafter"], [0, 3])
    assert policy.rows[0]["drafter"] == pytest.approx(3 * 0.7 ** 4)  # from the batch's 3, not from 0
    policy.record([0], ["lookup"], [3])
    assert policy.row_source(0, 3, 3) == "lookup"  # row 0's own averages: lookup 0.9, drafter 0.72
    assert policy.row_source(2, 3, 3) == "drafter"  # a new row follows the batch's: drafter beats lookup


def test_rejection_sample_one_hot_rows_follow_p():
    torch.manual_seed(0)
    n, v = 40000, 5
    p = torch.softmax(torch.randn(1, 3, v) * 1.5, dim=-1).expand(n, 3, v)
    drafts = torch.tensor([[int(p[0, 0].argmax()), 1]]).expand(n, 2)
    accepted, nxt = rejection_sample(p, None, drafts, torch.full((n,), 2))  # q=None: every row deterministic
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    assert 0.5 * (torch.bincount(first, minlength=v).float() / n - p[0, 0]).abs().sum() < 0.02
    assert abs(accepted.gt(0).float().mean() - p[0, 0, drafts[0, 0]]) < 0.02  # accepted with probability p(d)
    # q=None equals an explicit one-hot q, and a one_hot row mask overrides the drafter's q for those rows.
    point = torch.nn.functional.one_hot(drafts, v).float()
    g = [torch.Generator().manual_seed(3) for _ in range(3)]
    a1, t1 = rejection_sample(p, None, drafts, torch.full((n,), 2), g[0])
    a2, t2 = rejection_sample(p, point, drafts, torch.full((n,), 2), g[1])
    a3, t3 = rejection_sample(p, torch.rand(n, 2, v).softmax(-1), drafts, torch.full((n,), 2), g[2],
                              one_hot=torch.ones(n, dtype=torch.bool))
    assert torch.equal(a1, a2) and torch.equal(t1, t2) and torch.equal(a1, a3) and torch.equal(t1, t3)


@pytest.mark.parametrize("speculation", ["auto", "always"])
def test_hybrid_greedy_rows_equal_bs1_generate(speculation):
    target = make_tiny_target(seed=21)
    prompts = _mixed_prompts(8, seed=21)
    max_new = 24
    drafter = _drafter(target, block_size=5, allow_no_draft=speculation == "auto")
    out, stats = generate_batch(target, drafter, prompts, max_new, return_stats=True,
                                runtime=SpeculationRuntime(cost_model=COST))
    assert out == [_reference(target, p, max_new) for p in prompts]
    accepted, verified = _lookup_stats(stats)
    assert accepted > 0 and verified > 0  # rows verified (and the target accepted) lookup continuations
    assert {s for row in stats.sources for s in row} <= {"drafter", "lookup", "none"}
    assert stats.drafter_forwards + stats.plain_rounds + stats.lookup_rounds == stats.rounds
    if speculation == "always":
        assert stats.lookup_rounds == 0 and max(stats.verify_widths) <= 5  # lookup never widens the block
    else:
        assert stats.lookup_rounds > 0  # the switch tried lookup-only rounds


def test_hybrid_off_keeps_the_drafter_only_engine():
    target = make_tiny_target(seed=22)
    prompts = _mixed_prompts(6, seed=22)
    out, stats = generate_batch(target, _drafter(target, hybrid=False, allow_no_draft=True), prompts, 16,
                                return_stats=True, runtime=SpeculationRuntime(cost_model=COST))
    assert out == [_reference(target, p, 16) for p in prompts]
    assert stats.lookup_rounds == 0 and "lookup" not in {s for row in stats.sources for s in row}


def test_lookup_is_cut_to_the_verify_width_of_speculative_rounds():
    target = make_tiny_target(seed=23)
    prompts = _mixed_prompts(6, seed=23)
    out, stats = generate_batch(target, _drafter(target, block_size=8), prompts, 20, fixed_length=2,
                                return_stats=True)
    assert out == [_reference(target, p, 20) for p in prompts]
    assert _lookup_stats(stats)[1] > 0
    assert max(v for row in stats.verified for v in row) <= 2 and max(stats.verify_widths) == 3


class _LookupFirstPolicy(ProposalPolicy):
    """Alternates lookup rounds (when some row has a match) and speculative rounds."""

    def choose(self, rows, lookup_lens, budgets, cost, allow_no_draft=True, explore_every=None, draft_cut=True,
               remaining=None):
        self.round += 1
        return "lookup" if max(lookup_lens) > 0 and self.round % 2 else "draft"


@pytest.mark.parametrize("mode", ["lookup_rounds", "in_speculative_rounds"])
def test_hybrid_sampling_matches_target_distribution(monkeypatch, mode):
    target = make_tiny_target(seed=11, vocab_size=8, hidden_size=32, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.4)
    policy = ProposalPolicy()
    if mode == "lookup_rounds":  # lookup-only rounds (q=None) alternate with speculative rounds
        policy = _LookupFirstPolicy()
    else:  # every row with a match swaps its lookup continuation into a speculative round (mixed q / one-hot rows)
        monkeypatch.setattr(ProposalPolicy, "row_source",
                            lambda self, i, k, d: "lookup" if k > 0 and i % 2 == 0 else "drafter")
    prompt, n, new = [5, 1, 2, 5, 1, 2, 5, 1], 600, 5
    torch.manual_seed(0)
    out, stats = generate_batch(target, _drafter(target, block_size=4, seed=2), [prompt] * n, new, do_sample=True,
                                return_stats=True, runtime=SpeculationRuntime(policy=policy))
    accepted, verified = _lookup_stats(stats)
    assert 0 < accepted < verified  # lookup drafts accepted and rejected
    assert (stats.lookup_rounds > 0) == (mode == "lookup_rounds")
    if mode == "in_speculative_rounds":
        assert any(s == "drafter" for row in stats.sources for s in row)
    torch.manual_seed(1)
    plain = target.generate(torch.tensor([prompt] * n), max_new_tokens=new, do_sample=True, temperature=1.0,
                            top_k=0, top_p=1.0)[:, len(prompt):]
    for pos in range(1, new):
        ours = torch.bincount(torch.tensor([o[pos] for o in out]), minlength=8).float() / n
        theirs = torch.bincount(plain[:, pos], minlength=8).float() / n
        assert 0.5 * (ours - theirs).abs().sum() < 0.12, f"position {pos}"


# ---------------------------------------------------------------------------------------------------- OnlineSpec


def test_online_feedback_replays_each_rows_batched_draft(monkeypatch):
    """Each row's feedback (window, positions, block queries) reproduces the row's block from the batched forward,
    and its raw target logits are the target's at the drafted positions."""
    target = make_tiny_target(seed=24)
    drafter = _drafter(target, hybrid=True, block_size=4, seed=24)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", context_window=512))
    feedbacks = []
    monkeypatch.setattr(adapter, "observe", lambda fb, lm_head: feedbacks.append(fb))
    prompts = _mixed_prompts(6, seed=24)
    runner = AdaFlashBatchGenerator(target, drafter)
    drafted, forward = [], BlockDraftProposer.forward

    def recording(self, batch):
        queries, states = forward(self, batch)
        drafted.extend((i, int(pos), states[r]) for r, (i, pos) in enumerate(zip(batch.prompt_idx, batch.next_pos)))
        return queries, states

    monkeypatch.setattr(BlockDraftProposer, "forward", recording)
    max_new = 18
    out, stats = runner.generate(prompts, max_new, return_stats=True)
    references = [p + _reference(target, p, max_new + 4) for p in prompts]
    assert out == [r[len(p): len(p) + max_new] for r, p in zip(references, prompts)]
    expected = sum(s == "drafter" and v > 0 for srcs, ver in zip(stats.sources, stats.verified)
                   for s, v in zip(srcs, ver))
    assert len(feedbacks) == expected > 0 and "lookup" in {s for row in stats.sources for s in row}
    for fb in feedbacks:
        anchor = int(fb.position_ids[0, fb.context.shape[1]])
        assert torch.equal(fb.position_ids[0], torch.arange(anchor + 4))  # the whole context, true positions
        with torch.no_grad():
            replay = drafter(noise_embeds=fb.noise_embeds, context_hidden_states=fb.context,
                             position_ids=fb.position_ids).last_hidden_state[0]
        rows = [i for i, pos, states in drafted if pos == anchor and torch.allclose(states, replay, atol=1e-4)]
        assert len(rows) >= 1
        ref, a = references[rows[0]], fb.num_accepted
        # Up to the first rejection the target's greedy tokens are the reference continuation.
        assert fb.target_tokens[: a + 1].tolist() == ref[anchor + 1 : anchor + 2 + a][: fb.num_drafted]


@pytest.mark.parametrize("hybrid, mode", [(False, "round"), (True, "round"), (True, "request"), (True, "background")])
def test_online_adapter_in_batches_is_lossless_and_learns_across_calls(hybrid, mode):
    target = make_tiny_target(seed=25)
    drafter = _drafter(target, hybrid=hybrid, block_size=4, seed=25)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(learning_rate=0.01, context_window=6,
                                                                 update_mode=mode, learn_while_paying=False))
    lora_b = [m.lora_B["online"].weight for m in drafter.modules() if isinstance(m, BaseTunerLayer)]
    snapshots, rounds = [], []
    for call in range(2):
        prompts = _mixed_prompts(5, seed=25 + call)
        out, stats = generate_batch(target, drafter, prompts, 16, return_stats=True, max_batch_size=3,
                                    continuous=True)
        assert out == [_reference(target, p, 16) for p in prompts], f"call {call}: the adapter changed the output"
        adapter.finish()
        drafted = sum(s == "drafter" and v > 0 for srcs, ver in zip(stats.sources, stats.verified)
                      for s, v in zip(srcs, ver))
        rounds.append(adapter.stats.rounds)
        # round mode: one feedback per drafter row-round; sequence modes: one per served request (all of its tokens)
        expected = drafted if mode == "round" else len(prompts)
        assert rounds[-1] - (rounds[-2] if call else 0) == expected > 0
        snapshots.append([b.detach().clone() for b in lora_b])
        assert stats.seconds["online"] > 0
    assert adapter.stats.updates == adapter.stats.rounds and adapter.stats.skipped == 0
    if mode != "round":
        assert min(adapter.stats.positions) > 8  # every committed position of a request teaches
    assert any(b.abs().sum() > 0 for b in snapshots[0])  # learned during the first call
    assert any(not torch.equal(x, y) for x, y in zip(*snapshots))  # and kept learning from that state


FLAT = device_cost({1: {1: 1.0, 8: 1.0}, 8: {1: 1.0, 8: 1.0}}, draft=0.5)  # every width costs the same


PHRASE_PROMPTS = [([5, 9, 14, 3, 27, 11, 8, 30] * 5)[: 20 + 3 * r] for r in range(4)]  # lookup finds 8-token matches


def _verified_widths(target, drafter, prompts, reference, max_new, counted):
    """Both engines decode `prompts` (outputs checked against `reference`); the verify widths of the rows whose
    source passes `counted`: `(bs=1 widths, batched widths)`."""
    bs1 = []
    for p, ref in zip(prompts, reference):
        out, stats = speculate(target, torch.tensor([p]), drafter, max_new_tokens=max_new, do_sample=False)
        assert out[0, len(p):].tolist() == ref
        bs1 += [n for n, s in zip(stats.drafted, stats.proposers) if counted(s)]
    out, stats = generate_batch(target, drafter, prompts, max_new, return_stats=True)
    assert out == reference
    batch = [v for srcs, ver in zip(stats.sources, stats.verified) for s, v in zip(srcs, ver) if counted(s)]
    return bs1, batch


def test_lookup_reaches_prompt_lookup_num_tokens_past_the_block_and_both_engines_verify_the_policys_width(
        monkeypatch):
    """Lookup continuations are capped by `prompt_lookup_num_tokens` (8 here), not by the drafter's block (3
    drafted tokens): on a flat-cost device whole 8-token matches are verified. With the policy's width forced to 2,
    every lookup round and every drafted block verifies at most 2 tokens in both engines. Outputs stay greedy."""
    target = make_tiny_target(seed=23)
    reference = [_reference(target, p, 24) for p in PHRASE_PROMPTS]

    def widths():
        drafter = _drafter(target, block_size=4, allow_no_draft=True, prompt_lookup_num_tokens=8)
        SpeculationRuntime(cost_model=FLAT).attach(drafter)
        return _verified_widths(target, drafter, PHRASE_PROMPTS, reference, 24, lambda s: s != "none")

    bs1, batch = widths()
    assert max(bs1) == 8 and max(batch) == 8  # past the block's 3 drafted tokens
    real_cut = ProposalPolicy.cut
    monkeypatch.setattr(ProposalPolicy, "cut", lambda self, arm: None if real_cut(self, arm) is None else 2)
    bs1, batch = widths()
    narrow = [n for n in bs1 + batch if n <= 2]
    assert len(narrow) > len(bs1 + batch) // 2 and 2 in narrow  # exploration rounds still verify all


def test_a_lookup_swapped_into_a_draft_round_is_cut_to_the_drafted_width_in_both_engines():
    """Where every round drafts (`allow_no_draft=False`), a row's lookup continuation replaces its block only at
    the block's width: both engines verify at most the 3 drafted tokens although matches reach 8 tokens."""
    target = make_tiny_target(seed=23)
    reference = [_reference(target, p, 24) for p in PHRASE_PROMPTS]
    drafter = _drafter(target, block_size=4, allow_no_draft=False, prompt_lookup_num_tokens=8)
    SpeculationRuntime(cost_model=FLAT).attach(drafter)
    bs1, batch = _verified_widths(target, drafter, PHRASE_PROMPTS, reference, 24, lambda s: s == "lookup")
    assert bs1 and batch and max(bs1) == 3 and max(batch) == 3


def test_both_engines_score_unverified_lookups_in_hindsight(monkeypatch):
    """Rounds that found a lookup continuation but verified something else hand it to `record_hindsight` with what
    they committed (matched <= known, and known = the round's committed tokens); outputs stay greedy."""
    target = make_tiny_target(seed=23)
    prompts = _mixed_prompts(6, seed=3)
    reference = [_reference(target, p, 24) for p in prompts]
    calls = []
    real = ProposalPolicy.record_hindsight

    def spy(self, rows, matched, known, lengths):
        calls.append([(a, k, n) for a, k, n in zip(matched, known, lengths) if n > 0])
        return real(self, rows, matched, known, lengths)

    monkeypatch.setattr(ProposalPolicy, "record_hindsight", spy)
    drafter = _drafter(target, block_size=4, allow_no_draft=True, prompt_lookup_num_tokens=8)
    SpeculationRuntime(cost_model=device_cost({1: {1: 1.0, 4: 1.6}, 8: {1: 2.0, 4: 4.0}}, draft=0.2)).attach(drafter)
    for p, ref in zip(prompts, reference):
        out, _ = speculate(target, torch.tensor([p]), drafter, max_new_tokens=24, do_sample=False)
        assert out[0, len(p):].tolist() == ref
    bs1, calls[:] = [c for call in calls for c in call], []
    out = generate_batch(target, drafter, prompts, 24)
    assert out == reference
    batch = [c for call in calls for c in call]
    for seen in (bs1, batch):
        assert seen and all(0 <= a <= k and a <= n for a, k, n in seen)
        assert any(a > 0 for a, _, _ in seen)  # the repeated phrase: unverified continuations that were right
