# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Batched speculative decoding with per-row verify lengths (high-concurrency serving).

`generate_batch(target, drafter, prompts, max_new_tokens)` decodes many sequences together; `batched_generate` is
the same with `target.generate`'s tensor interface (left-padded `input_ids [b, T]` in, `[b, T + new]` out).
`AdaFlashBatchGenerator` is the engine behind both; the state of one run is a `BatchRun`, the active rows a
`BatchState` (`batch_state.py`) over two `RaggedCache`s (`ragged_cache.py`).

A round, for all active rows at once, in named steps (`_round`); proposing is the proposers' job
(`proposers.py`: `propose(DraftRows) -> Proposals`, the bs=1 generator's too):

1. `_choose_arm`: each row's n-gram lookup continuation (hybrid, `LookupProposer`), then the `ProposalPolicy` (the
   same one the bs=1 generator uses) picks the round's arm: `"draft"`, `"lookup"` or `"plain"`, by expected
   committed tokens per second from counts and the device-calibrated cost model.
2. propose. "draft": the `BlockDraftProposer`'s ONE drafter forward drafts a block per row (queries `[anchor, mask x
   (B-1)]`, keys/values = the drafter's cached context + the rows' new context + the block); the `LengthChooser`
   (same as bs=1) picks the verify lengths (whole block, length head + cost model, confidence or heuristic), a
   non-finite drafted position ends its row's draft; rows whose lookup continuation promises more verify it instead
   (`swap_in_lookup`, cut to the round's width). "lookup": no drafter forward, rows with a match verify their
   continuation. "plain": `NoDraftProposer`, no proposals.
3. `_verify`: ONE target forward over `[anchor, d_1 .. d_L]` for every row (padded, padding masked), with
   `output_hidden_states` at `target_layer_ids + 1`.
4. accept (`SpeculativeSampler.accept`, `sampler.py`, the bs=1 engine's rule too): each row accepts its own prefix:
   greedy, the longest prefix equal to the target's argmax, then the target's token; sampling, speculative rejection
   sampling. The call's logits processors apply to the target's and the drafter's logits alike.
5. `_advance`: caches, positions and the drafter's pending context move on; the policy, the length rule and an
   OnlineSpec adapter (the runtime's) learn from the round; committed tokens are cut after an EOS.
6. Finished rows (EOS or `max_new_tokens`) leave the batch (`_retire`); with `continuous=True` waiting prompts take
   the free slots: they are prefilled in separate target forwards and merged into the batch.

Prompts that join together are prefilled in length groups (`prefill.py`): one forward per group where forwards cost
by their tokens (a CPU), one padded forward where they are flat (an accelerator; the device's cost model decides).

Serving simulation is not the engine's: a request stream's driver (`Admission`, e.g. the serving bench's arrival
schedule) says when a waiting prompt may join and hears of committed tokens. The engine never sleeps, and reads the
device only where it needs a value (accepted counts, committed tokens); per-phase timing (`profile=True`) is opt-in.

Cache design (see `ragged_cache.py`): one transformers `DynamicCache` for the target and one `DFlashCache` for the
drafter, each with a bool validity mask `[b, S]`. Slots that are not part of a row's sequence (prompt left padding,
verify padding, rejected drafts, context padding) stay in the cache but are masked out through the 2D attention mask,
and `position_ids` count only each row's valid tokens, so every row attends to exactly what it would see alone.

Exactness: in greedy mode every row equals plain greedy decoding of its prompt alone, up to floating-point
differences between batched/padded and bs=1 forwards (they can only flip exact or near ties of the top-2 logits).
In sampling mode every row is a sample of what `target.generate` samples with the same knobs (temperature, top-k,
top-p, repetition penalty, `logits_processor`, ...: each row processed with its own unpadded sequence).
"""

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DFlashCache

from .cost_model import cost_model_for
from .dispatch import check_pair
from .drafting import LengthChooser
from .lookup import BatchLookup
from .policy import LEARNING_EXPLORE
from .prefill import forward_overhead_tokens, prefill_groups
from .ragged_cache import RaggedCache
from .batch_state import BatchState
from .candidates import CandidateTree, FirstTokenHits, TreeVerdict, tree_allowed, tree_shape
from .proposers import (BlockDraftProposer, DraftRows, LookupProposer, NoDraftProposer, Proposals, lookup_hindsight,
                        swap_in_lookup)
from .runtime import SpeculationRuntime, generation_config_of, runtime_of
from .sampler import SpeculativeSampler, rejection_sample
from .stats import BatchStats, PhaseTimer


class Admission(Protocol):
    """When waiting prompts join the batch, and who hears of committed tokens: a request stream's driver (e.g. the
    serving bench's arrival schedule) passed as `generate(admission=...)`. Default: every prompt waits only for a
    free slot, and nobody is told."""

    def ready(self, i: int, idle: bool) -> bool:
        """Whether prompt `i` (the next waiting one) may join now. `idle`: no row is decoding, so the driver may
        wait for it before answering."""

    def committed(self, i: int, count: int) -> None:
        """Prompt `i` committed `count` new tokens (their values are already on the host)."""


@dataclass
class BatchRun:
    """Everything one `generate` call of the engine works with (the engine object itself keeps no run state)."""

    prompts: list[list[int]]
    max_new: int
    eos: set[int]
    sampler: SpeculativeSampler  # the call's logits processors, greedy or sampling, the accept rule
    stats: BatchStats
    lengths: LengthChooser | None = None
    lookup: BatchLookup | None = None
    cost: object | None = None
    policy: object | None = None  # the run's ProposalPolicy (`SpeculationRuntime.policy_for_call`)
    drafting: BlockDraftProposer | None = None  # the run's proposers (`proposers.py`)
    looking_up: LookupProposer | None = None
    candidates: int = 1  # the most candidate blocks a row verifies per round (`candidates.py`); 1: linear rounds
    first_hits: FirstTokenHits = field(default_factory=FirstTokenHits)  # what more candidates buy (`tree_shape`)
    queued: int = 0  # prompts still waiting to join; 0: the batch drains (the policy's drain objective)
    outputs: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    admission: Admission | None = None  # a request stream's driver (`generate(admission=...)`), or None
    timer: PhaseTimer | None = None  # per-phase timing, a no-op unless `generate(profile=True)`

    def __post_init__(self):
        if self.timer is None:
            self.timer = PhaseTimer(self.stats.seconds, None)
    sequence_context: dict = field(default_factory=dict)  # prompt -> context chunks (OnlineSpec sequence learning)

    def remaining(self, prompt_idx: list[int]) -> list[int]:
        return [self.max_new - len(self.outputs[i]) for i in prompt_idx]


class AdaFlashBatchGenerator:
    """Batched speculative decoding of many prompts with one target and one block drafter (module docstring).

    Args:
        target: a decoder-only causal LM with full-attention layers (Llama/Qwen/Mistral-style).
        drafter: an AdaFlash/DFlash drafter for `target` (checked like `generate` does); `None`: plain decoding.
        generation_config: the decoding knobs (`AdaFlashGenerationConfig`); default: the drafter's own.
        runtime: length head, cost model, online adapter and policy state (`SpeculationRuntime`); default: the
            drafter's (`drafter.runtime`).
        compact_ratio / compact_min_waste: compact a cache when its fully-removable slots exceed
            `max(compact_min_waste, compact_ratio * slots)`; `compact_min_waste=None` never compacts.
    """

    def __init__(self, target, drafter=None, generation_config=None, runtime: SpeculationRuntime | None = None,
                 compact_ratio: float = 0.5, compact_min_waste: int | None = 32):
        if drafter is not None:
            check_pair(target, drafter)  # one clear error, before any compute
        self.target, self.drafter = target, drafter
        self.knobs = generation_config if generation_config is not None else generation_config_of(drafter)
        self.knobs.validate()
        self.runtime = runtime if runtime is not None else (runtime_of(drafter) if drafter is not None else None)
        self.compact_ratio, self.compact_min_waste = compact_ratio, compact_min_waste
        self.embeddings = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = self.embeddings.weight.device
        self.layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
        self.hidden_state_ids = [i + 1 for i in self.layer_ids] or None
        if drafter is not None:
            self.block_size = int(drafter.config.block_size)
            self.max_drafts = min(self.block_size - 1, self.knobs.num_assistant_tokens or self.block_size)
            self.drafter_param = next(drafter.parameters())
        self.online = self.runtime.online_adapter if self.runtime is not None else None
        self.learn_rounds = self.online is not None and not self.online.learns_from_sequences
        self._active: BatchState | None = None

    @property
    def active_prompt_indices(self) -> list[int]:
        """Input indices of the rows of the batch, in batch order (e.g. for a test drafter that must know them)."""
        return list(self._active.prompt_idx) if self._active is not None else []

    @property
    def active_state(self) -> BatchState | None:
        """The running batch during `generate` (for inspection and tests), else None."""
        return self._active

    # ------------------------------------------------------------------------------------------------ one run
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, eos_token_id=None, do_sample: bool = False,
                 max_batch_size: int | None = None, continuous: bool = False,
                 attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 admission: Admission | None = None, profile: bool = False, return_stats: bool = False,
                 generation_config=None, logits_processor=None, **sampling):
        """New tokens of every prompt (input order; EOS included when produced); with `return_stats`, also the
        run's `BatchStats`.

        Args:
            prompts: `list[list[int]]` (ragged), or `input_ids [b, T]` with `attention_mask [b, T]` (any padding).
            eos_token_id: int or list; `None`: the target's `generation_config.eos_token_id`; `[]`: no EOS.
            max_batch_size: most rows decoded together (default: all). Without `continuous`, prompts are decoded in
                consecutive static batches; with it, a waiting prompt joins as soon as a row finishes.
            generator: RNG for sampling (on the model's device).
            do_sample, generation_config, logits_processor, **sampling (`temperature`, `top_k`, `top_p`,
                `repetition_penalty`, any `GenerationConfig` field): the decoding options of `target.generate`, with
                the target's `generation_config` filling what is unset (`SpeculativeSampler.for_target`); only
                `do_sample` defaults to False (greedy) whatever the target's config says.
            admission: a request stream's driver (`Admission`): whether the next waiting prompt may join, and
                who hears of committed tokens (arrival times and token timing live there, not in the engine).
            profile: per-phase timing of every round in `BatchStats.seconds` (synchronizes the device at each phase;
                off: the engine synchronizes only where it reads a value).
        """
        prompts = _prompt_lists(prompts, attention_mask)
        sampler = SpeculativeSampler.for_target(self.target, generation_config, logits_processor, generator,
                                                do_sample=do_sample, **sampling)
        if eos_token_id is None:
            eos_token_id = self.target.generation_config.eos_token_id
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        stats = BatchStats.for_prompts(len(prompts))
        run = BatchRun(prompts, int(max_new_tokens), eos, sampler, stats, outputs=[[] for _ in prompts],
                       done=[False] * len(prompts), admission=admission,
                       timer=PhaseTimer(stats.seconds, self.device, profile))
        cap = max_batch_size or len(prompts)
        if max_new_tokens > 0 and prompts:
            self._setup(run, cap)
            self._loop(run, cap, continuous)
        return (run.outputs, run.stats) if return_stats else run.outputs

    def _setup(self, run: BatchRun, cap: int) -> None:
        """Per-run helpers: lookup, the cost model for the batch sizes this run can have, the length rule."""
        if self.drafter is None:  # plain rounds: a cost model given to the runtime still decides how to prefill
            cost = self.runtime.cost_model if self.runtime is not None else None
            if cost is not None and (not cost.implicit or cost.describes(self.device)):
                run.cost = cost
            return
        knobs, runtime = self.knobs, self.runtime
        if knobs.hybrid_lookup:
            run.lookup = BatchLookup(run.prompts, knobs.prompt_lookup_num_tokens,
                                     knobs.max_matching_ngram_size, run.eos, self.device)
        run.policy = runtime.policy_for_call(knobs)
        head = runtime.length_head
        lengths = LengthChooser(knobs.length_policy, head, None, self.block_size, knobs.assistant_confidence_threshold)
        attention = getattr(self.target.config, "_attn_implementation", None)
        if not self.learn_rounds and tree_allowed(run.sampler.do_sample, run.sampler.needs_sequences, attention):
            run.candidates = knobs.draft_candidates  # how many are free is the cost model's call, per round
        # candidate trees alone never calibrate one (an always-drafting run without a head uses one it is given)
        if knobs.allow_no_draft or lengths.uses_head or (run.candidates > 1 and runtime.cost_model is not None):
            run.cost = lengths.cost = cost_model_for(self.target, self.drafter, batch_sizes=(1, cap),
                                                     candidate=runtime.cost_model)
        run.lengths = lengths
        run.drafting = BlockDraftProposer(self.drafter, self.embeddings, self.lm_head, run.sampler, lengths, run.cost)
        run.looking_up = LookupProposer(run.lookup) if run.lookup is not None else None

    def _loop(self, run: BatchRun, cap: int, continuous: bool) -> None:
        waiting = deque(range(len(run.prompts)))
        start = time.perf_counter()
        batch = None
        try:
            while waiting or (batch is not None and batch.size):
                size = 0 if batch is None else batch.size
                take = self._admit(run, waiting, cap - size if size == 0 or continuous else 0, idle=size == 0)
                run.queued = len(waiting)
                if take:
                    new = self._prefill_grouped(run, take)
                    run.stats.prefill_joins += int(size > 0 and new.size > 0)
                    batch = new if batch is None else batch.merge(new)
                if batch is None or batch.size == 0:  # nothing to decode (yet)
                    continue
                self._active = batch
                self._round(run, batch)
                self._retire(run, batch)
        finally:
            self._active = None
            run.stats.seconds["total"] += time.perf_counter() - start

    @staticmethod
    def _admit(run: BatchRun, waiting: deque, free: int, idle: bool) -> list[int]:
        """The waiting prompts that join now: at most `free`, in input order, as long as `run.admission` lets the
        next one in (everything waiting, without one)."""
        take = []
        while waiting and len(take) < free and (
                run.admission is None or run.admission.ready(waiting[0], idle=idle and not take)):
            take.append(waiting.popleft())
        return take

    def _prefill_grouped(self, run: BatchRun, take: list[int]) -> BatchState:
        """Prefill `take` in length groups (`prefill.py`: one forward per group, less padding where forwards cost by
        their tokens), merged into one batch of the live rows."""
        overhead = forward_overhead_tokens(run.cost, self.device)
        batch = None
        for group in prefill_groups([len(run.prompts[i]) for i in take], overhead):
            new = self._prefill(run, [take[g] for g in group])
            batch = new if batch is None else batch.merge(new)
        return batch

    def _prefill(self, run: BatchRun, prompt_idx: list[int]) -> BatchState:
        """One target forward over the left-padded prompts; commits each row's first token. Returns live rows."""
        run.timer.start()
        prompts = [run.prompts[i] for i in prompt_idx]
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        cache = RaggedCache(DynamicCache(config=self.target.config), mask)
        cache.check_layers()  # full-attention layers only (before spending a forward)
        out = self.target(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache.cache, use_cache=True,
                          logits_to_keep=1, output_hidden_states=self.hidden_state_ids)
        first = run.sampler.next_tokens(out.logits[:, -1], self._sequences(run, prompt_idx, prompts_only=True))
        batch = BatchState(list(prompt_idx), first, mask.sum(dim=1), cache, None)
        if self.drafter is not None:
            dmask = torch.zeros(b, 0, dtype=torch.bool, device=self.drafter_param.device)
            batch.drafter = RaggedCache(DFlashCache(config=self.drafter.config), dmask)
            batch.drafter.check_layers()
            ctx = self._context(out.hidden_states)
            if self.learn_rounds:  # the window each row's drafting forward is replayed on
                batch.start_window(self.online.config.context_window, ctx.shape[-1], ctx.dtype, ctx.device)
            elif self.online is not None:  # the whole request is learned from once served
                for r, i in enumerate(prompt_idx):
                    run.sequence_context[i] = [ctx[r][mask[r].to(ctx.device)]]
            batch.add_context(ctx, mask, pos)
        run.stats.prefill_forwards += 1
        run.timer.lap("prefill")
        firsts = [[token] for token in first.tolist()]
        if run.lookup is not None:
            run.lookup.extend(prompt_idx, firsts)
        for i, tokens in zip(prompt_idx, firsts):
            self._commit(run, i, tokens)
        self._retire(run, batch, compact=False)
        return batch

    # ------------------------------------------------------------------------------------------------ one round
    def _round(self, run: BatchRun, batch: BatchState) -> None:
        """Propose, verify, accept, advance (module docstring)."""
        timer = run.timer
        timer.start()
        room = [max(0, r - 1) for r in run.remaining(batch.prompt_idx)]  # the most tokens a row may still verify
        budgets = [min(self.max_drafts, r) for r in room] if self.drafter is not None else [0] * batch.size
        rows = DraftRows(batch, budgets, batch.prompt_idx, self._sequences(run, batch.prompt_idx))
        arm, lookup = self._choose_arm(run, rows, room)
        # the verify width the policy scored best (None: the whole budget)
        width = run.policy.cut(arm) if arm != "plain" else None
        timer.lap("lookup")
        if arm == "draft":
            if width is not None and run.lengths.cut_by_policy:
                rows.budgets = [min(b, width) for b in rows.budgets]
            proposals = swap_in_lookup(run.drafting.propose(rows, tree=self._tree_rule(run, batch.size)), lookup,
                                       run.policy, batch.prompt_idx)
        elif arm == "lookup":
            run.stats.lookup_rounds += 1
            proposals = lookup if width is None else lookup.cut(width)
        else:
            run.stats.plain_rounds += 1
            proposals = NoDraftProposer(self.device).propose(rows)
        timer.lap("draft")
        if proposals.alternatives is not None:  # several candidate blocks per row, one forward (`candidates.py`)
            out, verdict = self._verify_tree(run, batch, proposals)
            timer.lap("verify")
            proposals.drafts, accepted, next_tok = verdict.drafts, verdict.accepted, verdict.next_tok
            self._advance(run, batch, out, proposals, accepted, next_tok, lookup, verdict)
        else:
            out = self._verify(batch, proposals)
            timer.lap("verify")
            accepted, next_tok = run.sampler.accept(out.logits, proposals.drafts, proposals.lengths, proposals.q,
                                                    proposals.one_hot, rows.sequences)
            self._advance(run, batch, out, proposals, accepted, next_tok, lookup)
        timer.lap("accept")

    @staticmethod
    def _tree_rule(run: BatchRun, rows: int):
        """`m -> (k, m')` for the proposer: the round's candidate tree (`candidates.tree_shape`), or None."""
        if run.candidates <= 1 or run.cost is None:
            return None
        return lambda m: tree_shape(run.cost, rows, m, run.candidates, run.first_hits,
                                    run.policy.expected_upto("drafter", m))

    def _choose_arm(self, run: BatchRun, rows: DraftRows, room: list[int]) -> tuple[str, Proposals | None]:
        """The round's arm (`"draft"`, `"lookup"` or `"plain"`) and each row's lookup continuation (None without
        hybrid lookup; up to `prompt_lookup_num_tokens` and the row's `room`, not the drafter's block)."""
        if self.drafter is None or max(rows.budgets) <= 0:
            return "plain", None
        lookup = None
        if run.looking_up is not None:
            lookup = run.looking_up.propose(DraftRows(rows.state, room, rows.keys, rows.sequences))
        lookup_lens = lookup.lengths_list() if lookup is not None else [0] * rows.size
        # nothing waits for a slot: what counts is when the last row is done, not this round's tokens per second
        remaining = run.remaining(rows.keys) if not run.queued else None
        arm = run.policy.choose(rows.keys, lookup_lens, rows.budgets, run.cost,
                                allow_no_draft=self.knobs.allow_no_draft,
                                explore_every=LEARNING_EXPLORE if self.online is not None else None,
                                draft_cut=run.lengths.cut_by_policy, remaining=remaining)
        return arm, lookup

    def _verify(self, batch: BatchState, proposals: Proposals):
        """ONE target forward over `[anchor, drafts]` for every row, padding masked; `logits [b, m + 1, V]`."""
        m = proposals.drafts.shape[1]
        j = torch.arange(m + 1, device=self.device)
        input_ids = torch.cat([batch.last_tok[:, None], proposals.drafts], dim=1)  # [b, m + 1]
        position_ids = batch.next_pos[:, None] + j
        out = self.target(input_ids=input_ids, attention_mask=batch.target.attention_mask(
            j <= proposals.lengths[:, None]), position_ids=position_ids, cache=batch.target.cache, use_cache=True,
            output_hidden_states=self.hidden_state_ids)
        out.position_ids = position_ids
        return out

    def _verify_tree(self, run: BatchRun, batch: BatchState, proposals: Proposals):
        """ONE target forward over every row's candidate tree, greedy acceptance, and the forward's outputs along
        each row's kept candidate: `(out, TreeVerdict)`, `out.logits [b, m + 1, V]` and the context's hidden states
        as if that candidate had been the only proposal."""
        tree = CandidateTree.from_proposals(proposals.drafts, proposals.lengths, proposals.alternatives,
                                            proposals.sources)
        position_ids = batch.next_pos[:, None] + tree.depth()[None, :]
        out = self.target(input_ids=tree.input_ids(batch.last_tok), position_ids=position_ids,
                          attention_mask=tree.attention_mask(batch.target.mask, self.embeddings.weight.dtype),
                          cache=batch.target.cache, use_cache=True, output_hidden_states=self.hidden_state_ids)
        target_tokens = run.sampler.greedy_tokens(out.logits)
        verdict = tree.accept(target_tokens)
        run.first_hits.record(tree.drafts[:, :, 0], target_tokens[:, 0], tree.branches > 1)
        out.logits = verdict.along_path(out.logits)
        if self.hidden_state_ids:
            states = list(out.hidden_states)
            for i in self.hidden_state_ids:
                states[i] = verdict.along_path(states[i])
            out.hidden_states = tuple(states)
        out.position_ids = batch.next_pos[:, None] + torch.arange(verdict.path.shape[1], device=self.device)
        run.stats.candidates.append(tree.shape[1])
        return out, verdict

    def _advance(self, run: BatchRun, batch: BatchState, out, proposals: Proposals, accepted, next_tok,
                 lookup: Proposals | None = None, verdict: TreeVerdict | None = None) -> None:
        """Caches, context and positions move on; policy, length rule and online adapter learn; tokens commit.
        `lookup`: the rows' lookup continuations of this round (scored in hindsight where a row verified nothing).
        `verdict`: a tree round's (`_verify_tree`): the target cache keeps the kept candidates' slots."""
        m = proposals.drafts.shape[1]
        j = torch.arange(m + 1, device=self.device)
        batch.target.append(verdict.cache_valid() if verdict is not None else j[None, :] <= accepted[:, None])
        accepted_l, lengths_l = accepted.tolist(), proposals.lengths_list()
        if self.drafter is not None:
            if proposals.arm != "plain":
                run.policy.record(batch.prompt_idx, proposals.sources, accepted_l, lengths_l)
            if proposals.arm == "draft":
                run.stats.drafter_forwards += 1
                drafted = [n if s == "drafter" else 0 for n, s in zip(lengths_l, proposals.sources)]
                run.lengths.update(drafted, accepted_l)
                if self.learn_rounds:  # before add_context: each row's window ends at its anchor
                    start = time.perf_counter()  # learning reads its losses: no extra synchronization
                    from .feedback import batch_feedback

                    batch_feedback(self.online, self.lm_head, batch, proposals.noise, out.logits,
                                   lengths_l, accepted_l, proposals.sources)
                    run.stats.seconds["online"] += time.perf_counter() - start
            keep = int(accepted.max()) + 1
            ctx_mask = (j[None, :keep] <= accepted[:, None]).to(batch.drafter.mask.device)
            context = self._context(out.hidden_states)[:, :keep]
            batch.add_context(context, ctx_mask, out.position_ids[:, :keep])
            if self.online is not None and not self.learn_rounds:
                for r, (i, a) in enumerate(zip(batch.prompt_idx, accepted_l)):
                    run.sequence_context[i].append(context[r, : a + 1])
        committed = [row[:a] + [token] for row, a, token in zip(proposals.drafts.tolist(), accepted_l,
                                                                next_tok.tolist())]  # host lists: no kernels
        if run.lookup is not None:  # the rows' texts grow by their committed tokens
            run.lookup.extend(batch.prompt_idx, committed)
            hindsight = lookup_hindsight(lookup, committed, proposals.sources)
            if hindsight is not None:
                run.policy.record_hindsight(batch.prompt_idx, *hindsight)
        batch.next_pos = batch.next_pos + accepted + 1
        batch.last_tok = next_tok
        stats = run.stats
        stats.rounds += 1
        stats.batch_sizes.append(batch.size)
        stats.verify_widths.append(verdict.width if verdict is not None else m + 1)
        for i, tokens, a, length, source in zip(batch.prompt_idx, committed, accepted_l, lengths_l, proposals.sources):
            stats.verified[i].append(length)
            stats.accepted[i].append(a)
            stats.sources[i].append(source)
            self._commit(run, i, tokens)
            if run.done[i] and i in run.sequence_context:
                self._learn_request(run, i)

    def _learn_request(self, run: BatchRun, i: int) -> None:
        """A row is served: hand the whole request to the OnlineSpec adapter (`online/observer.py`)."""
        start = time.perf_counter()
        stats, chunks = run.stats, run.sequence_context.pop(i)
        drafted = [(a, v) for a, v, s in zip(stats.accepted[i], stats.verified[i], stats.sources[i]) if s == "drafter"]
        self.online.on_request_end(torch.tensor(run.prompts[i] + run.outputs[i]), torch.cat(chunks),
                                   len(run.prompts[i]), sum(a for a, _ in drafted), sum(v for _, v in drafted),
                                   self.embeddings, self.lm_head)
        stats.seconds["online"] += time.perf_counter() - start

    # ------------------------------------------------------------------------------------------------ helpers
    def _sequences(self, run: BatchRun, prompt_idx: list[int], prompts_only: bool = False):
        """Each row's tokens so far (prompt + committed) when the sampler's processors read them, else None."""
        if not run.sampler.needs_sequences:
            return None
        return [torch.tensor(run.prompts[i] + ([] if prompts_only else run.outputs[i]), device=self.device)
                for i in prompt_idx]

    def _context(self, hidden_states) -> torch.Tensor:
        """Target hidden states at `target_layer_ids`, concatenated: `[b, n, len(ids) * H]` in the drafter's dtype."""
        ctx = torch.cat([hidden_states[i] for i in self.hidden_state_ids], dim=-1)
        return ctx.to(device=self.drafter_param.device, dtype=self.drafter_param.dtype)

    def _commit(self, run: BatchRun, i: int, tokens: list[int]) -> int:
        """Append a row's new tokens, cut after an EOS; mark it done at EOS or `max_new_tokens`. Returns the count."""
        for n, token in enumerate(tokens):
            if token in run.eos:
                tokens = tokens[: n + 1]
                run.done[i] = True
                break
        out = run.outputs[i]
        out.extend(tokens)
        run.stats.committed[i].append(len(tokens))
        if run.admission is not None:
            run.admission.committed(i, len(tokens))
        if len(out) >= run.max_new:
            run.done[i] = True
        return len(tokens)

    def _retire(self, run: BatchRun, batch: BatchState, compact: bool = True) -> None:
        """Drop finished rows; compact caches whose holes waste too much."""
        keep = [r for r, i in enumerate(batch.prompt_idx) if not run.done[i]]
        if len(keep) < batch.size:
            batch.select(keep)
        if not compact or self.compact_min_waste is None or batch.size == 0:
            return
        for cache in (batch.target, batch.drafter):
            if cache is not None and cache.wasted_slots() > max(self.compact_min_waste,
                                                                self.compact_ratio * cache.num_slots):
                cache.compact()
                run.stats.compactions += 1


# ---------------------------------------------------------------------------------------------------- entry points


def _prompt_lists(prompts, attention_mask=None) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(prompts.shape)}.")
        mask = torch.ones_like(prompts, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompts = [row[m].tolist() for row, m in zip(prompts.cpu(), mask.cpu())]
    prompts = [[int(t) for t in p] for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token.")
    return prompts


def run_knobs(drafter, generation_config=None, fixed_length: int | None = None, **overrides):
    """The `AdaFlashGenerationConfig` of a run: `generation_config` (default: the drafter's), copied, with
    `overrides` applied; `fixed_length=n` verifies exactly `min(n, budget)` drafted tokens per row."""
    knobs = copy.deepcopy(generation_config if generation_config is not None else generation_config_of(drafter))
    if fixed_length is not None:
        overrides = {"length_policy": "full", "num_assistant_tokens": fixed_length, **overrides}
    for key, value in overrides.items():
        setattr(knobs, key, value)
    knobs.validate()
    return knobs


def generate_batch(target, drafter, prompts, max_new_tokens: int, eos_token_id=None, do_sample: bool = False,
                   generation_config=None, runtime: SpeculationRuntime | None = None,
                   fixed_length: int | None = None, max_batch_size: int | None = None, continuous: bool = False,
                   attention_mask=None, generator: torch.Generator | None = None, admission: Admission | None = None,
                   profile: bool = False, return_stats: bool = False, logits_processor=None, **sampling):
    """Batched speculative decoding: the new tokens of each prompt, in input order (`list[list[int]]`).

    `prompts`: `list[list[int]]`, or `input_ids [b, T]` with `attention_mask`. `generation_config`: an
    `AdaFlashGenerationConfig` overrides the drafter's knobs; any other `GenerationConfig` is the call's decoding
    config, as `target.generate`'s. `do_sample`, `logits_processor` and `**sampling` (`temperature`, `top_k`,
    `top_p`, `repetition_penalty`, ...) are `generate`'s too (`AdaFlashBatchGenerator.generate`). `runtime`
    overrides the drafter's runtime components; `fixed_length=n` verifies exactly `min(n, budget)` drafted tokens per
    row (`0`: no drafting). `admission` (a request stream's driver) and `profile` (per-phase timing) are
    `AdaFlashBatchGenerator.generate`'s. With `return_stats=True` returns `(tokens, BatchStats)`.
    """
    from ..models.drafter.configuration_adaflash_drafter import AdaFlashGenerationConfig

    knobs_config = generation_config if isinstance(generation_config, AdaFlashGenerationConfig) else None
    decoding = None if knobs_config is not None else generation_config
    if fixed_length == 0:
        drafter = None
    knobs = run_knobs(drafter, knobs_config, fixed_length) if drafter is not None else None
    runner = AdaFlashBatchGenerator(target, drafter, generation_config=knobs, runtime=runtime)
    return runner.generate(prompts, max_new_tokens, eos_token_id=eos_token_id, do_sample=do_sample,
                           max_batch_size=max_batch_size, continuous=continuous, attention_mask=attention_mask,
                           generator=generator, admission=admission, profile=profile, return_stats=return_stats,
                           generation_config=decoding, logits_processor=logits_processor, **sampling)


def batched_generate(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, drafter=None,
                     max_new_tokens: int = 20, pad_token_id: int | None = None, **kwargs) -> torch.Tensor:
    """`target.generate`-style batched speculative decoding.

    Args:
        input_ids: `[b, T]` prompts, left-padded; attention_mask: `[b, T]` (default: no padding).
        pad_token_id: fills rows that stopped early; default: the target's `generation_config.pad_token_id`, else
            its first EOS id (as `generate` does), else 0.
        kwargs: `generate_batch` options (`eos_token_id`, `do_sample`, `generation_config`, `max_batch_size`, ...).
    Returns:
        `[b, T + new]` long: `input_ids` followed by each row's new tokens, padded to the longest row.
    """
    kwargs.pop("return_stats", None)
    tokens = generate_batch(target, drafter, input_ids, max_new_tokens, attention_mask=attention_mask, **kwargs)
    if pad_token_id is None:
        gc = target.generation_config
        eos = kwargs.get("eos_token_id")
        eos = gc.eos_token_id if eos is None else eos
        pad_token_id = gc.pad_token_id
        if pad_token_id is None:
            pad_token_id = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) if eos is not None else 0
    new = max((len(t) for t in tokens), default=0)
    out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + new), int(pad_token_id))
    out[:, : input_ids.shape[1]] = input_ids
    for r, t in enumerate(tokens):
        if t:
            out[r, input_ids.shape[1] : input_ids.shape[1] + len(t)] = torch.tensor(t, dtype=out.dtype)
    return out


__all__ = ["AdaFlashBatchGenerator", "Admission", "BatchRun", "BatchStats", "Proposals", "batched_generate",
           "generate_batch", "rejection_sample", "run_knobs"]
