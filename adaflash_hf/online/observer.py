# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The one interface both decoding engines talk to an online learner through: `on_round` and `on_request_end`.

The bs=1 candidate generator and the batched engine call these hooks and nothing else of the adapter's learning API;
what a hook builds from the served data (`online/feedback.py`) and how the learner uses it is the adapter's business.
Like a `transformers.TrainerCallback`, a hook receives plain tensors and returns nothing the engine must read.
"""

import torch

from .feedback import RoundFeedback, SequenceFeedback


class OnlineObserver:
    """Mixin of `OnlineSpecAdapter`: the engine-facing hooks (module docstring). Needs `observe`,
    `observe_sequence`, `skip_unpaid_request`, `requests_seen`, `config` and `drafter` from the adapter."""

    def on_round(self, noise_embeds: torch.Tensor, context: torch.Tensor, position_ids: torch.Tensor,
                 raw_logits: torch.Tensor, num_accepted: int, lm_head, draft_logits: torch.Tensor | None = None) -> None:
        """One drafter round was verified (`update_mode="round"`).

        Args:
            noise_embeds: `[1, B, H]` the block queries of the drafting forward; context: `[1, W, F]` the target's
                hidden states the drafter read (its window); position_ids: `[1, W + B]`.
            raw_logits: `[n, V]` the target's RAW logits at the `n` verified drafted positions.
            num_accepted: drafted tokens the target accepted.
            draft_logits: the drafting forward's own logits `[n, K]` with their graph, when it may be reused.
        """
        feedback = RoundFeedback.from_round(self.drafter, noise_embeds, context, position_ids, raw_logits,
                                            num_accepted, draft_logits=draft_logits)
        self.observe(feedback, lm_head)

    def on_request_end(self, input_ids: torch.Tensor, context: torch.Tensor, prompt_len: int, num_accepted: int,
                       num_drafted: int, embeddings, lm_head) -> None:
        """A request was served (`update_mode` "request" or "background").

        Args:
            input_ids: `[T']` the prompt + every committed token; context: `[T, F]` the target's hidden states of the
                first `T <= T'` positions; prompt_len: prompt tokens.
            num_accepted / num_drafted: drafted tokens accepted / proposed in the request's drafter rounds.
            embeddings / lm_head: the target's input embeddings and LM head.
        """
        if self.skip_unpaid_request(lm_head):  # learning is not paying: this request only counts
            return
        feedback = SequenceFeedback.from_sequence(
            self.drafter, embeddings, input_ids, context, prompt_len, num_accepted, num_drafted,
            self.config.anchors_per_update, torch.Generator().manual_seed(self.config.seed + self.requests_seen))
        self.observe_sequence(feedback, lm_head)


__all__ = ["OnlineObserver"]
