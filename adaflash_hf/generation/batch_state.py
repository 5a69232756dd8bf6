# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""State of batched speculative decoding (`generation/batch.py`): ragged KV caches, the batch, statistics.

`BatchState` holds the active rows (last token, position, the target's and the drafter's `RaggedCache`, the target
context the drafter has not seen yet); `BatchStats` the per-run statistics; `SpeculationSwitch` decides, round by
round, whether speculating (drafter forward + wider verify) currently commits more tokens per second than plain
one-token decoding of the batch.

A `RaggedCache` is a transformers `DynamicCache` (or `DFlashCache`) holding one row per sequence, plus a boolean
validity mask `[b, S]` over its `S` slots. Rows grow by the same number of slots per forward (the batch is padded),
but only some of those slots are *valid* for a given row: left padding of the prompts, padding of short verify
blocks, drafted tokens the target rejected, padding of the drafter's per-row context. Invalid slots stay in the
cache, and are masked out forever through the 2D attention mask built from `mask`; positions (RoPE) are passed
explicitly by the caller and count only the valid tokens of each row, so a row sees exactly the keys/values it
would see decoding alone.

Why this is exact: transformers builds the causal mask from *slot* indices (a query at slot `s` sees slots `<= s`)
ANDed with the 2D padding mask, and new tokens are always appended after every existing slot. The relative order of
a row's valid slots is never changed, so which keys a query sees (and at which RoPE positions) is the same as in an
unpadded bs=1 run.

Operations (all act on every layer's `keys`/`values` `[b, kv_heads, S, head_dim]`):

* `attention_mask(new_valid)`: the 2D mask `[b, S + n]` for a forward that appends `n` slots.
* `append(new_valid)`: record the validity of the `n` slots the forward appended.
* `select(indices)`: keep some rows (finished rows leave the batch).
* `merge(other)`: concatenate two batches along the batch axis; the shorter one is left-padded with invalid
  zero slots (continuous batching: a newly prefilled segment joins the running batch).
* `compact()`: per row, gather the valid slots to the right end (stable), dropping columns that are invalid
  for every row; `S` becomes the largest per-row valid count. Called when holes waste too much.

Only plain full-attention `DynamicLayer`s are supported (sliding-window / linear-attention layers would not see
the holes correctly): `check_layers` refuses anything else.
"""

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RaggedCache:
    """A transformers cache with per-row valid slots.

    Args:
        cache: a `DynamicCache` / `DFlashCache` whose layers hold `[b, heads, S, dim]` tensors (or are not yet
            initialised, when `S == 0`).
        mask: `[b, S]` bool, True where the slot holds a token of that row.
    """

    def __init__(self, cache: Cache, mask: torch.Tensor):
        self.cache = cache
        self.mask = mask.bool()

    # ------------------------------------------------------------------ queries

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def num_slots(self) -> int:
        return self.mask.shape[1]

    def valid_counts(self) -> torch.Tensor:
        """`[b]` number of valid slots per row (= the row's token count in this cache)."""
        return self.mask.sum(dim=1)

    def attention_mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """2D mask `[b, S + n]` for a forward that appends `n` slots whose validity is `new_valid [b, n]`."""
        return torch.cat([self.mask, new_valid.to(device=self.mask.device, dtype=torch.bool)], dim=1)

    def check_layers(self) -> None:
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(
                    f"batched speculative decoding supports full-attention DynamicLayer caches only, got "
                    f"{type(layer).__name__} (sliding-window / linear-attention layers cannot be masked per slot)."
                )

    def check_consistent(self) -> None:
        """Raise if a layer's batch or slot count differs from the mask's (a bookkeeping bug)."""
        for i, layer in enumerate(self.cache.layers):
            n = _layer_len(layer)
            rows = layer.keys.shape[0] if n else self.batch_size
            if n != self.num_slots or rows != self.batch_size:
                raise RuntimeError(f"cache layer {i} holds [{rows} rows, {n} slots], the mask [{self.batch_size}, "
                                   f"{self.num_slots}].")

    # ------------------------------------------------------------------ updates

    def append(self, new_valid: torch.Tensor) -> None:
        """Record that the last forward appended `n` slots with validity `new_valid [b, n]`."""
        self.mask = self.attention_mask(new_valid)

    def crop(self, num_slots: int) -> None:
        """Drop the last `num_slots` slots from every layer (slots not recorded in `mask`, e.g. a drafted block)."""
        if num_slots > 0:
            self.cache.crop(-num_slots)

    def select(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (`[b']` long), in that order."""
        indices = indices.to(self.mask.device)
        for layer in self.cache.layers:
            if _layer_len(layer) == 0:  # nothing cached: back to lazy initialisation (no stale batch size)
                layer.reset()
                continue
            layer.keys = layer.keys.index_select(0, indices.to(layer.keys.device))
            layer.values = layer.values.index_select(0, indices.to(layer.values.device))
        self.mask = self.mask.index_select(0, indices)

    def merge(self, other: "RaggedCache") -> None:
        """Append the rows of `other` after ours (batch axis), left-padding the shorter cache with invalid slots."""
        s = max(self.num_slots, other.num_slots)
        b_self, b_other = self.batch_size, other.batch_size
        for i in range(max(len(self.cache.layers), len(other.cache.layers))):
            ours = self.cache.layers[i] if i < len(self.cache.layers) else None
            theirs = other.cache.layers[i] if i < len(other.cache.layers) else None
            ref = ours if _layer_len(ours) > 0 else theirs if _layer_len(theirs) > 0 else None
            if ref is None:
                if ours is not None:
                    ours.reset()
                continue
            if ours is None:
                raise RuntimeError("cannot merge caches with different numbers of layers.")
            keys = torch.cat([_left_pad(ours, "keys", ref, b_self, s), _left_pad(theirs, "keys", ref, b_other, s)])
            values = torch.cat(
                [_left_pad(ours, "values", ref, b_self, s), _left_pad(theirs, "values", ref, b_other, s)]
            )
            if not ours.is_initialized:
                ours.lazy_initialization(keys, values)
            ours.keys, ours.values = keys, values
        pad_self = self.mask.new_zeros(b_self, s - self.num_slots)
        pad_other = other.mask.new_zeros(b_other, s - other.num_slots)
        self.mask = torch.cat(
            [torch.cat([pad_self, self.mask], dim=1), torch.cat([pad_other, other.mask.to(self.mask.device)], dim=1)]
        )

    def wasted_slots(self) -> int:
        """Slots that `compact()` would remove: `S - max(valid count per row)`."""
        if self.batch_size == 0:
            return 0
        return self.num_slots - int(self.valid_counts().max())

    def compact(self) -> None:
        """Move every row's valid slots to the right end (order kept) and drop the columns left empty."""
        if self.batch_size == 0:
            return
        counts = self.valid_counts()
        keep = int(counts.max())
        # A stable sort of the validity puts each row's invalid slots first and its valid slots last, in order.
        order = torch.sort(self.mask.to(torch.int8), dim=1, stable=True).indices[:, self.num_slots - keep :]
        for layer in self.cache.layers:
            if _layer_len(layer) == 0:
                continue
            b, h, _, d = layer.keys.shape
            idx = order.to(layer.keys.device)[:, None, :, None].expand(b, h, keep, d)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.mask = self.mask.gather(1, order)


# ---------------------------------------------------------------------------------------------------- statistics


@dataclass
class BatchStats:
    """Statistics of one batched run. Per-prompt lists (`verified`, `accepted`, `committed`) are in input order.

    `seconds` splits wall time into `prefill` (target prefill forwards), `draft` (drafter forwards + draft logits),
    `length` (length head + cost model), `verify` (target verification forwards, plain rounds included), `accept`
    (acceptance and bookkeeping, incl. cache compaction), `lookup` (n-gram lookup of the hybrid proposals), `online`
    (OnlineSpec updates) and `total`.
    `sources` (per prompt, per round): what the row verified, `"drafter"`, `"lookup"` or `"none"`.
    Every round is a speculative round (`drafter_forwards`), a `lookup_rounds` or a `plain_rounds` one.
    """

    rounds: int = 0
    prefill_forwards: int = 0
    prefill_joins: int = 0  # prefills whose rows joined a running batch (continuous mode)
    drafter_forwards: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # active rows per round
    verify_widths: list[int] = field(default_factory=list)  # tokens per row in each verify forward (M + 1)
    verified: list[list[int]] = field(default_factory=list)  # per prompt: drafted tokens verified per round
    accepted: list[list[int]] = field(default_factory=list)  # per prompt: drafted tokens accepted per round
    committed: list[list[int]] = field(default_factory=list)  # per prompt: new tokens per round (prefill first)
    sources: list[list[str]] = field(default_factory=list)  # per prompt: "drafter" / "lookup" / "none" per round
    compactions: int = 0
    plain_rounds: int = 0  # rounds without a drafter forward (the switch chose plain decoding, or no budget left)
    lookup_rounds: int = 0  # rounds without a drafter forward that verified n-gram lookup proposals (hybrid)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("prefill", "draft", "length", "verify", "accept", "lookup", "online", "total"), 0.0))

    @classmethod
    def for_prompts(cls, n: int) -> "BatchStats":
        return cls(verified=[[] for _ in range(n)], accepted=[[] for _ in range(n)], committed=[[] for _ in range(n)],
                   sources=[[] for _ in range(n)])

    @property
    def tokens_verified(self) -> int:
        """Real tokens fed to verification forwards (anchor + verified drafts, summed over rows and rounds)."""
        return sum(v + 1 for row in self.verified for v in row)

    @property
    def tokens_computed(self) -> int:
        """Token slots the verification forwards computed, padding included."""
        return sum(b * w for b, w in zip(self.batch_sizes, self.verify_widths))

    @property
    def tokens_committed(self) -> int:
        return sum(sum(row) for row in self.committed)

    @property
    def tau(self) -> float:
        """Mean tokens committed per row per verification round (prefill excluded)."""
        per_round = [c for row in self.committed for c in row[1:]]
        return sum(per_round) / len(per_round) if per_round else 0.0


# ---------------------------------------------------------------------------------------------------- the switch


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0
    last_round: int = -1
    interval: int = 0  # rounds between explorations of this arm while it loses (doubles each lost exploration)

    def score(self) -> float:
        return float("inf") if self.count == 0 else self.tokens / max(self.seconds, 1e-9)


@dataclass
class SpeculationSwitch:
    """Explore/exploit choice between a speculative round ("draft") and a plain decoding round ("plain").

    Each arm's score is its committed tokens per second of round time (whole batch: drafting, length choice,
    verification forward, acceptance, cache compaction), as exponential moving averages of the tokens and the
    seconds of the rounds it was chosen (as `generation/policy.py` does for bs=1). The arm with the higher score
    runs. Untried arms come first ("draft", then "plain"). The losing arm is retried after `explore_every` rounds,
    and after twice as many each time the retry loses again (at most `max_interval`), so a batch where speculation
    does not pay spends few rounds finding that out again; a retry that wins resets the interval. A retry's round, and
    the first `warmup` rounds of an arm, replace its estimate instead of blending into it: an old estimate is stale,
    and the first speculative round also feeds the drafter the whole prompt context, which would otherwise make
    speculation look worse than it is for many rounds.

    A third arm, "lookup" (verify n-gram lookup proposals, no drafter forward), is offered by the hybrid engine in the
    rounds where some row has a lookup match (`choose(options)`).

    Nothing here changes the output: plain rounds verify no drafts, and the drafter's context is caught up lazily
    (the target context of plain rounds waits in `BatchState.ctx` until the next drafter forward).
    """

    decay: float = 0.3
    explore_every: int = 12
    max_interval: int = 96
    warmup: int = 2
    round: int = 0
    arms: dict = field(default_factory=lambda: {"draft": _Rate(), "plain": _Rate()})
    _exploring: str | None = None

    def choose(self, options: tuple[str, ...] | None = None) -> str:
        """The arm of this round among `options` (default: every known arm; new names are added, e.g. "lookup")."""
        self.round += 1
        self._exploring = None
        names = list(self.arms) if options is None else list(options)
        for name in names:
            if self.arms.setdefault(name, _Rate()).count == 0:
                return name
        best = max(names, key=lambda a: self.arms[a].score())
        for name in names:
            arm = self.arms[name]
            if name != best and self.round - arm.last_round > (arm.interval or self.explore_every):
                self._exploring = name
                return name
        return best

    def record(self, arm: str, tokens: int, seconds: float) -> None:
        est = self.arms.setdefault(arm, _Rate())
        if est.count < self.warmup or self._exploring == arm:  # first rounds, or a retry after a gap: fresh estimate
            est.tokens, est.seconds = float(tokens), float(seconds)
        else:
            est.tokens += self.decay * (tokens - est.tokens)
            est.seconds += self.decay * (seconds - est.seconds)
        est.count += 1
        est.last_round = self.round
        if self._exploring == arm:
            lost = est.score() < max(a.score() for name, a in self.arms.items() if name != arm)
            est.interval = min(2 * (est.interval or self.explore_every), self.max_interval) if lost else 0


class MeasuredCost:
    """A `TargetCostModel` corrected by the verification forwards actually timed in this run.

    The static model is calibrated at batch size 1 and scaled linearly in the batch size, which underestimates
    how much wider verify forwards cost once a batch makes the target compute-bound (on 2 CPU cores, 16 rows x 8
    tokens cost ~3x 16 rows x 1 token, against ~1.9x at batch size 1). `seconds(n, b)` returns the moving average
    of the timed forwards of `b` rows x `n` tokens when there are some, else the static estimate times the
    measured/static ratio of the timed width nearest to `n` at that batch size.
    """

    def __init__(self, static, decay: float = 0.3):
        self.static, self.decay = static, decay
        self.timed: dict[tuple[int, int], float] = {}

    def observe(self, num_tokens: int, batch_size: int, seconds: float) -> None:
        key = (batch_size, num_tokens)
        old = self.timed.get(key)
        self.timed[key] = seconds if old is None else old + self.decay * (seconds - old)

    def seconds(self, num_tokens: int, batch_size: int = 1) -> float:
        if (batch_size, num_tokens) in self.timed:
            return self.timed[(batch_size, num_tokens)]
        static = self.static.seconds(num_tokens, batch_size)
        widths = [n for b, n in self.timed if b == batch_size]
        if not widths:
            return static
        near = min(widths, key=lambda n: (abs(n - num_tokens), n))
        return static * self.timed[(batch_size, near)] / max(self.static.seconds(near, batch_size), 1e-9)


# ---------------------------------------------------------------------------------------------------- the batch


@dataclass
class BatchState:
    """The active rows. `last_tok [b]`: last committed token (not yet in the target cache), at position
    `next_pos [b]` (= the row's valid target-cache slots). `ctx [b, n, F]` / `ctx_mask [b, n]` / `ctx_pos [b, n]`:
    target context (hidden states at `target_layer_ids`) not yet seen by the drafter, padded per row.
    `win [b, W, F]` / `win_mask [b, W]` / `win_pos [b, W]` (only with an OnlineSpec adapter, else None): each row's
    last `W` context states (all tokens the target has processed and kept, seen by the drafter or not), right-aligned
    with their true positions: the window the adapter replays a row's drafting forward on."""

    prompt_idx: list[int]
    last_tok: torch.Tensor
    next_pos: torch.Tensor
    target: RaggedCache
    drafter: RaggedCache | None
    ctx: torch.Tensor | None = None
    ctx_mask: torch.Tensor | None = None
    ctx_pos: torch.Tensor | None = None
    win: torch.Tensor | None = None
    win_mask: torch.Tensor | None = None
    win_pos: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.prompt_idx)

    def start_window(self, width: int, features: int, dtype, device) -> None:
        """Keep a rolling window of the last `width` context states per row (OnlineSpec), empty for now."""
        b = self.size
        self.win = torch.zeros(b, width, features, dtype=dtype, device=device)
        self.win_mask = torch.zeros(b, width, dtype=torch.bool, device=device)
        self.win_pos = torch.zeros(b, width, dtype=torch.long, device=device)

    def _roll_window(self, ctx, mask, pos) -> None:
        width = self.win.shape[1]
        states = torch.cat([self.win, ctx.to(self.win.dtype)], dim=1)
        valid = torch.cat([self.win_mask, mask], dim=1)
        positions = torch.cat([self.win_pos, pos], dim=1)
        # A stable sort of the validity puts each row's valid states last, in order: keep the last `width` of them.
        order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
        self.win = states.gather(1, order[..., None].expand(-1, -1, states.shape[2]))
        self.win_mask, self.win_pos = valid.gather(1, order), positions.gather(1, order)

    def add_context(self, ctx, mask, pos) -> None:
        mask, pos = mask.to(device=ctx.device, dtype=torch.bool), pos.to(ctx.device)
        if self.win is not None:
            self._roll_window(ctx, mask, pos)
        if self.ctx is None:
            self.ctx, self.ctx_mask, self.ctx_pos = ctx, mask, pos
        else:  # the drafter skipped a round: keep everything it has not seen
            self.ctx = torch.cat([self.ctx, ctx], dim=1)
            self.ctx_mask = torch.cat([self.ctx_mask, mask], dim=1)
            self.ctx_pos = torch.cat([self.ctx_pos, pos], dim=1)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.last_tok.device)
        self.prompt_idx = [self.prompt_idx[r] for r in keep]
        self.last_tok, self.next_pos = self.last_tok[index], self.next_pos[index]
        self.target.select(index)
        if self.drafter is not None:
            self.drafter.select(index)
        if self.ctx is not None:
            i = index.to(self.ctx.device)
            self.ctx, self.ctx_mask, self.ctx_pos = self.ctx[i], self.ctx_mask[i], self.ctx_pos[i]
        if self.win is not None:
            i = index.to(self.win.device)
            self.win, self.win_mask, self.win_pos = self.win[i], self.win_mask[i], self.win_pos[i]

    def merge(self, other: "BatchState") -> "BatchState":
        if other.size == 0:
            return self
        if self.size == 0:
            return other
        if self.ctx is not None or other.ctx is not None:
            ours, theirs = _pad_context(self, other), _pad_context(other, self)
            self.ctx, self.ctx_mask, self.ctx_pos = (torch.cat([x, y.to(x.device)]) for x, y in zip(ours, theirs))
        if self.win is not None:  # both batches keep windows of the same width (one generator, one adapter)
            self.win, self.win_mask, self.win_pos = (torch.cat([x, y.to(x.device)]) for x, y in zip(
                (self.win, self.win_mask, self.win_pos), (other.win, other.win_mask, other.win_pos)))
        self.prompt_idx = self.prompt_idx + other.prompt_idx
        self.last_tok = torch.cat([self.last_tok, other.last_tok])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.target.merge(other.target)
        if self.drafter is not None:
            self.drafter.merge(other.drafter)
        return self


def _pad_context(batch: BatchState, other: BatchState):
    """`batch`'s pending context right-padded to the longer of the two (zeros, masked)."""
    n = max(x.ctx.shape[1] for x in (batch, other) if x.ctx is not None)
    ref = batch if batch.ctx is not None else other
    b = batch.size
    if batch.ctx is None:
        return (ref.ctx.new_zeros(b, n, ref.ctx.shape[2]), ref.ctx_mask.new_zeros(b, n),
                ref.ctx_pos.new_zeros(b, n))
    pad = n - batch.ctx.shape[1]
    return (torch.cat([batch.ctx, batch.ctx.new_zeros(b, pad, batch.ctx.shape[2])], dim=1),
            torch.cat([batch.ctx_mask, batch.ctx_mask.new_zeros(b, pad)], dim=1),
            torch.cat([batch.ctx_pos, batch.ctx_pos.new_zeros(b, pad)], dim=1))


def _layer_len(layer) -> int:
    if layer is None or not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return 0
    return layer.keys.shape[-2]


def _left_pad(layer, name: str, ref, batch: int, slots: int) -> torch.Tensor:
    """`layer.<name>` left-padded with zeros to `slots` slots (zeros `[batch, ...]` if the layer is empty)."""
    ref_t = getattr(ref, name)
    if _layer_len(layer) == 0:
        return ref_t.new_zeros(batch, ref_t.shape[1], slots, ref_t.shape[3])
    t = getattr(layer, name).to(ref_t.device)
    missing = slots - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


__all__ = ["BatchState", "BatchStats", "MeasuredCost", "RaggedCache", "SpeculationSwitch"]
