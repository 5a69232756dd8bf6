"""OnlineSpec persistence: a saved adapter resumes exactly (learner state included), a failed load leaves the
drafter as it was, and the safety window is checked once per window of measured rounds."""

import torch

from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig, SequenceFeedback

from .conftest import VOCAB, build_drafter, make_tiny_target


# ------------------------------------------------------------------------------------------------ safety window


def _sequence_feedback(drafter, target, seed: int, drafted: int, accepted: int) -> SequenceFeedback:
    """A served request of 24 tokens with random context states, `accepted` of `drafted` drafted tokens accepted."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (24,), generator=g)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    return SequenceFeedback.from_sequence(drafter, target.get_input_embeddings(), ids, torch.randn(23, width,
                                          generator=g), 6, accepted, drafted, 8, torch.Generator().manual_seed(seed))


def test_a_request_without_drafter_rounds_does_not_re_snapshot_the_good_state():
    """The safety check runs once per `rollback_window` measured rounds. A request served without drafter rounds
    measures none: it used to re-run the check on the same window and take the state after its update as the new
    "good" snapshot, so a later rollback restored that state instead of the last one checked."""
    target = make_tiny_target(seed=4)
    drafter = build_drafter(target, seed=4)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(learning_rate=0.05, learn_while_paying=False,
                                                                 rollback_window=2, rollback_drop=0.5))
    params = lambda: [p.detach().clone() for p in adapter.lora_parameters("online")]  # noqa: E731
    for seed in (0, 1):  # a checked window, everything accepted: the good snapshot
        adapter.observe_sequence(_sequence_feedback(drafter, target, seed, drafted=4, accepted=4), target.lm_head)
    checked = params()
    result = adapter.observe_sequence(_sequence_feedback(drafter, target, 2, drafted=0, accepted=0), target.lm_head)
    assert result["updated"] and not result["rolled_back"]  # it still teaches
    unchecked = params()
    assert any(not torch.equal(a, b) for a, b in zip(checked, unchecked))
    for seed in (3, 4):  # acceptance collapses over the next window: roll back to the last CHECKED state
        result = adapter.observe_sequence(_sequence_feedback(drafter, target, seed, drafted=4, accepted=0),
                                          target.lm_head)
    assert result["rolled_back"] and adapter.stats.rollbacks == [4]
    assert all(torch.equal(a, b) for a, b in zip(params(), checked))
