"""Batched speculative decoding (`adaflash_hf.generation.batch`): lossless per row, on tiny random targets."""

import pytest
import torch
from transformers import DynamicCache

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.generation import SpeculationRuntime
from adaflash_hf.generation.batch import (
    AdaFlashBatchGenerator,
    batched_generate,
    generate_batch,
    rejection_sample,
)
from adaflash_hf.generation.cost_model import TargetCostModel, verify_lengths
from adaflash_hf.generation.policy import ProposalPolicy
from adaflash_hf.generation.prefill import CPU_OVERHEAD_TOKENS, prefill_groups
from adaflash_hf.generation.proposers import BlockDraftProposer
from adaflash_hf.generation.ragged_cache import RaggedCache
from adaflash_hf.models.length_head import AdaFlashLengthHead, AdaFlashLengthHeadConfig

from .conftest import ALWAYS_DRAFT, VOCAB, build_drafter, device_cost, make_tiny_target, with_knobs


class BatchedOracle(AdaFlashDrafterModel):
    """Drafts each row's reference continuation with controlled errors (a batched `OracleDrafter`).

    The row -> prompt mapping comes from the generator (`active_prompt_indices`), the anchor position from
    `position_ids`. The real drafter forward runs first, so the batched DFlash cache bookkeeping is exercised.
    """

    def setup_oracle(self, target, references: list[list[int]], runner_fn, error_rate=0.3, seed=0):
        self._head = target.lm_head.weight.detach()
        self._references, self._runner_fn = references, runner_fn
        self._error_rate = error_rate
        self._rng = torch.Generator().manual_seed(seed)
        return self

    def forward(self, noise_embeds, context_hidden_states=None, attention_mask=None, position_ids=None, cache=None,
                **kw):
        out = super().forward(noise_embeds, context_hidden_states, attention_mask, position_ids, cache, **kw)
        block = noise_embeds.shape[1]
        runner = self._runner_fn()
        rows = runner.active_prompt_indices
        assert len(rows) == noise_embeds.shape[0]
        # Bookkeeping invariants of the batch: cache slots match the masks, positions count valid slots only.
        state = runner.active_state
        state.target.check_consistent()
        assert torch.equal(state.target.valid_counts(), state.next_pos)
        states = out.last_hidden_state.clone()
        vocab = self._head.shape[0]
        for r, prompt_idx in enumerate(rows):
            reference = self._references[prompt_idx]
            anchor_pos = int(position_ids[r, -block])
            for k in range(1, block):
                pos = anchor_pos + k
                token = reference[pos] if pos < len(reference) else 0
                if torch.rand(1, generator=self._rng).item() < self._error_rate:
                    token = (token + 1 + int(torch.randint(0, vocab - 1, (1,), generator=self._rng))) % vocab
                states[r, k] = self._head[token] * 10.0
        out.last_hidden_state = states
        return out


def _prompts(n, seed=0, min_len=2, max_len=24, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g)
    return [torch.randint(0, vocab, (int(length),), generator=g).tolist() for length in lengths]


def _reference(target, prompt, max_new):
    """Plain greedy `generate` of one prompt alone (bs=1, no padding): the new tokens."""
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def _oracle_runner(target, prompts, max_new, block_size=5, error_rate=0.3, seed=0, knobs=None, runtime=None,
                   **runner_kwargs):
    """An engine over a `BatchedOracle`; `knobs`: generation-config overrides (default: every round drafts)."""
    references = [p + _reference(target, p, max_new + block_size) for p in prompts]
    torch.manual_seed(seed)
    config = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=block_size).config
    drafter = with_knobs(BatchedOracle(config).eval(), **{**ALWAYS_DRAFT, **(knobs or {})})
    runner = AdaFlashBatchGenerator(target, drafter, runtime=runtime, **runner_kwargs)
    drafter.setup_oracle(target, references, lambda: runner, error_rate=error_rate, seed=seed)
    return runner


def _random_drafter(target, block_size=4, seed=1, **knobs):
    return build_drafter(target, block_size=block_size, seed=seed, **knobs)


def _head(drafter, bias=None, seed=0):
    torch.manual_seed(seed)
    config = AdaFlashLengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.config.block_size,
                                      head_dim=16)
    head = AdaFlashLengthHead(config).eval()
    if bias is not None:  # a head that always predicts acceptance (+) or rejection (-)
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(bias)
    return head


COST = device_cost({1: {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}, 8: {1: 2.0, 2: 2.2, 4: 2.6, 8: 3.4}}, draft=0.2)


# ---------------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_oracle_greedy_rows_equal_bs1_generate(block_size):
    target = make_tiny_target(seed=block_size)
    prompts = _prompts(8, seed=block_size)
    max_new = 20
    runner = _oracle_runner(target, prompts, max_new, block_size=block_size, error_rate=0.3, seed=block_size)
    out, stats = runner.generate(prompts, max_new, return_stats=True)
    for i, prompt in enumerate(prompts):
        assert out[i] == _reference(target, prompt, max_new), f"row {i} differs from plain greedy"
    assert sum(map(sum, stats.accepted)) > stats.rounds  # the oracle's drafts were mostly accepted
    # One drafter forward per round, except rounds where no row may draft (one token left): the drafter is skipped.
    assert stats.rounds - 1 <= stats.drafter_forwards <= stats.rounds
    # no cost model (every round drafts): a CPU prefills in length groups (`prefill.py`)
    assert stats.prefill_forwards == len(prefill_groups([len(p) for p in prompts], CPU_OVERHEAD_TOKENS))
    assert all(len(c) - 1 == len(v) for c, v in zip(stats.committed, stats.verified))
    assert [sum(c) for c in stats.committed] == [len(o) for o in out]


def test_random_drafter_greedy_rows_equal_bs1_generate():
    target = make_tiny_target(seed=1)
    drafter = _random_drafter(target, block_size=4)
    prompts = _prompts(10, seed=1)
    out, stats = generate_batch(target, drafter, prompts, 18, return_stats=True)
    assert out == [_reference(target, p, 18) for p in prompts]
    assert stats.rounds >= 17 - 1  # a random drafter accepts (almost) nothing
    assert stats.compactions > 0  # rejected slots piled up and were compacted away


def test_plain_batched_decoding_without_drafter():
    target = make_tiny_target(seed=2)
    prompts = _prompts(5, seed=2)
    out, stats = generate_batch(target, None, prompts, 12, return_stats=True)
    assert out == [_reference(target, p, 12) for p in prompts]
    assert stats.drafter_forwards == 0 and set(stats.verify_widths) == {1}


def test_eos_stops_rows_independently():
    target = make_tiny_target(seed=3)
    prompts = _prompts(6, seed=3)
    long_refs = [_reference(target, p, 30) for p in prompts]
    # A token the target first emits mid-stream in row 0.
    first = next(k for k in range(6, 30) if long_refs[0][k] not in long_refs[0][:k])
    target.generation_config.eos_token_id = long_refs[0][first]
    expected = [_reference(target, p, 30) for p in prompts]
    lengths = [len(e) for e in expected]
    assert lengths[0] == first + 1 and max(lengths) == 30
    runner = _oracle_runner(target, prompts, 30, block_size=8, error_rate=0.0)
    assert runner.generate(prompts, 30) == expected
    # The target.generate-style entry point: the same tensor as a padded batched `generate` (pad = EOS after a stop).
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, ids.shape[1] - len(p):] = torch.tensor(p)
        mask[r, ids.shape[1] - len(p):] = 1
    ours = batched_generate(target, ids, mask, _random_drafter(target, block_size=8), max_new_tokens=30)
    theirs = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)


@pytest.mark.parametrize("continuous", [True, False])
def test_more_prompts_than_max_batch_size(continuous):
    target = make_tiny_target(seed=4)
    prompts = _prompts(9, seed=4)
    max_new = 16
    expected = [_reference(target, p, max_new) for p in prompts]
    # Different stop times per row so that slots free up at different rounds.
    target.generation_config.eos_token_id = expected[2][5]
    expected = [_reference(target, p, max_new) for p in prompts]
    runner = _oracle_runner(target, prompts, max_new, block_size=4, error_rate=0.4, seed=4)
    out, stats = runner.generate(prompts, max_new, max_batch_size=3, continuous=continuous, return_stats=True)
    assert out == expected
    assert max(stats.batch_sizes) == 3 and stats.prefill_forwards >= 3
    if continuous:  # waiting prompts joined the running batch as rows finished
        assert stats.prefill_joins >= 2
    else:
        assert stats.prefill_joins == 0 and stats.prefill_forwards == 3


@pytest.mark.parametrize("policy", ["fixed_full", "fixed_2", "fixed_0", "head", "head_rejects", "head_accepts"])
def test_length_policies_are_lossless(policy):
    target = make_tiny_target(seed=5)
    prompts = _prompts(6, seed=5)
    max_new, block = 20, 6
    knobs = {
        "fixed_full": dict(length_policy="full", num_assistant_tokens=block - 1),
        "fixed_2": dict(length_policy="full", num_assistant_tokens=2),
        "fixed_0": dict(length_policy="full"),
    }.get(policy, {"length_policy": "head"})
    runtime = None
    if policy.startswith("head"):
        bias = {"head": None, "head_rejects": -20.0, "head_accepts": 20.0}[policy]
        runtime = SpeculationRuntime(length_head=_head(_random_drafter(target, block_size=block), bias),
                                     cost_model=COST)
    runner = _oracle_runner(target, prompts, max_new, block_size=block, error_rate=0.3, seed=5, knobs=knobs,
                            runtime=runtime)
    if policy == "fixed_0":  # fixed_length=0: no drafting at all (plain batched decoding)
        out, stats = generate_batch(target, runner.drafter, prompts, max_new, fixed_length=0, return_stats=True)
    else:
        out, stats = runner.generate(prompts, max_new, return_stats=True)
    assert out == [_reference(target, p, max_new) for p in prompts]
    verified = [v for row in stats.verified for v in row]
    if policy in ("fixed_0", "head_rejects"):
        assert set(verified) == {0} and set(stats.verify_widths) == {1}
    elif policy == "fixed_2":
        assert max(verified) == 2
    elif policy in ("fixed_full", "head_accepts"):
        assert max(verified) == block - 1
        assert sum(map(sum, stats.accepted)) > 0


def test_verify_lengths_joint_choice():
    survival = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.01, 0.0, 0.0, 0.0]])
    budgets = torch.tensor([4, 4])
    flat = TargetCostModel(points={2: {1: 1.0, 8: 1.0}})  # verifying more is free: everything
    assert verify_lengths(survival, budgets, flat).tolist() == [4, 4]
    steep = TargetCostModel(points={2: {1: 1.0, 2: 10.0, 8: 80.0}})  # every extra token is very expensive
    assert verify_lengths(survival, budgets, steep).tolist() == [0, 0]
    both = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.9, 0.8, 0.7, 0.6]])
    assert verify_lengths(both, torch.tensor([1, 3]), flat).tolist() == [1, 3]  # budgets cap rows
    # Ties (no row gains anything from more tokens) pick the shortest length.
    assert verify_lengths(torch.zeros(2, 4), budgets, flat).tolist() == [0, 0]
    assert verify_lengths(survival, budgets, None).tolist() == [4, 4]


def test_draft_vocabulary_with_batches():
    target = make_tiny_target(seed=6)
    prompts = _prompts(5, seed=6)
    runner = _oracle_runner(target, prompts, 15, block_size=5, error_rate=0.1, seed=6)
    runner.drafter.set_draft_vocab(torch.arange(0, VOCAB, 2))
    out, stats = runner.generate(prompts, 15, return_stats=True)
    assert out == [_reference(target, p, 15) for p in prompts]
    assert sum(map(sum, stats.accepted)) > 0


def test_aggressive_compaction_and_tensor_input():
    target = make_tiny_target(seed=7)
    prompts = _prompts(6, seed=7)
    runner = _oracle_runner(target, prompts, 14, block_size=4, error_rate=0.5, seed=7, compact_min_waste=0,
                            compact_ratio=0.0)
    ids = torch.zeros(len(prompts), 30, dtype=torch.long)  # right-padded: any padding layout is accepted
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, : len(p)], mask[r, : len(p)] = torch.tensor(p), 1
    out, stats = runner.generate(ids, 14, attention_mask=mask, return_stats=True)
    assert out == [_reference(target, p, 14) for p in prompts]
    assert stats.compactions > 0


def test_ragged_cache_merge_select_compact_keep_attention():
    """A row's attention over a RaggedCache is unchanged by merge / select / compact (masked slots are inert)."""
    torch.manual_seed(0)
    b, h, s, d = 3, 2, 7, 4

    def make(batch, slots):
        cache = DynamicCache()
        cache.update(torch.randn(batch, h, slots, d), torch.randn(batch, h, slots, d), 0)
        return RaggedCache(cache, torch.rand(batch, slots) > 0.4)

    def attend(rc, row, query):
        keys, values = rc.cache.layers[0].keys[row], rc.cache.layers[0].values[row]
        m = rc.mask[row]
        return torch.softmax(query @ keys[:, m].transpose(-1, -2), dim=-1) @ values[:, m]

    a, other = make(b, s), make(2, 4)
    q = torch.randn(h, 1, d)
    before = [attend(a, r, q) for r in range(b)] + [attend(other, r, q) for r in range(2)]
    a.merge(other)
    assert a.num_slots == s and a.batch_size == 5
    assert all(torch.allclose(attend(a, r, q), before[r]) for r in range(5))
    a.select(torch.tensor([4, 0, 2]))
    a.compact()
    assert a.num_slots == int(a.valid_counts().max())
    assert all(torch.allclose(attend(a, r, q), before[i]) for r, i in enumerate([4, 0, 2]))


# ---------------------------------------------------------------------------------------------------- plain fallback


def test_always_wrong_drafter_falls_back_to_plain_rounds():
    target = make_tiny_target(seed=12)
    prompts = _prompts(6, seed=12)
    max_new = 30
    runner = _oracle_runner(target, prompts, max_new, block_size=5, error_rate=1.0, seed=12,
                            knobs={"allow_no_draft": True}, runtime=SpeculationRuntime(cost_model=COST))
    out, stats = runner.generate(prompts, max_new, return_stats=True)
    assert out == [_reference(target, p, max_new) for p in prompts]
    assert sum(map(sum, stats.accepted)) == 0
    assert stats.plain_rounds >= 2 * stats.rounds // 3 and stats.drafter_forwards <= stats.rounds // 3
    assert stats.drafter_forwards + stats.plain_rounds == stats.rounds


def test_perfect_drafter_keeps_speculating():
    target = make_tiny_target(seed=13)
    prompts = _prompts(4, seed=13)
    runner = _oracle_runner(target, prompts, 24, block_size=6, error_rate=0.0, seed=13,
                            knobs={"allow_no_draft": True}, runtime=SpeculationRuntime(cost_model=COST))
    out, stats = runner.generate(prompts, 24, return_stats=True)
    assert out == [_reference(target, p, 24) for p in prompts]
    assert stats.drafter_forwards > stats.plain_rounds


class _ScriptedPolicy(ProposalPolicy):
    """Drafts every third round and decodes plainly otherwise."""

    def choose(self, rows, lookup_lens, budgets, cost, allow_no_draft=True, explore_every=None, draft_cut=True,
               remaining=None):
        self.round += 1
        return "draft" if self.round % 3 == 1 else "plain"


def test_plain_rounds_keep_the_drafter_context(monkeypatch):
    """After plain rounds the drafter sees the skipped context: its block equals that of an always-drafting run."""
    target = make_tiny_target(seed=14)
    prompts = _prompts(4, seed=14)
    forward = BlockDraftProposer.forward

    def blocks(runtime):
        runner = AdaFlashBatchGenerator(target, _random_drafter(target, block_size=4, seed=3), runtime=runtime)
        seen = {}

        def recording(self, batch):
            anchors = list(zip(batch.prompt_idx, batch.next_pos.tolist()))
            queries, states = forward(self, batch)
            seen.update({key: states[r] for r, key in enumerate(anchors)})
            return queries, states

        monkeypatch.setattr(BlockDraftProposer, "forward", recording)
        out, stats = runner.generate(prompts, 16, return_stats=True)
        return out, stats, seen

    out_always, _, always = blocks(None)
    out_scripted, stats, scripted = blocks(SpeculationRuntime(policy=_ScriptedPolicy(), cost_model=COST))
    assert out_scripted == out_always == [_reference(target, p, 16) for p in prompts]
    assert stats.plain_rounds > stats.drafter_forwards > 1
    common = set(always) & set(scripted)
    assert len(common) >= stats.drafter_forwards
    for key in common:
        torch.testing.assert_close(scripted[key], always[key], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------- sampling


def test_rejection_sample_outputs_follow_p():
    torch.manual_seed(0)
    n, v = 40000, 5
    p = torch.softmax(torch.randn(1, 3, v) * 1.5, dim=-1).expand(n, 3, v)
    q = torch.softmax(torch.randn(1, 2, v) * 1.5, dim=-1).expand(n, 2, v)
    drafts = torch.multinomial(q.reshape(-1, v), 1).view(n, 2)
    accepted, nxt = rejection_sample(p, q, drafts, torch.full((n,), 2))
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=v).float() / n
    assert 0.5 * (freq - p[0, 0]).abs().sum() < 0.02
    assert 0 < accepted.float().mean() < 2  # both acceptances and rejections happened
    # A row that verifies 0 drafts samples straight from p.
    accepted0, nxt0 = rejection_sample(p, q, drafts, torch.zeros(n, dtype=torch.long))
    assert accepted0.eq(0).all()
    assert 0.5 * (torch.bincount(nxt0, minlength=v).float() / n - p[0, 0]).abs().sum() < 0.02


def test_sampling_matches_target_distribution():
    # A tiny vocabulary and a flat-ish target so that drafts are accepted and rejected often.
    target = make_tiny_target(seed=11, vocab_size=8, hidden_size=32, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.4)
    drafter = _random_drafter(target, block_size=4, seed=2)
    prompt, n, positions = [5, 1, 2], 600, [1, 2]
    torch.manual_seed(0)
    out, stats = generate_batch(target, drafter, [prompt] * n, 3, do_sample=True, return_stats=True)
    accepted, verified = sum(map(sum, stats.accepted)), sum(map(sum, stats.verified))
    assert 0 < accepted < verified  # drafts were both accepted and rejected: rejection sampling ran
    torch.manual_seed(1)
    plain = target.generate(torch.tensor([prompt] * n), max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0,
                            top_p=1.0)[:, len(prompt):]
    for pos in positions:
        ours = torch.bincount(torch.tensor([o[pos] for o in out]), minlength=8).float() / n
        theirs = torch.bincount(plain[:, pos], minlength=8).float() / n
        total_variation = 0.5 * (ours - theirs).abs().sum()
        assert total_variation < 0.12, f"position {pos}: TV={float(total_variation):.3f}"


def test_sliding_window_targets_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    target = MistralForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="DynamicLayer"):
        generate_batch(target, None, [[1, 2, 3]], 4)


def test_batch_tau_is_the_shared_tau():
    """Both engines' statistics compute tau with the one helper (`utils.speculation.tau`), pooled over rows."""
    from adaflash_hf.generation.stats import BatchStats, SpeculationStats
    from adaflash_hf.utils.speculation import tau

    stats = BatchStats.for_prompts(2)
    stats.accepted = [[2, 0], [3]]
    assert stats.tau == tau([2, 0, 3]) == pytest.approx(5 / 3 + 1)
    assert SpeculationStats(accepted=[2, 0, 3]).tau == stats.tau
    assert BatchStats.for_prompts(1).tau == 0.0
