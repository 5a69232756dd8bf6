# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Batched speculative decoding with per-row adaptive verify lengths (high-concurrency serving).

`generate_batch(target, drafter, prompts, max_new_tokens)` decodes many sequences together; `batched_generate` is
the same with `target.generate`'s tensor interface (left-padded `input_ids [b, T]` in, `[b, T + new]` out).
`AdaFlashBatchGenerator` is the object behind both (it keeps the per-run `BatchStats`).

One round, for all active rows at once:

1. ONE drafter forward drafts a block per row: queries `[anchor, mask x (B-1)]` (embedded with the target's
   embeddings), keys/values = the drafter's cached context + the row's new context (target hidden states at
   `target_layer_ids` of the tokens committed last round, padded to the longest row) + the block.
2. Verify lengths: `fixed_length`, or the whole block, or (length head + cost model) the joint choice of
   `batch_verify_lengths`: because the verify forward is padded to the longest row, every row verifies
   `min(M, budget_r)` drafted tokens, with `M` maximising the batch's expected committed tokens per second
   `sum_r (1 + sum_{k <= min(M, budget_r)} S_r(k)) / (draft seconds + cost.seconds(M + 1, b))`. Verifying fewer
   than `M` in a row would not make the padded forward cheaper, so it could only lose accepted tokens. `M` may be
   0 (every row then decodes one token). `budget_r = min(B - 1, tokens left - 1)`: nothing is drafted past
   `max_new_tokens`.
3. ONE target forward verifies `[anchor, d_1 .. d_L]` for every row (padded to `M + 1`, padding masked), with
   `output_hidden_states` at `target_layer_ids + 1`.
4. Each row accepts its own prefix: greedy, the longest prefix equal to the target's argmax, then the target's
   token; sampling, speculative rejection sampling (`rejection_sample`). Committed tokens are cut after an EOS.
5. Plain rounds: with `speculation="auto"` (default) a `SpeculationSwitch` picks, per round, speculating (steps 1-4)
   or a plain round (no drafter forward, every row verifies only its last token, as batched `generate` does),
   whichever has been committing more tokens per second of round time; an arm unused for a while is retried. The
   target context of plain rounds is kept and handed to the drafter at its next forward (lazily, as the bs=1
   generator's pending context), so a drafter that drafts again sees exactly what it would have seen.
   `speculation="always"` drafts every round (the plain fallback then only happens when M = 0 is chosen).
6. Hybrid proposals (`drafter.config.hybrid_lookup`, see `batch_proposals.py`): each row also looks its text up
   with transformers' n-gram prompt lookup; a row with a match verifies the lookup continuation instead of its
   drafted block when that promises at least as many accepted tokens (cut to the round's verify width), and the
   switch gets a third arm, "lookup" rounds (no drafter forward; only rows with a match verify proposals).
   OnlineSpec (`drafter.online_adapter`): after each speculative round, every row that verified drafted tokens
   feeds the adapter one `RoundFeedback` (its block, its last `context_window` context states, raw target logits).
7. Finished rows (EOS or `max_new_tokens`) leave the batch; with `continuous=True` waiting prompts take the free
   slots: they are prefilled together in a separate target forward and merged into the batch (`RaggedCache.merge`).

Cache design (see `batch_state.py`): one transformers `DynamicCache` for the target and one `DFlashCache` for the
drafter, each with a bool validity mask `[b, S]`. Every forward appends the same number of slots to every row;
slots that are not part of a row's sequence (prompt left padding, verify padding, rejected drafts, context padding)
stay in the cache but are masked out forever through the 2D attention mask, and `position_ids` count only each
row's valid tokens, so every row attends to exactly what it would see alone. The drafter's block entries are
cropped right after its forward, so its cache holds context only. Removing rows index-selects the batch axis of
every layer; when holes waste more than `compact_ratio` of the slots (and at least `compact_min_waste` slots) a
cache is compacted (each row's valid slots gathered to the right end, in order).

Exactness: in greedy mode every row equals plain greedy decoding of its prompt alone, up to floating-point
differences between batched/padded and bs=1 forwards (they can only flip exact or near ties of the top-2 logits).
In sampling mode every row is a sample of the target's distribution (temperature only: no top-k/top-p/processors).
"""

import time
from collections import deque

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DFlashCache

from .batch_proposals import RowLookup, online_feedback, pad_proposals
from .batch_state import BatchState, BatchStats, MeasuredCost, RaggedCache, SpeculationSwitch


# ---------------------------------------------------------------------------------------------------- pure functions


def batch_verify_lengths(survival: torch.Tensor, budgets: torch.Tensor, cost,
                         fixed_seconds: float = 0.0) -> torch.Tensor:
    """Per-row verify lengths `min(M, budget_r)` with the `M` that maximises expected committed tokens per second.

    Args:
        survival: `[b, n]` length head survival `S_r(k)` = P(first k drafted tokens of row r all accepted).
        budgets: `[b]` most drafted tokens each row may verify (`<= n`).
        cost: a `TargetCostModel` (`seconds(num_tokens, batch_size)`); `None`: every length costs the same, so
            every row verifies its whole budget.
        fixed_seconds: per-round cost that does not depend on the length (drafting).
    Returns:
        `[b]` long, on `budgets`' device.
    """
    b, n = survival.shape
    if cost is None or b == 0:
        return budgets.clone()
    caps = budgets.to("cpu")
    k = torch.arange(1, n + 1)
    s = survival.float().cpu() * (k[None, :] <= caps[:, None])
    expected = torch.cat([torch.zeros(1), s.sum(dim=0).cumsum(dim=0)]) + b  # [n + 1]: sum over rows of E[commit]
    top = int(caps.max())
    seconds = torch.tensor([fixed_seconds + cost.seconds(m + 1, b) for m in range(top + 1)])
    m = int(torch.argmax(expected[: top + 1] / seconds))
    return budgets.clamp(max=m)


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, lengths: torch.Tensor,
                     generator: torch.Generator | None = None,
                     one_hot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling, independently per row.

    Args:
        p: `[b, M + 1, V]` target probabilities after the anchor and after each drafted token.
        q: `[b, M, V]` drafter probabilities the drafts were sampled from; None when `M == 0` or when every row's
            drafts are deterministic.
        drafts: `[b, M]` drafted tokens; row r only verifies its first `lengths[r]`.
        lengths: `[b]` verify lengths (`<= M`).
        one_hot: `[b]` bool, rows whose drafts are deterministic proposals (n-gram lookup; default: every row when
            `q` is None, none otherwise): their q is the one-hot of the drafted token, so a draft is accepted with
            probability `p(d)` and after a rejection the token is drawn from `p` without `d`. That is the
            distribution transformers' prompt-lookup path gets (no candidate logits: sample from `p` at every
            position and keep drafts while they equal the sample), without materialising one-hot `[b, M, V]`.
    Returns:
        `(accepted [b], next_token [b])`: draft `k` is accepted with probability `min(1, p/q)` while all earlier
        ones were; at the first rejection the next token is drawn from `norm(max(0, p - q))`; if all `lengths[r]`
        drafts are accepted it is the bonus token drawn from `p`. The committed tokens then follow `p` exactly.
    """
    b, width, _ = p.shape
    m = width - 1
    rows = torch.arange(b, device=p.device)
    if m == 0:
        accepted = torch.zeros(b, dtype=torch.long, device=p.device)
        return accepted, torch.multinomial(p[:, 0], 1, generator=generator).squeeze(1)
    if one_hot is None:
        one_hot = torch.full((b,), q is None, dtype=torch.bool, device=p.device)
    p_d = p[:, :m].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    q_d = torch.where(one_hot[:, None], torch.ones_like(q_d), q_d)
    u = torch.rand(b, m, device=p.device, generator=generator)
    ok = (u * q_d < p_d) & (torch.arange(m, device=p.device)[None, :] < lengths[:, None])
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    p_next = p[rows, accepted]  # [b, V]
    at = accepted.clamp(max=m - 1)
    q_next = p_next.new_zeros(p_next.shape) if q is None else q[rows, at]
    if one_hot.any():
        point = p_next.new_zeros(p_next.shape).scatter_(1, drafts[rows, at][:, None], 1.0)
        q_next = torch.where(one_hot[:, None], point, q_next)
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    rejected = (accepted < lengths)[:, None] & (mass > 0)
    dist = torch.where(rejected, residual / mass.clamp(min=torch.finfo(residual.dtype).tiny), p_next)
    return accepted, torch.multinomial(dist, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------------------------------------- the generator


class AdaFlashBatchGenerator:
    """Batched speculative decoding of many prompts with one target and one block drafter (module docstring).

    Args:
        target: a decoder-only causal LM with full-attention layers (Llama/Qwen/Mistral-style).
        drafter: an AdaFlash/DFlash drafter for `target`; `None` runs plain batched decoding (no drafts).
        length_head: an `AdaFlashLengthHead`; `None` falls back to the one attached to the drafter
            (`drafter.attach_length_head`), as `generate(assistant_model=drafter)` does.
        cost_model: a `TargetCostModel` for the head's length choice (fallback: the drafter's), corrected during a
            run by the verification forwards it times (`MeasuredCost`); without one every row verifies its budget.
        fixed_length: verify exactly `min(fixed_length, budget)` drafted tokens per row (ignores the head);
            `0` disables drafting.
        compact_ratio / compact_min_waste: compact a cache when its fully-removable slots exceed
            `max(compact_min_waste, compact_ratio * slots)`; `compact_min_waste=None` never compacts.
        speculation: `"auto"`: per round, speculate or decode plainly, whichever commits more tokens per second
            (`SpeculationSwitch`, module docstring step 5); `"always"`: draft every round the budget allows.
    """

    def __init__(self, target, drafter=None, length_head=None, cost_model=None, fixed_length: int | None = None,
                 compact_ratio: float = 0.5, compact_min_waste: int | None = 32, speculation: str = "auto"):
        if speculation not in ("auto", "always"):
            raise ValueError(f"speculation must be 'auto' or 'always', got {speculation!r}.")
        self.speculation = speculation
        self.target = target
        self.drafter = drafter if fixed_length != 0 else None
        self.length_head = length_head if length_head is not None else getattr(drafter, "length_head", None)
        self.cost_model = cost_model if cost_model is not None else getattr(drafter, "cost_model", None)
        self.fixed_length = fixed_length
        self.compact_ratio, self.compact_min_waste = compact_ratio, compact_min_waste
        self.embeddings = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = self.embeddings.weight.device
        self.layer_ids = list(drafter.config.target_layer_ids) if self.drafter is not None else []
        self.hidden_state_ids = [i + 1 for i in self.layer_ids] or None
        if self.drafter is not None:
            self.block_size = int(drafter.config.block_size)
            self.drafter_param = next(drafter.parameters())
        self.stats = BatchStats()
        self.switch = SpeculationSwitch()
        self._active: BatchState | None = None
        self._lookup = self._online = self._proposals = None

    @property
    def active_prompt_indices(self) -> list[int]:
        """Input indices of the rows of the batch, in batch order (e.g. for a test drafter that must know them)."""
        return list(self._active.prompt_idx) if self._active is not None else []

    @property
    def active_state(self) -> BatchState | None:
        """The running batch during `generate` (for inspection and tests), else None."""
        return self._active

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, eos_token_id=None, do_sample: bool = False,
                 temperature: float = 1.0, max_batch_size: int | None = None, continuous: bool = False,
                 attention_mask: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> list[list[int]]:
        """New tokens of every prompt (input order; EOS included when produced).

        Args:
            prompts: `list[list[int]]` (ragged), or `input_ids [b, T]` with `attention_mask [b, T]` (any padding).
            eos_token_id: int or list; `None`: the target's `generation_config.eos_token_id`; `[]`: no EOS.
            max_batch_size: most rows decoded together (default: all). Without `continuous`, prompts are decoded in
                consecutive static batches; with it, a waiting prompt joins as soon as a row finishes (waiting
                prompts are prefilled together in their own target forward, then merged into the running batch).
            generator: RNG for sampling (on the model's device).
        """
        prompts = _prompt_lists(prompts, attention_mask)
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}.")
        if eos_token_id is None:
            eos_token_id = self.target.generation_config.eos_token_id
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        self._cfg = dict(max_new=int(max_new_tokens), eos=eos, sample=do_sample, temperature=float(temperature),
                         generator=generator)
        self.stats = stats = BatchStats.for_prompts(len(prompts))
        self.switch = switch = SpeculationSwitch()
        self._cost = None if self.cost_model is None else MeasuredCost(self.cost_model)
        drafter = self.drafter
        self._lookup = RowLookup(drafter.config, eos) if drafter is not None and getattr(
            drafter.config, "hybrid_lookup", False) else None
        self._online = getattr(drafter, "online_adapter", None) if drafter is not None else None
        self._prompts, self._proposals = prompts, None
        self._outputs = outputs = [[] for _ in prompts]
        self._done = [False] * len(prompts)
        if max_new_tokens <= 0 or not prompts:
            return outputs
        cap = max_batch_size or len(prompts)
        waiting = deque(range(len(prompts)))
        start = time.perf_counter()
        batch = None
        try:
            while waiting or (batch is not None and batch.size):
                size = 0 if batch is None else batch.size
                if waiting and size < cap and (size == 0 or continuous):
                    take = [waiting.popleft() for _ in range(min(cap - size, len(waiting)))]
                    new = self._prefill([prompts[i] for i in take], take)
                    stats.prefill_joins += int(size > 0 and new.size > 0)
                    batch = new if batch is None else batch.merge(new)
                    if batch.size == 0:
                        continue
                self._active = batch
                t0 = self._clock()
                arm, committed = self._round(batch, self._arm(batch))
                self._retire(batch)
                if arm is not None:
                    switch.record(arm, committed, self._clock() - t0)
        finally:
            self._active = None
            stats.seconds["total"] += time.perf_counter() - start
        if self.drafter is not None:
            self.drafter.batch_generation_stats = stats
        return outputs

    # ------------------------------------------------------------------ prefill

    def _prefill(self, prompts: list[list[int]], prompt_idx: list[int]) -> BatchState:
        """One target forward over left-padded `prompts`; commits each row's first token. Returns live rows."""
        start = self._clock()
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
        first = self._choose(out.logits[:, -1].float())  # [b]
        batch = BatchState(list(prompt_idx), first, mask.sum(dim=1), cache, None)
        if self.drafter is not None:
            dmask = torch.zeros(b, 0, dtype=torch.bool, device=self.drafter_param.device)
            batch.drafter = RaggedCache(DFlashCache(config=self.drafter.config), dmask)
            batch.drafter.check_layers()
            ctx = self._context(out.hidden_states)
            if self._online is not None:  # the window each row's drafting forward is replayed on
                batch.start_window(self._online.config.context_window, ctx.shape[-1], ctx.dtype, ctx.device)
            batch.add_context(ctx, mask, pos)
        self.stats.prefill_forwards += 1
        self.stats.seconds["prefill"] += self._clock() - start
        for r, token in enumerate(first.tolist()):
            self._commit(prompt_idx[r], [token])
        self._retire(batch, compact=False)
        return batch

    # ------------------------------------------------------------------ one round

    def _arm(self, batch: BatchState) -> str | None:
        """`"draft"` / `"lookup"` / `"plain"` for this round, or None when there is no choice (no drafter, or no row
        may draft). With hybrid lookup, also finds each row's lookup proposal (`self._proposals`)."""
        if self.drafter is None:
            return None
        self._proposals = None
        caps = [self._cfg["max_new"] - len(self._outputs[i]) - 1 for i in batch.prompt_idx]
        if max(caps) <= 0:
            return None
        if self._lookup is not None:
            start = time.perf_counter()
            self._proposals = self._lookup.propose([self._prompts[i] + self._outputs[i] for i in batch.prompt_idx],
                                                   caps)
            self.stats.seconds["lookup"] += time.perf_counter() - start
        if self.speculation == "always":
            return "draft"
        if self._lookup is None:
            return self.switch.choose()
        return self.switch.choose(("draft", "lookup", "plain") if any(self._proposals) else ("draft", "plain"))

    def _round(self, batch: BatchState, arm: str | None) -> tuple[str | None, int]:
        """Draft (one drafter forward), choose lengths, verify (one target forward), accept, commit.

        `arm == "draft"` speculates (rows may swap in their lookup proposal), `"lookup"` verifies the rows' n-gram
        lookup proposals (no drafter forward); otherwise the round is plain (one token per row, no drafter forward).
        Returns `(arm, tokens committed by all rows)`.
        """
        cfg, stats = self._cfg, self.stats
        t0 = self._clock()
        b = batch.size
        device = self.device
        drafts = torch.zeros(b, 0, dtype=torch.long, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        q = one_hot = None  # one_hot: rows whose drafts are deterministic (lookup proposals)
        sources = ["none"] * b
        if arm == "draft":
            remaining = torch.tensor([cfg["max_new"] - len(self._outputs[i]) for i in batch.prompt_idx])
            budget = (remaining - 1).clamp(min=0, max=self.block_size - 1).to(device)
            states = self._draft(batch)[:, 1 : 1 + int(budget.max())]  # [b, n, H] drafted positions
            logits, vocab_ids = self._draft_logits(states)  # [b, n, V or K]
            t1 = self._clock()
            stats.seconds["draft"] += t1 - t0
            lengths = self._lengths(states, logits, budget, t0)
            stats.seconds["length"] += self._clock() - t1
            drafts, q = self._pick_drafts(logits[:, : int(lengths.max())], vocab_ids)
            sources = ["drafter" if n else "none" for n in lengths.tolist()]
            if self._proposals is not None:
                drafts, lengths, one_hot = self._lookup.substitute(batch.prompt_idx, self._proposals, drafts,
                                                                   lengths, sources)
        elif arm == "lookup":
            stats.lookup_rounds += 1
            drafts, lengths = pad_proposals(self._proposals, device)
            sources = ["lookup" if p else "none" for p in self._proposals]
        else:
            stats.plain_rounds += 1

        t2 = self._clock()
        m = drafts.shape[1]
        j = torch.arange(m + 1, device=device)
        input_ids = torch.cat([batch.last_tok[:, None], drafts], dim=1)  # [b, m + 1]
        position_ids = batch.next_pos[:, None] + j
        out = self.target(input_ids=input_ids, attention_mask=batch.target.attention_mask(j <= lengths[:, None]),
                          position_ids=position_ids, cache=batch.target.cache, use_cache=True,
                          output_hidden_states=self.hidden_state_ids)
        logits = out.logits  # [b, m + 1, V]
        t3 = self._clock()
        stats.seconds["verify"] += t3 - t2
        if self._cost is not None:
            self._cost.observe(m + 1, b, t3 - t2)

        if m == 0:  # plain round: no drafts to check
            accepted = torch.zeros(b, dtype=torch.long, device=device)
            next_tok = self._choose(logits[:, 0].float())
        elif cfg["sample"]:
            p = torch.softmax(logits.float() / cfg["temperature"], dim=-1)
            accepted, next_tok = rejection_sample(p, q, drafts, lengths, cfg["generator"], one_hot)
        else:
            target_tok = logits.argmax(dim=-1)  # [b, m + 1]
            match = (drafts == target_tok[:, :m]) & (j[None, :m] < lengths[:, None])
            accepted = match.long().cumprod(dim=1).sum(dim=1)
            next_tok = target_tok.gather(1, accepted[:, None]).squeeze(1)
        batch.target.append(j[None, :] <= accepted[:, None])
        accepted_list, lengths_list = accepted.tolist(), lengths.tolist()
        if self._lookup is not None:
            self._lookup.record(batch.prompt_idx, sources, accepted_list)
        if self._online is not None and arm == "draft":  # before add_context: each row's window ends at its anchor
            t_online = self._clock()
            online_feedback(self._online, self.drafter, self.lm_head, batch, self._noise, logits, lengths_list,
                            accepted_list, sources)
            stats.seconds["online"] += self._clock() - t_online
        if self.drafter is not None:
            keep = int(accepted.max()) + 1
            ctx_mask = (j[None, :keep] <= accepted[:, None]).to(batch.drafter.mask.device)
            batch.add_context(self._context(out.hidden_states)[:, :keep], ctx_mask, position_ids[:, :keep])
        batch.next_pos = batch.next_pos + accepted + 1
        batch.last_tok = next_tok

        stats.rounds += 1
        stats.batch_sizes.append(b)
        stats.verify_widths.append(m + 1)
        committed = 0
        rows = zip(batch.prompt_idx, drafts.tolist(), accepted_list, next_tok.tolist(), lengths_list, sources)
        for i, row_drafts, a, token, length, source in rows:
            stats.verified[i].append(length)
            stats.accepted[i].append(a)
            stats.sources[i].append(source)
            committed += self._commit(i, row_drafts[:a] + [token])
        stats.seconds["accept"] += self._clock() - t3
        return arm, committed

    def _draft(self, batch: BatchState) -> torch.Tensor:
        """One drafter forward for every row: `[b, B, H]` block states. Consumes the pending context."""
        dev, dtype, block = self.drafter_param.device, self.drafter_param.dtype, self.block_size
        b = batch.size
        ctx, ctx_mask, ctx_pos = batch.ctx, batch.ctx_mask, batch.ctx_pos
        batch.ctx = batch.ctx_mask = batch.ctx_pos = None
        if ctx is None:
            ctx = torch.zeros(b, 0, len(self.layer_ids) * self.embeddings.weight.shape[1], dtype=dtype, device=dev)
            ctx_mask = torch.zeros(b, 0, dtype=torch.bool, device=dev)
            ctx_pos = torch.zeros(b, 0, dtype=torch.long, device=dev)
        ctx_mask = ctx_mask.to(dev)
        noise_ids = torch.full((b, block), int(self.drafter.config.mask_token_id), dtype=torch.long, device=self.device)
        noise_ids[:, 0] = batch.last_tok
        noise = self._embed(noise_ids).to(device=dev, dtype=dtype)
        position_ids = torch.cat(
            [ctx_pos.to(dev), batch.next_pos.to(dev)[:, None] + torch.arange(block, device=dev)], dim=1
        )
        attention_mask = batch.drafter.attention_mask(
            torch.cat([ctx_mask, torch.ones(b, block, dtype=torch.bool, device=dev)], dim=1)
        )
        context = ctx.to(device=dev, dtype=dtype).masked_fill(~ctx_mask[..., None], 0.0) if ctx.shape[1] else None
        self._noise = noise  # the rows' block queries, for OnlineSpec feedback
        out = self.drafter(noise_embeds=noise, context_hidden_states=context, attention_mask=attention_mask,
                           position_ids=position_ids, cache=batch.drafter.cache)
        batch.drafter.crop(block)  # the block's keys/values: only the context stays cached
        batch.drafter.append(ctx_mask)
        self.stats.drafter_forwards += 1
        return out.last_hidden_state

    def _draft_logits(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hasattr(self.drafter, "draft_logits"):
            logits, vocab_ids = self.drafter.draft_logits(states, self.lm_head)
        else:  # e.g. a DFlash drafter loaded with trust_remote_code
            logits, vocab_ids = self.lm_head(states.to(self.lm_head.weight.dtype)), None
        return logits.to(self.device), None if vocab_ids is None else vocab_ids.to(self.device)

    def _lengths(self, states, logits, budget, t0) -> torch.Tensor:
        """`[b]` drafted tokens each row verifies (module docstring, step 2)."""
        if self.fixed_length is not None:
            return budget.clamp(max=self.fixed_length)
        head = self.length_head
        if head is None or self.cost_model is None:
            return budget
        from ..models.length_head import probability_features

        features = probability_features(logits) if head.config.num_prob_features else None
        param = next(head.parameters())
        survival = head(block_states=states.to(device=param.device, dtype=param.dtype),
                        prob_features=None if features is None else features.to(param.device)).survival
        return batch_verify_lengths(survival, budget, self._cost, fixed_seconds=self._clock() - t0)

    def _pick_drafts(self, logits: torch.Tensor, vocab_ids: torch.Tensor | None):
        """Drafted tokens `[b, m]` (argmax, or sampled) and, when sampling, their full-vocabulary probs `[b, m, V]`."""
        b, m, k = logits.shape
        if not self._cfg["sample"]:
            ids = logits.argmax(dim=-1)
            return (ids if vocab_ids is None else vocab_ids[ids]), None
        probs = torch.softmax(logits.float() / self._cfg["temperature"], dim=-1)
        if m == 0:
            return torch.zeros(b, 0, dtype=torch.long, device=logits.device), None
        ids = torch.multinomial(probs.reshape(b * m, k), 1, generator=self._cfg["generator"]).view(b, m)
        if vocab_ids is not None:
            full = probs.new_zeros(b, m, self.vocab_size)
            probs = full.scatter_(-1, vocab_ids.expand(b, m, k), probs)
            ids = vocab_ids[ids]
        return ids, probs

    # ------------------------------------------------------------------ helpers

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """`[b, V]` logits -> `[b]` tokens (argmax, or a sample at the run's temperature)."""
        if not self._cfg["sample"]:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / self._cfg["temperature"], dim=-1)
        return torch.multinomial(probs, 1, generator=self._cfg["generator"]).squeeze(1)

    def _context(self, hidden_states) -> torch.Tensor:
        """Target hidden states at `target_layer_ids`, concatenated: `[b, n, len(ids) * H]` in the drafter's dtype."""
        ctx = torch.cat([hidden_states[i] for i in self.hidden_state_ids], dim=-1)
        return ctx.to(device=self.drafter_param.device, dtype=self.drafter_param.dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target input embeddings, bypassing an optional embedding norm (as transformers' DFlash generator)."""
        embed_norm = getattr(self.embeddings, "embed_norm", None)
        if embed_norm is None:
            return self.embeddings(ids)
        try:
            self.embeddings.embed_norm = nn.Identity()
            return self.embeddings(ids)
        finally:
            self.embeddings.embed_norm = embed_norm

    def _commit(self, i: int, tokens: list[int]) -> int:
        """Append a row's new tokens, cut after an EOS; mark it done at EOS or `max_new_tokens`. Returns the count."""
        eos = self._cfg["eos"]
        for n, token in enumerate(tokens):
            if token in eos:
                tokens = tokens[: n + 1]
                self._done[i] = True
                break
        out = self._outputs[i]
        out.extend(tokens)
        self.stats.committed[i].append(len(tokens))
        if len(out) >= self._cfg["max_new"]:
            self._done[i] = True
        return len(tokens)

    def _retire(self, batch: BatchState, compact: bool = True) -> None:
        """Drop finished rows; compact caches whose holes waste too much."""
        keep = [r for r, i in enumerate(batch.prompt_idx) if not self._done[i]]
        if len(keep) < batch.size:
            batch.select(keep)
        if not compact or self.compact_min_waste is None or batch.size == 0:
            return
        for cache in (batch.target, batch.drafter):
            if cache is not None and cache.wasted_slots() > max(self.compact_min_waste,
                                                                self.compact_ratio * cache.num_slots):
                cache.compact()
                self.stats.compactions += 1

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


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


def generate_batch(target, drafter, prompts, max_new_tokens: int, eos_token_id=None, do_sample: bool = False,
                   temperature: float = 1.0, length_head=None, cost_model=None, fixed_length: int | None = None,
                   max_batch_size: int | None = None, continuous: bool = False, attention_mask=None,
                   generator: torch.Generator | None = None, return_stats: bool = False, speculation: str = "auto"):
    """Batched speculative decoding: the new tokens of each prompt, in input order (`list[list[int]]`).

    `prompts`: `list[list[int]]`, or `input_ids [b, T]` with `attention_mask`. See `AdaFlashBatchGenerator` for the
    other arguments. With `return_stats=True` returns `(tokens, BatchStats)`; the stats are also left on
    `drafter.batch_generation_stats`.
    """
    runner = AdaFlashBatchGenerator(target, drafter, length_head=length_head, cost_model=cost_model,
                                    fixed_length=fixed_length, speculation=speculation)
    tokens = runner.generate(prompts, max_new_tokens, eos_token_id=eos_token_id, do_sample=do_sample,
                             temperature=temperature, max_batch_size=max_batch_size, continuous=continuous,
                             attention_mask=attention_mask, generator=generator)
    return (tokens, runner.stats) if return_stats else tokens


def batched_generate(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, drafter=None,
                     max_new_tokens: int = 20, pad_token_id: int | None = None, **kwargs) -> torch.Tensor:
    """`target.generate`-style batched speculative decoding.

    Args:
        input_ids: `[b, T]` prompts, left-padded; attention_mask: `[b, T]` (default: no padding).
        pad_token_id: fills rows that stopped early; default: the target's `generation_config.pad_token_id`, else
            its first EOS id (as `generate` does), else 0.
        kwargs: `generate_batch` options (`eos_token_id`, `do_sample`, `length_head`, `max_batch_size`, ...).
    Returns:
        `[b, T + new]` long: `input_ids` followed by each row's new tokens, padded to the longest row.
    """
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


__all__ = ["AdaFlashBatchGenerator", "BatchStats", "batch_verify_lengths", "batched_generate", "generate_batch",
           "rejection_sample"]
