# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`AdaFlashCandidateGenerator`: our candidate generator for transformers' assisted-decoding loop.

It subclasses transformers' `DFlashTokenCandidateGenerator` and keeps its contract with `_assisted_decoding`
(the target's hidden states at `target_layer_ids` come back in `model_outputs`; the drafter's `DFlashCache` holds
the projected context; the block's cache entries are cropped every round). On top it:

* never proposes past `max_length` (the native generator always proposes `block_size - 1` tokens and lets the
  loop discard the overflow after verifying it),
* runs a drafter whose dtype differs from the target's (e.g. a bf16 drafter beside an fp32 target),
* records per-round statistics (`drafter.generation_stats`): tokens drafted / accepted and drafting time, from
  which tau (tokens committed per verification forward) is computed.

Losslessness does not depend on anything here: the target verifies every candidate in `_assisted_decoding`,
greedy keeps the longest matching prefix and sampling applies transformers' `_speculative_sampling` (the
rejection-sampling rule) to the candidate logits we return.
"""

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator, PromptLookupCandidateGenerator

from ..models.length_head import probability_features
from .cost_model import best_length
from .policy import ProposalPolicy


@dataclass
class SpeculationStats:
    """Per-`generate` statistics of one speculative run (batch size 1).

    `accepted[i]` drafted tokens were accepted out of `drafted[i]` proposed in verification round `i`; every round
    also commits one token from the target (the correction or bonus token), so tau = mean(accepted) + 1.
    """

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposers: list[str] = field(default_factory=list)
    survival: list[list[float]] = field(default_factory=list)
    draft_seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Tokens committed per verification forward (accepted drafts + the target's own token), prefill excluded."""
        return (sum(self.accepted) / self.rounds + 1.0) if self.rounds else 0.0

    def acceptance_by_position(self, max_positions: int) -> list[float]:
        """P(draft position k is accepted | it was proposed), k = 1..max_positions."""
        rates = []
        for k in range(1, max_positions + 1):
            proposed = sum(1 for d in self.drafted if d >= k)
            accepted = sum(1 for a, d in zip(self.accepted, self.drafted) if d >= k and a >= k)
            rates.append(accepted / proposed if proposed else 0.0)
        return rates


class AdaFlashCandidateGenerator(DFlashTokenCandidateGenerator):
    """Drafts one block per round with an AdaFlash/DFlash drafter (see the module docstring).

    Args:
        assistant_model: the drafter (`AdaFlashDrafterModel` or any model with the DFlash forward contract).
        main_model_input_embeddings / main_model_output_embeddings: the target's embedding table and LM head.
        generation_config: the target's generation config of this `generate` call.
        logits_processor: processors applied to drafted logits (needed for sampling to stay exact).
    """

    def __init__(
        self,
        assistant_model: nn.Module,
        main_model_input_embeddings: nn.Embedding,
        main_model_output_embeddings: nn.Linear,
        generation_config,
        logits_processor=None,
        **kwargs,
    ):
        super().__init__(
            assistant_model=assistant_model,
            main_model_input_embeddings=main_model_input_embeddings,
            main_model_output_embeddings=main_model_output_embeddings,
            generation_config=generation_config,
            logits_processor=logits_processor,
            **kwargs,
        )
        self.drafter_dtype = next(assistant_model.parameters()).dtype
        self.vocab_size = main_model_output_embeddings.weight.shape[0]
        # Draft logits are needed to sample, to run logits processors, or to mix draft and target distributions;
        # plain greedy only needs the drafted tokens.
        self.needs_logits = bool(
            generation_config.do_sample
            or (logits_processor is not None and len(logits_processor) > 0)
            or generation_config.assistant_ensemble_weight is not None
        )
        self.stats = SpeculationStats()
        assistant_model.generation_stats = self.stats
        self._last_drafted: int | None = None
        self._last_accepted = 0
        self._pending: list[torch.Tensor] = []  # target context not yet seen by the drafter
        self._block_in_cache = False
        self._cur_len = 0
        self._round_start: float | None = None
        self._last_arm: str | None = None
        self._heuristic_tokens: int | None = None  # state of the "heuristic" length policy

        config = assistant_model.config
        self.lookup = None
        if getattr(config, "hybrid_lookup", False):
            # transformers' own n-gram lookup over the prompt + generated text, consulted every round.
            self.lookup = PromptLookupCandidateGenerator(
                eos_token_id=generation_config._eos_token_tensor,
                num_output_tokens=config.lookup_num_tokens,
                max_matching_ngram_size=config.lookup_max_ngram,
                max_length=generation_config.max_length,
                logits_processor=logits_processor,
                vocab_size=self.vocab_size,
            )
        # The policy's estimates persist on the drafter across generate() calls (they describe drafter + target).
        policy = getattr(assistant_model, "proposal_policy", None)
        if policy is None:
            policy = ProposalPolicy()
            assistant_model.proposal_policy = policy
        self.policy = policy
        # OnlineSpec: an adapter attached to the drafter learns from every drafter round's verification.
        self.online = getattr(assistant_model, "online_adapter", None)
        self._window: torch.Tensor | None = None  # the last `context_window` context states, [1, W, F]
        self._online_round: tuple | None = None  # (noise_embeds, context window, position_ids) of the last draft
        self._deferred: tuple | None = None  # a round whose raw target logits arrive with the next model_outputs

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        model_outputs,
        is_first_iteration: bool,
        n_last_matches: int,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Return `(input_ids + candidates [1, cur_len + n], candidate logits [1, n, vocab] or None)`."""
        now = time.perf_counter()
        if self._round_start is not None and self._last_arm is not None:
            self.policy.record(self._last_arm, self._last_accepted, now - self._round_start)
        self._round_start, self._last_arm = now, None
        if is_first_iteration:  # the loop's first forward is the target's prefill
            return input_ids, None
        self._collect_context(input_ids, model_outputs, n_last_matches)
        if self._deferred is not None:  # logits processors were active: learn from the raw logits of last round
            round_data, n, accepted = self._deferred
            self._deferred = None
            self._learn(round_data, model_outputs.logits[0, -(n + 1) : -1], accepted)
        self._online_round = None
        budget = min(self.block_size - 1, self.main_model_max_length - input_ids.shape[1] - 1)
        if budget <= 0:  # the target still runs one forward for its own next token: a round with no draft
            return self._propose(input_ids, None, arm=None, start=now)

        lookup_ids = None
        if self.lookup is not None:
            candidate_ids, _ = self.lookup.get_candidates(input_ids)
            if candidate_ids.shape[1] > input_ids.shape[1]:
                lookup_ids = candidate_ids
        arm = self.policy.choose(lookup_available=lookup_ids is not None,
                                 allow_none=getattr(self.assistant_model.config, "allow_no_draft", False))
        if arm == "lookup":
            return self._propose(lookup_ids, None, arm, now)
        if arm == "none":
            return self._propose(input_ids, None, arm, now)

        # A single online adapter learns from this very forward: it is recorded with gradients (exact: the cached
        # context keys/values do not depend on the adapter), so learning costs one backward and no replay.
        learn = self.online is not None and self.online.learns_from_draft
        with torch.enable_grad() if learn else contextlib.nullcontext():
            block_states = self._draft_block(input_ids, model_kwargs)
            logits, vocab_ids = self._draft_logits(block_states[:, 1 : 1 + budget])
        if self._online_round is not None:
            self._online_round = (*self._online_round, logits if logits.requires_grad else None)
            logits = logits.detach()
        head = getattr(self.assistant_model, "length_head", None)
        policy = getattr(self.assistant_model, "length_policy", None)
        if head is not None or policy is not None:  # adaptive length: verify only what is likely to be accepted
            if head is not None:
                keep = self._adaptive_length(head, block_states[:, 1 : 1 + budget], logits, now)
            else:
                keep = self._policy_length(policy, logits)
            logits = logits[:, :keep]
            if keep == 0:
                return self._propose(input_ids, None, arm, now)
        if self.needs_logits:
            if vocab_ids is not None:  # back to the full vocabulary: tokens outside the draft vocabulary get -inf
                full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
                logits = full.scatter_(-1, vocab_ids.expand(*logits.shape[:-1], -1), logits)
            candidate_ids, candidate_logits = self._select_tokens(input_ids, logits.to(input_ids.device))
        else:  # greedy: the loop never reads draft logits, so skip building them
            new_ids = logits.argmax(dim=-1)
            if vocab_ids is not None:
                new_ids = vocab_ids[new_ids]
            candidate_ids, candidate_logits = torch.cat([input_ids, new_ids.to(input_ids.device)], dim=-1), None
        return self._propose(candidate_ids, candidate_logits, arm, now)

    def _propose(self, candidate_ids, candidate_logits, arm, start):
        """Book-keeping shared by every kind of round; returns what the loop expects."""
        self._last_arm = arm
        self._last_drafted = candidate_ids.shape[1] - self._cur_len
        self.stats.draft_seconds += time.perf_counter() - start
        self.stats.proposers.append(arm or "none")
        return candidate_ids, candidate_logits

    def _adaptive_length(self, head, states, logits, start) -> int:
        """Number of drafted tokens to verify, from the length head's survival and the target's cost model."""
        features = probability_features(logits) if head.config.num_prob_features else None
        survival = head(block_states=states.to(head.dtype), prob_features=features).survival[0]
        self.stats.survival.append(survival.tolist())
        cost = getattr(self.assistant_model, "cost_model", None)
        return best_length(survival, cost, fixed_seconds=time.perf_counter() - start)

    def _policy_length(self, policy: str, logits: torch.Tensor) -> int:
        """transformers' own assistant-length rules applied to the block (baselines for the length head):

        * `"confidence[:t]"`: `assistant_confidence_threshold` (default t = 0.4): the block is cut after the first
          drafted token whose probability is below t (that token is still verified, as transformers does);
        * `"heuristic"`: `num_assistant_tokens_schedule="heuristic"`: +2 tokens after a fully accepted round, -1
          otherwise (per `generate` call, as transformers' "heuristic_transient"), starting from and capped at the
          full block.
        """
        n = logits.shape[1]
        kind, _, value = policy.partition(":")
        if kind == "confidence":
            top = logits[0].float().softmax(-1).amax(-1)
            low = (top < (float(value) if value else 0.4)).nonzero()
            return int(low[0, 0]) + 1 if low.numel() else n
        if kind == "heuristic":
            if self._heuristic_tokens is None:
                self._heuristic_tokens = self.block_size - 1
            return max(1, min(n, int(self._heuristic_tokens)))
        raise ValueError(f"unknown length_policy {policy!r}: use 'confidence[:threshold]' or 'heuristic'")

    def _draft_logits(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafted logits `[1, n, V or K]` and the draft-vocabulary ids (`None` for the full vocabulary)."""
        head = self.main_model_output_embeddings
        if hasattr(self.assistant_model, "draft_logits"):
            return self.assistant_model.draft_logits(states, head)
        return head(states.to(head.weight.dtype)), None  # e.g. a drafter loaded with trust_remote_code

    def _collect_context(self, input_ids, model_outputs, n_last_matches) -> None:
        """Keep the target's hidden states of the tokens it processed last round and kept.

        They wait in `self._pending` until the drafter next runs (rounds that verify a lookup proposal, or no
        proposal, skip the drafter entirely).
        """
        self._cur_len = input_ids.shape[1]
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("The target's outputs must carry `hidden_states` at the drafter's target_layer_ids.")
        num_new = input_ids.shape[1] - 1 if self.is_main_model_prefill else n_last_matches + 1
        self.is_main_model_prefill = False
        context = torch.cat([model_outputs.hidden_states[i + 1][:, :num_new] for i in self.target_layer_ids], dim=-1)
        self._pending.append(context.to(device=self.device, dtype=self.drafter_dtype))
        if self.online is not None:
            window = self._pending[-1] if self._window is None else torch.cat([self._window, self._pending[-1]], 1)
            self._window = window[:, -self.online.config.context_window :]

    def _draft_block(self, input_ids, model_kwargs) -> torch.Tensor:
        """One drafter forward over the pending context + the block. Returns `[1, block_size, hidden]` states."""
        context = torch.cat(self._pending, dim=1) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        num_new = context.shape[1]  # the drafter's forward tells its DFlashCache how many context tokens come
        if self._block_in_cache:
            self.cache.crop(-self.block_size)  # drop the last drafted block's entries, keep the context

        position_ids = model_kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)[None]
        else:
            position_ids = position_ids[:, :-1]  # the loop has already appended the anchor's position
        last = position_ids[:, -1:]
        position_ids = torch.cat(
            [position_ids[:, -num_new:], last + 1 + torch.arange(self.block_size, device=last.device)], dim=-1
        )
        attention_mask = model_kwargs.get("attention_mask")
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask[:, :-1], attention_mask.new_ones(1, self.block_size)], dim=-1)
            attention_mask = attention_mask.to(self.device)

        noise_ids = torch.cat([input_ids[:, -1:], self.noise_ids_mask.to(input_ids.device)], dim=-1)
        noise_embeds = self._get_noise_embeds(noise_ids).to(device=self.device, dtype=self.drafter_dtype)
        outputs = self.assistant_model(
            noise_embeds=noise_embeds,
            context_hidden_states=context,
            position_ids=position_ids.to(self.device),
            attention_mask=attention_mask,
            cache=self.cache,
        )
        self._block_in_cache = True
        if self.online is not None:  # what the learner needs to replay this draft with gradients
            window = self._window
            positions = torch.cat([last - window.shape[1] + 1 + torch.arange(window.shape[1], device=last.device),
                                   position_ids[:, -self.block_size :]], dim=-1)
            self._online_round = (noise_embeds, window, positions.to(self.device))
            if torch.is_grad_enabled():  # the block's entries carry autograd history: keep it out of the cache
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        return outputs.last_hidden_state

    def _select_tokens(self, input_ids, candidate_logits):
        """Pick the candidate tokens from drafted logits `[1, n, vocab]` (argmax, or sampled for `do_sample`).

        With logits processors the tokens are chosen one by one, so that each processor sees the sequence it would
        see in plain decoding; the processed logits are returned for the rejection-sampling test.
        """
        if self.logits_processor is not None and len(self.logits_processor) > 0:
            candidate_ids = input_ids
            candidate_logits = candidate_logits.float()
            for i in range(candidate_logits.shape[1]):
                candidate_logits[:, i] = self.logits_processor(candidate_ids, candidate_logits[:, i])
                if self.do_sample:
                    probs = candidate_logits[:, i].softmax(dim=-1)
                    next_token = torch.multinomial(probs, num_samples=1)
                else:
                    next_token = candidate_logits[:, i].argmax(dim=-1, keepdim=True)
                candidate_ids = torch.cat([candidate_ids, next_token], dim=-1)
            return candidate_ids, candidate_logits
        if self.do_sample:
            probs = candidate_logits.float().softmax(dim=-1)
            new_ids = torch.multinomial(probs[0], num_samples=1).T
        else:
            new_ids = candidate_logits.argmax(dim=-1)
        return torch.cat([input_ids, new_ids], dim=-1), candidate_logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Called by the loop after each verification with the number of accepted drafted tokens."""
        if self._last_drafted is not None:
            n = self._last_drafted
            if self.online is not None and self._online_round is not None and n > 0:
                if self.logits_processor is None or len(self.logits_processor) == 0:
                    self._learn(self._online_round, scores[0, :n], int(num_matches))  # raw == processed here
                else:  # `scores` are processed; the raw logits come with the next round's model outputs
                    self._deferred = (self._online_round, n, int(num_matches))
            self._online_round = None
            self.stats.drafted.append(self._last_drafted)
            self.stats.accepted.append(int(num_matches))
        else:  # the prefill round: nothing was drafted
            self.stats.proposers.clear()
        if self._heuristic_tokens is not None and self._last_arm == "drafter" and self._last_drafted:
            full = int(num_matches) == self._last_drafted
            grown = min(self.block_size - 1, self._heuristic_tokens + 2)  # a block holds at most B-1 drafts
            self._heuristic_tokens = grown if full else max(1, self._heuristic_tokens - 1)
        self._last_drafted = None
        self._last_accepted = int(num_matches)

    def _learn(self, round_data: tuple, raw_logits: torch.Tensor, num_accepted: int) -> None:
        """Hand one drafter round to the online adapter: its draft replay data and the target's raw logits `[n, V]`."""
        from ..online import RoundFeedback  # lazy: online learning pulls in PEFT

        noise_embeds, window, positions, draft_logits = round_data
        n = raw_logits.shape[0]
        if draft_logits is not None:
            with torch.enable_grad():  # a view taken under no_grad would drop the autograd graph
                draft_logits = draft_logits[0, :n]
        feedback = RoundFeedback.from_round(self.assistant_model, noise_embeds, window, positions,
                                            raw_logits.to(self.device), num_accepted, draft_logits=draft_logits)
        self.online.observe(feedback, self.main_model_output_embeddings)


__all__ = ["AdaFlashCandidateGenerator", "SpeculationStats"]
