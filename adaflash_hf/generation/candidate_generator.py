# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`AdaFlashCandidateGenerator`: our candidate generator for transformers' assisted-decoding loop (batch size 1).

It subclasses transformers' `DFlashTokenCandidateGenerator` and keeps its contract with `_assisted_decoding`
(the target's hidden states at `target_layer_ids` come back in `model_outputs`; the drafter's `DFlashCache` holds
the projected context). It is a thin one-row adapter over the batched engine's core: the row's drafter side is a
1-row `BatchState`, and drafting is the engines' one `proposers.BlockDraftProposer` (the same forward, cache crop,
verify lengths and drafted tokens as `generate_batch`). On top it:

* reads its knobs from the drafter's `generation_config` (`AdaFlashGenerationConfig`) and its runtime components
  (length head, cost model, online adapter, proposal policy) from the drafter's `SpeculationRuntime`;
* chooses each round's proposal (drafter block, the row's n-gram lookup continuation through the engines' one
  `proposers.LookupProposer`, or none) and verify length with the same `ProposalPolicy` / `LengthChooser` as the
  batched engine, called with one row;
* never proposes past `max_length` (the native generator always proposes `block_size - 1` tokens);
* runs a drafter whose dtype or device differs from the target's (e.g. a bf16 drafter beside an fp32 target);
* treats non-finite drafted logits as rejected drafts (the draft ends before them), so a broken drafter cannot
  crash sampling;
* records per-call statistics (`SpeculationStats`, returned as `output.speculation_stats`).

Losslessness does not depend on anything here: the target verifies every candidate in `_assisted_decoding`,
greedy keeps the longest matching prefix and sampling applies transformers' `_speculative_sampling` (the
rejection-sampling rule, the same as `sampler.rejection_sample`) to the candidate logits we return: drafted logits
processed by the call's logits processors through `sampler.SpeculativeSampler`, the batched engine's sampler.
"""

import time
from typing import Any

import torch
from torch import nn
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from .batch_state import BatchState
from .cost_model import cost_model_for
from .drafting import LengthChooser
from .lookup import BatchLookup
from .policy import LEARNING_EXPLORE
from .proposers import BlockDraftProposer, DraftRows, LookupProposer, Proposals, lookup_hindsight
from .ragged_cache import RaggedCache
from .runtime import generation_config_of, runtime_of
from .sampler import SpeculativeSampler
from .stats import SpeculationStats


class AdaFlashCandidateGenerator(DFlashTokenCandidateGenerator):
    """Drafts one block per round with an AdaFlash/DFlash drafter (see the module docstring).

    Args:
        assistant_model: the drafter (`AdaFlashDrafterModel` or any model with the DFlash forward contract).
        main_model_input_embeddings / main_model_output_embeddings: the target's embedding table and LM head.
        generation_config: the target's generation config of this `generate` call.
        logits_processor: processors applied to drafted logits (needed for sampling to stay exact).
        target: the target model (to measure its cost model on this device when none is cached).
        stats: where to record this call's statistics (a new `SpeculationStats` by default).
    """

    def __init__(self, assistant_model: nn.Module, main_model_input_embeddings: nn.Embedding,
                 main_model_output_embeddings: nn.Linear, generation_config, logits_processor=None, target=None,
                 stats: SpeculationStats | None = None, **kwargs):
        super().__init__(assistant_model=assistant_model, main_model_input_embeddings=main_model_input_embeddings,
                         main_model_output_embeddings=main_model_output_embeddings,
                         generation_config=generation_config, logits_processor=logits_processor, **kwargs)
        self.target = target
        self.knobs = knobs = generation_config_of(assistant_model)
        self.runtime = runtime = runtime_of(assistant_model)
        self.drafter_dtype = next(assistant_model.parameters()).dtype
        self.vocab_size = main_model_output_embeddings.weight.shape[0]
        # Draft logits are needed to sample, to run logits processors, or to mix draft and target distributions;
        # plain greedy only needs the drafted tokens.
        self.needs_logits = bool(generation_config.do_sample or (logits_processor is not None and len(logits_processor))
                                 or generation_config.assistant_ensemble_weight is not None)
        self.stats = stats if stats is not None else SpeculationStats()
        self.max_drafts = min(self.block_size - 1, knobs.num_assistant_tokens or self.block_size)
        self.policy = runtime.policy_for_call(knobs)  # the runtime's, or a copy of it ("transient" schedule)
        self.lookup: LookupProposer | None = None  # the row's n-gram lookup (hybrid), built on the prompt
        self._eos = generation_config._eos_token_tensor  # lookup continuations end before an EOS
        self._looked_up = 0  # tokens of the sequence the lookup buffer holds
        self._cost = None
        self.lengths = LengthChooser(knobs.length_policy, runtime.length_head, None, self.block_size,
                                     knobs.assistant_confidence_threshold)
        if self.lengths.uses_head:
            self.lengths.cost = self.cost_model()
        # The engines' one drafting implementation, for this one row (`proposers.py`).
        self.proposer = BlockDraftProposer(assistant_model, main_model_input_embeddings, main_model_output_embeddings,
                                           SpeculativeSampler(logits_processor, self.do_sample), self.lengths,
                                           cost=self.lengths.cost, return_logits=self.needs_logits)
        self.online = runtime.online_adapter  # OnlineSpec: learns from the served request, or from every round
        self.learn_rounds = self.online is not None and not self.online.learns_from_sequences
        self._sequence: list[torch.Tensor] = []  # every context chunk of the request (sequence learning)
        self._input_ids: torch.Tensor | None = None  # the sequence after the last verification
        self._prompt_len: int | None = None
        self._last: tuple[str, int] | None = None  # (source, drafted tokens) of the round being verified
        # The row's drafter side: anchor and its position, the drafter's cache, target context not yet drafted on.
        self._row: BatchState | None = None
        self._cur_len = 0
        self._window: torch.Tensor | None = None  # the last `context_window` context states, [1, W, F]
        self._online_round: tuple | None = None  # (noise_embeds, context window, position_ids[, logits]) of a draft
        self._deferred: tuple | None = None  # a round whose raw target logits arrive with the next model_outputs
        self._found: torch.Tensor | None = None  # the round's lookup continuation `[1, n]` (None: no match)

    def cost_model(self):
        """The target's cost model on this device (cached per device; measured once when missing)."""
        if self._cost is None:
            candidate = self.runtime.cost_model
            if self.target is None:
                if candidate is None:
                    raise ValueError("the proposal policy and the length head need a cost model: attach one "
                                     "(SpeculationRuntime(cost_model=...)) or build the generator with `target=`.")
                self._cost = candidate
            else:
                self._cost = cost_model_for(self.target, self.assistant_model, candidate=candidate)
        return self._cost

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], model_outputs,
                       is_first_iteration: bool, n_last_matches: int, **kwargs):
        """Return `(input_ids + candidates [1, cur_len + n], candidate logits [1, n, vocab] or None)`."""
        start = time.perf_counter()
        if is_first_iteration:  # the loop's first forward is the target's prefill
            self._prompt_len = input_ids.shape[1]
            self._start_lookup(input_ids)
            return input_ids, None
        self._collect_context(input_ids, model_kwargs, model_outputs, n_last_matches)
        if self._deferred is not None:  # logits processors were active: learn from the raw logits of last round
            round_data, n, accepted = self._deferred
            self._deferred = None
            self._learn(round_data, model_outputs.logits[0, -(n + 1) : -1], accepted)
        self._online_round = None
        room = self.main_model_max_length - input_ids.shape[1] - 1
        budget = min(self.max_drafts, room)
        if budget <= 0:  # the target still runs one forward for its own next token: a round with no draft
            return self._propose(input_ids, None, "none", start)

        lookup_ids, lookup_len = self._look_up(input_ids, room)  # up to prompt_lookup_num_tokens, not the block
        self._found = None if lookup_ids is None else lookup_ids[:, input_ids.shape[1] :]  # scored in hindsight
        allow = self.knobs.allow_no_draft
        arm = self.policy.choose([0], [lookup_len], [budget], self.cost_model() if allow else None,
                                 allow_no_draft=allow, explore_every=LEARNING_EXPLORE if self.online else None,
                                 draft_cut=self.lengths.cut_by_policy)
        width = self.policy.cut(arm)  # the verify width the policy scored best (None: the whole budget)
        if arm == "lookup":
            if width is not None:
                lookup_ids = lookup_ids[:, : input_ids.shape[1] + width]
            return self._propose(lookup_ids, None, "lookup", start)
        if arm == "plain":
            return self._propose(input_ids, None, "none", start)

        proposals = self._draft(input_ids, budget if width is None or not self.lengths.cut_by_policy else
                                min(budget, width))
        if proposals.survival is not None:
            self.stats.survival.append(proposals.survival[0].tolist())
        keep = proposals.lengths_list()[0]  # a non-finite position has already ended the draft
        # as the batched engine's `swap_in_lookup`: the lookup continuation, cut to the round's drafted width, is
        # verified instead where it promises more than the block
        cut = min(lookup_len, proposals.drafts.shape[1])
        if cut and self.policy.row_source(0, cut, keep) == "lookup":
            return self._propose(lookup_ids[:, : input_ids.shape[1] + cut], None, "lookup", start)
        if keep == 0:
            return self._propose(input_ids, None, "none", start)
        candidate_ids = torch.cat([input_ids, proposals.drafts.to(input_ids.device)], dim=-1)
        # Processed draft logits only when the loop reads them (sampling, processors); plain greedy needs none.
        logits = None if proposals.logits is None else proposals.logits.to(input_ids.device)
        return self._propose(candidate_ids, logits, "drafter", start)

    def _start_lookup(self, input_ids: torch.Tensor) -> None:
        """Hybrid: the row's lookup buffer over the prompt (the batched engine's `BatchLookup`, one row)."""
        if not self.knobs.hybrid_lookup:
            return
        eos = self._eos
        buffer = BatchLookup([input_ids[0].tolist()], self.knobs.prompt_lookup_num_tokens,
                             self.knobs.max_matching_ngram_size, set() if eos is None else set(eos.view(-1).tolist()),
                             input_ids.device)
        self.lookup, self._looked_up = LookupProposer(buffer), input_ids.shape[1]

    def _look_up(self, input_ids: torch.Tensor, budget: int) -> tuple[torch.Tensor | None, int]:
        """`(input_ids + the row's lookup continuation, its length)`, or `(None, 0)` without a match. The tokens
        committed since the last round are appended to the lookup buffer first."""
        if self.lookup is None:
            return None, 0
        new = input_ids[:, self._looked_up :]
        self.lookup.append(self._row.prompt_tensor, new, torch.tensor([new.shape[1]], device=new.device))
        self._looked_up = input_ids.shape[1]
        found = self.lookup.propose(DraftRows(self._row, [budget], [0]))
        n = found.lengths_list()[0]
        return (torch.cat([input_ids, found.drafts[:, :n].to(input_ids.device)], dim=-1), n) if n else (None, 0)

    def _propose(self, candidate_ids, candidate_logits, source: str, start: float):
        """Book-keeping shared by every kind of round; returns what the loop expects."""
        self._last = (source, candidate_ids.shape[1] - self._cur_len)
        self.stats.draft_seconds += time.perf_counter() - start
        self.stats.proposers.append(source)
        return candidate_ids, candidate_logits

    def _collect_context(self, input_ids, model_kwargs, model_outputs, n_last_matches) -> None:
        """Keep the target's hidden states of the tokens it processed last round and kept, with their positions.

        They wait in the row's pending context until the drafter next runs (rounds that verify a lookup proposal,
        or no proposal, skip the drafter entirely).
        """
        self._cur_len = input_ids.shape[1]
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("The target's outputs must carry `hidden_states` at the drafter's target_layer_ids.")
        num_new = input_ids.shape[1] - 1 if self.is_main_model_prefill else n_last_matches + 1
        self.is_main_model_prefill = False
        context = torch.cat([model_outputs.hidden_states[i + 1][:, :num_new] for i in self.target_layer_ids], dim=-1)
        context = context.to(device=self.device, dtype=self.drafter_dtype)
        position_ids = model_kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)[None]
        else:
            position_ids = position_ids[:, :-1]  # the loop has already appended the anchor's position
        attention_mask = model_kwargs.get("attention_mask")
        valid = torch.ones_like(position_ids, dtype=torch.bool) if attention_mask is None else attention_mask[:, :-1]
        if self._row is None:
            cache = RaggedCache(self.cache, torch.zeros(1, 0, dtype=torch.bool, device=self.device))
            self._row = BatchState([0], input_ids[:, -1], position_ids[:, -1] + 1, None, cache)
        self._row.add_context(context, valid[:, -num_new:].bool(), position_ids[:, -num_new:])
        self._row.last_tok, self._row.next_pos = input_ids[:, -1], position_ids[:, -1] + 1
        if self.online is not None and not self.learn_rounds:
            self._sequence.append(context)
        elif self.online is not None:
            window = context if self._window is None else torch.cat([self._window, context], 1)
            self._window = window[:, -self.online.config.context_window :]

    def _draft(self, input_ids, budget: int) -> Proposals:
        """The row's block through the engines' one `BlockDraftProposer` (consumes the pending context).

        A single online adapter learns from this very forward: it is recorded with gradients (exact: the cached
        context keys/values do not depend on the adapter), so learning costs one backward and no replay."""
        proposals = self.proposer.propose(DraftRows(self._row, [budget], [0], [input_ids[0]]),
                                          learn=self.learn_rounds and self.online.learns_from_draft)
        if self.learn_rounds:  # what the learner needs to replay this draft
            window, anchor = self._window, self._row.next_pos.to(self.device)[:, None]
            positions = torch.cat([anchor - window.shape[1] + torch.arange(window.shape[1], device=self.device),
                                   anchor + torch.arange(self.block_size, device=self.device)], dim=-1)
            self._online_round = (proposals.noise, window, positions, proposals.raw_logits)
        return proposals

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Called by the loop after each verification with the number of accepted drafted tokens."""
        if self._last is None:  # the prefill round: nothing was proposed
            return
        source, n = self._last
        num_matches = int(num_matches)
        self._last = None
        self._input_ids = input_ids
        if self.learn_rounds and self._online_round is not None and n > 0 and source == "drafter":
            start = time.perf_counter()
            if self.logits_processor is None or len(self.logits_processor) == 0:
                self._learn(self._online_round, scores[0, :n], num_matches)  # raw == processed here
            else:  # `scores` are processed; the raw logits come with the next round's model outputs
                self._deferred = (self._online_round, n, num_matches)
            self.stats.online_seconds += time.perf_counter() - start
        self._online_round = None
        self.stats.drafted.append(n)
        self.stats.accepted.append(num_matches)
        if n > 0:
            self.policy.record([0], [source], [num_matches], [n])
        if self._found is not None:  # as the batched engine: an unverified lookup continuation, in hindsight
            committed = input_ids[:, self._cur_len :]
            found = Proposals("lookup", self._found, torch.tensor([self._found.shape[1]]), ["lookup"])
            hindsight = lookup_hindsight(found, committed.tolist(), [source])
            self.policy.record_hindsight([0], *hindsight)
            self._found = None
        if source == "drafter":
            self.lengths.update([n], [num_matches])

    def finish(self) -> None:
        """The request is served: hand it to the online adapter (sequence learning; `online/feedback.py`)."""
        if self.online is None or self.learn_rounds or self._input_ids is None or not self._sequence:
            return
        start = time.perf_counter()
        drafted = [(a, d) for a, d, s in zip(self.stats.accepted, self.stats.drafted, self.stats.proposers)
                   if s == "drafter"]
        self.online.on_request_end(self._input_ids[0], torch.cat(self._sequence, dim=1)[0], self._prompt_len,
                                   sum(a for a, _ in drafted), sum(d for _, d in drafted),
                                   self.main_model_input_embeddings, self.main_model_output_embeddings)
        self.stats.online_seconds += time.perf_counter() - start

    def _learn(self, round_data: tuple, raw_logits: torch.Tensor, num_accepted: int) -> None:
        """Hand one drafter round to the online adapter: its draft replay data and the target's raw logits `[n, V]`."""
        noise_embeds, window, positions, draft_logits_ = round_data
        n = raw_logits.shape[0]
        if draft_logits_ is not None:
            with torch.enable_grad():  # a view taken under no_grad would drop the autograd graph
                draft_logits_ = draft_logits_[0, :n]
        self.online.on_round(noise_embeds, window, positions, raw_logits.to(self.device), num_accepted,
                             self.main_model_output_embeddings, draft_logits=draft_logits_)


__all__ = ["AdaFlashCandidateGenerator", "SpeculationStats"]
