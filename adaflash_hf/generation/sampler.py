# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The one speculative sampler of both engines: logits processors, drafted tokens, and the accept step.

`SpeculativeSampler` applies the caller's logits processors and warpers (temperature, top-k, top-p, repetition
penalty, ...: transformers' own `LogitsProcessorList`, built by transformers' `_get_logits_processor` from a
`GenerationConfig`, as `generate` builds it) to BOTH distributions:

* `draft`: the drafter's logits at each drafted position, with the sequence it would follow (context + earlier
  drafts), so drafted tokens and their `q` are what plain decoding with the same processors would draw;
* `accept`: the target's logits at the anchor and after each draft, then greedy (the longest prefix equal to the
  processed argmax, then that argmax) or speculative rejection sampling (`rejection_sample`: accept a draft with
  probability `min(1, p/q)`, on a rejection draw from `norm(max(p - q, 0))`, after a fully accepted block the bonus
  token from `p`). The committed tokens then follow plain decoding's processed distribution exactly.

The batched engine (`batch.py`) calls both for `b` rows. The bs=1 engine runs inside transformers'
`_assisted_decoding`, which processes the target's logits with the same `LogitsProcessorList` and applies
`_speculative_sampling` (the same rule as `rejection_sample`; tests/test_sampler.py checks they decide alike);
our candidate generator hands it drafts and processed draft logits from `SpeculativeSampler.draft_scores`.

Processors that read the sequence (repetition penalty, n-gram bans, ...) see each row's own unpadded sequence: rows
and positions of equal length are processed together, one call per length. Warpers that ignore the sequence
(`SEQUENCE_FREE`) run once over everything.
"""

import copy
from collections import defaultdict

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import logits_process as lp

SEQUENCE_FREE = tuple(getattr(lp, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper") if hasattr(lp, name))
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


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
            probability `p(d)` and after a rejection the token is drawn from `p` without `d`.
    Returns:
        `(accepted [b], next_token [b])`: draft `k` is accepted with probability `min(1, p/q)` while all earlier
        ones were; at the first rejection the next token is drawn from `norm(max(0, p - q))`; if all `lengths[r]`
        drafts are accepted it is the bonus token drawn from `p`. The committed tokens then follow `p` exactly.
        With `b == 1` and the global RNG this draws exactly what transformers' `_speculative_sampling` draws.
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
    ok = (u <= p_d / q_d) & (p_d > 0) & (torch.arange(m, device=p.device)[None, :] < lengths[:, None])
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


def decoding_config(target, generation_config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
    """The `GenerationConfig` `target.generate(generation_config=..., **kwargs)` would decode with (the target's own
    `generation_config` fills what is unset). Keywords that are not generation options raise `TypeError`."""
    config, unused = target._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    if unused:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unused))}")
    if config.do_sample and config.temperature is not None and not config.temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {config.temperature}.")
    for name in ("min_new_tokens", "begin_suppress_tokens", "guidance_scale"):  # need the prompt length / the model
        if getattr(config, name, None) not in (None, 0, 1):
            raise NotImplementedError(f"{name} is not supported by the batched engine.")
    return config


class SpeculativeSampler:
    """Processors + greedy/sampling + the accept rule, for `b` rows (module docstring).

    Args:
        logits_processor: the processors and warpers (a `LogitsProcessorList`; None or empty: raw logits).
        do_sample: sample (rejection sampling) or greedy.
        generator: RNG for sampling (None: torch's global RNG, as transformers uses).
    """

    def __init__(self, logits_processor: LogitsProcessorList | None = None, do_sample: bool = False,
                 generator: torch.Generator | None = None):
        self.processors = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.do_sample, self.generator = bool(do_sample), generator
        self.sequence_free = all(isinstance(p, SEQUENCE_FREE) for p in self.processors)
        # Processors that read only WHICH tokens occur (repetition penalty over the whole sequence): rows of any
        # lengths go in one call, each left-padded with its own first token (the set of its tokens is unchanged).
        self.set_only = all(isinstance(p, SEQUENCE_FREE) or (isinstance(p, lp.RepetitionPenaltyLogitsProcessor)
                                                             and p.prompt_ignore_length is None)
                            for p in self.processors)

    @classmethod
    def for_target(cls, target, generation_config: GenerationConfig | None = None, logits_processor=None,
                   generator: torch.Generator | None = None, **kwargs) -> "SpeculativeSampler":
        """The sampler of `target.generate(generation_config=..., logits_processor=..., **kwargs)`: the same
        `LogitsProcessorList` transformers builds for it (the target's `generation_config` fills what is unset)."""
        config = decoding_config(target, generation_config, **kwargs)
        processors = target._get_logits_processor(config, input_ids_seq_length=1, logits_processor=LogitsProcessorList(
            logits_processor or []), device=target.device)
        return cls(processors, config.do_sample, generator)

    @property
    def needs_sequences(self) -> bool:
        """Whether the processors read the rows' token sequences (callers then pass `contexts`)."""
        return not self.sequence_free

    def process(self, scores: torch.Tensor, sequences: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`scores [n, V]` (fp32) after the processors; `sequences[i]` is the token sequence row `i` follows."""
        if len(self.processors) == 0:
            return scores
        if self.sequence_free:
            return self.processors(torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device), scores)
        if self.set_only:
            width = max(seq.shape[0] for seq in sequences)
            ids = torch.stack([torch.cat([seq[:1].expand(width - seq.shape[0]), seq]) for seq in sequences])
            return self.processors(ids.to(scores.device), scores.clone())
        out = scores.clone()
        groups = defaultdict(list)
        for i, seq in enumerate(sequences):
            groups[seq.shape[0]].append(i)
        for idx in groups.values():
            ids = torch.stack([sequences[i] for i in idx]).to(scores.device)
            out[idx] = self.processors(ids, scores[idx].clone())
        return out

    def _pick(self, scores: torch.Tensor) -> torch.Tensor:
        """`[n, V]` processed scores -> `[n]` tokens (argmax, or a sample)."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=self.generator).squeeze(1)

    def draft_scores(self, scores: torch.Tensor, contexts: list[torch.Tensor] | None = None):
        """Drafted tokens of full-vocabulary drafter logits `[b, m, V]` (finite): `(ids [b, m], processed [b, m, V])`.

        Position `j` of row `r` is processed with the sequence `contexts[r] + ids[r, :j]` (what plain decoding's
        processors would see), then argmax or sampled."""
        scores = scores.float()
        b, m, v = scores.shape
        if self.sequence_free:
            processed = self.process(scores.reshape(b * m, v)).view(b, m, v)
            if not self.do_sample:
                return processed.argmax(dim=-1), processed
            ids = torch.multinomial(processed.softmax(-1).reshape(b * m, v), 1, generator=self.generator)
            return ids.view(b, m), processed
        processed = scores.clone()
        ids = torch.zeros(b, m, dtype=torch.long, device=scores.device)
        contexts = [c.to(scores.device) for c in contexts]
        for j in range(m):
            processed[:, j] = self.process(scores[:, j], [torch.cat([c, ids[r, :j]]) for r, c in enumerate(contexts)])
            ids[:, j] = self._pick(processed[:, j])
        return ids, processed

    def draft(self, logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int,
              contexts: list[torch.Tensor] | None = None):
        """Drafted tokens of drafter logits `[b, m, K]` (K: the draft vocabulary `vocab_ids`, or all V tokens).

        Returns `(ids [b, m], q [b, m, V] or None, usable [b])`: `q` the full-vocabulary probabilities the tokens
        were sampled from (None for greedy) and, per row, how many leading positions are usable (finite logits).
        Unusable positions get token 0 and a uniform q; callers must not verify them.
        """
        from .drafting import finite_prefix, to_full_vocab

        b, m, k = logits.shape
        usable = finite_prefix(logits)
        if m == 0:
            return torch.zeros(b, 0, dtype=torch.long, device=logits.device), None, usable
        bad = ~torch.isfinite(logits).all(dim=-1, keepdim=True)  # [b, m, 1]
        clean = torch.where(bad, torch.zeros_like(logits), logits)
        if len(self.processors) == 0:  # raw logits: stay in the draft vocabulary
            if not self.do_sample:
                ids = clean.argmax(dim=-1)
                return (ids if vocab_ids is None else vocab_ids.to(ids.device)[ids]), None, usable
            probs = torch.softmax(clean.float(), dim=-1)
            ids = torch.multinomial(probs.reshape(b * m, k), 1, generator=self.generator).view(b, m)
            if vocab_ids is not None:
                vocab_ids = vocab_ids.to(ids.device)
                probs, ids = to_full_vocab(probs, vocab_ids, vocab_size, 0.0), vocab_ids[ids]
            return ids, probs, usable
        ids, processed = self.draft_scores(to_full_vocab(clean.float(), vocab_ids, vocab_size, float("-inf")), contexts)
        return ids, (processed.softmax(dim=-1) if self.do_sample else None), usable

    def accept(self, logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor | None = None,
               one_hot: torch.Tensor | None = None, contexts: list[torch.Tensor] | None = None):
        """`(accepted [b], next_token [b])` from the target's logits `[b, m + 1, V]` over `[anchor, drafts]`.

        `contexts[r]`: row r's sequence up to and including the anchor (for sequence-reading processors)."""
        b, width, v = logits.shape
        m = width - 1
        scores = logits.float()
        if len(self.processors) and (self.sequence_free or not self.set_only):
            flat_seqs = None
            if not self.sequence_free:
                flat_seqs = [torch.cat([contexts[r].to(drafts.device), drafts[r, :j]]) for r in range(b)
                             for j in range(width)]
            scores = self.process(scores.reshape(b * width, v), flat_seqs).view(b, width, v)
        elif len(self.processors):  # set-only processors: every (row, position) in one call, built without a loop
            ids = self._padded(contexts, drafts)  # [b, W + m]: each row padded with its own first token
            first = ids[:, :1].expand(-1, m)
            upto = torch.arange(m, device=drafts.device)[None, :] < torch.arange(width, device=drafts.device)[:, None]
            per_pos = torch.cat([ids[:, None, : ids.shape[1] - m].expand(-1, width, -1),
                                 torch.where(upto[None], drafts[:, None, :], first[:, None, :])], dim=2)
            scores = self.processors(per_pos.reshape(b * width, -1), scores.reshape(b * width, v)).view(b, width, v)
        if not self.do_sample:
            target_tok = scores.argmax(dim=-1)  # [b, m + 1]
            match = (drafts == target_tok[:, :m]) & (torch.arange(m, device=drafts.device)[None, :] < lengths[:, None])
            accepted = match.long().cumprod(dim=1).sum(dim=1)
            return accepted, target_tok.gather(1, accepted[:, None]).squeeze(1)
        return rejection_sample(scores.softmax(dim=-1), q, drafts, lengths, self.generator, one_hot)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """`[b, q, V]` target logits -> `[b, q]` processed argmax at every slot (tree verification,
        `candidates.py`: sequence-free processors only, as no slot has one sequence to give them)."""
        if not self.sequence_free:
            raise ValueError("per-slot greedy tokens need sequence-free logits processors.")
        b, q, v = logits.shape
        return self.process(logits.float().reshape(b * q, v)).argmax(dim=-1).view(b, q)

    @staticmethod
    def _padded(contexts: list[torch.Tensor], drafts: torch.Tensor) -> torch.Tensor:
        """`[b, W + m]`: each context left-padded with its own first token to the longest, then the drafts."""
        width = max(c.shape[0] for c in contexts)
        rows = [torch.cat([c[:1].expand(width - c.shape[0]), c]).to(drafts.device) for c in contexts]
        return torch.cat([torch.stack(rows), drafts], dim=1)

    def next_tokens(self, logits: torch.Tensor, contexts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`[b, V]` logits after each row's sequence -> `[b]` tokens (plain decoding's step)."""
        return self._pick(self.process(logits.float(), contexts))


__all__ = ["SAMPLING_KEYS", "SEQUENCE_FREE", "SpeculativeSampler", "decoding_config", "rejection_sample"]
