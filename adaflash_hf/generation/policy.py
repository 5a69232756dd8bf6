# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Which proposals a round verifies: the drafter's blocks, n-gram lookup continuations, or none (a plain round).

One policy for both engines, written for `b` rows (the bs=1 generator is `b = 1`):

* per round, an ARM: `"draft"` (one drafter forward; each row verifies its drafted block, or its lookup
  continuation where that promises more), `"lookup"` (no drafter forward; rows with a lookup match verify it, the
  others decode one token) or `"plain"` (no proposal: one token per row, as plain decoding);
* per row of a draft round, a SOURCE: `"drafter"` or `"lookup"`.

Each arm is scored by its expected committed tokens per second, both terms predicted, never read off a clock:
tokens from moving averages of the accepted tokens each source achieved (per row, falling back to the batch's),
seconds from the device-calibrated `TargetCostModel` (drafting step + a verify forward of the arm's width). So the
choice depends only on counts and the cost model: with the same seed, starting state and cost model, the same
output comes back under any machine load.

The estimates and the exploration schedule (round counter, retry intervals) adapt across `generate` calls (they
describe drafter + target + traffic) when the policy is kept in a `SpeculationRuntime` and the generation config's
`policy_schedule` is `"persistent"` (the default); with `"transient"` every call starts from the same state (the
runtime's policy is left untouched, the call works on a copy), so the same seed gives the same text. An arm not
chosen for `explore_every` rounds is tried again (and after twice as many rounds each time that retry loses, up to
`max_interval`), unless even full acceptance of what the retry would verify could not beat the best arm (64 rows on
a CPU: a retry cost 5 plain rounds); untried arms come first, but one whose probe could not beat a plain round even
at full acceptance is not tried. `reset()` forgets everything; `frozen=True` fixes the whole state: nothing is
recorded, no round is counted, nothing is explored, and each round takes the arm with the best prediction.

Each arm is scored at its best verify WIDTH. Per source (and per row within a run, falling back to the batch's),
the policy keeps a curve of moving averages of `P(position k accepted | positions < k accepted)` from the rounds it
has seen, so the expected accepted tokens of a width `w` are `sum_{k <= w} prod_{j <= k} c_j`, and the arm's score
is the best over `w` of expected tokens per predicted second. `cut(arm)` hands that width to the engine, which
verifies only that much of the lookup continuation or of the drafted block (the block only under
`length_policy="auto"` without a length head: a head chooses its own lengths with the same costs). Where each
verified token costs (a CPU), a long lookup match whose first tokens are usually right pays at width 2-3 where its
whole length does not; on a flat-cost accelerator the best width is the whole budget. Exploration rounds (and every
`explore_every`-th round) verify one position deeper than the best, so the next position keeps being measured; an
arm without a curve is probed one token deep. A row's curve and accepted-token average start from the batch's
values (a prior), so one missed round at the start of a request moves the row's estimate by `decay`, not to zero:
a request whose first drafted block fails is not left to plain rounds until the next retry. A lookup continuation
found in a round that verified no proposal is scored in hindsight against the token the round committed
(`record_hindsight`), so the lookup curves keep learning while plain rounds run. Before any curve exists, an arm
is scored by the moving average of its accepted tokens at its whole budget.

A draft round whose rows verified none of their block (the length rule chose 0 drafted tokens, or the drafts were
not usable) still paid for the drafter's forward: it counts as 0 accepted drafter tokens for those rows, whether the
engine records it with source `"none"` or does not record it at all (then it is settled at the next `choose`). So
the drafter arm is scored by what its rounds actually yielded, and a drafter whose blocks the length rule keeps
cutting to nothing loses to plain rounds within the request.

Nothing here can change the output: every proposal is verified by the target.
"""

import copy
from dataclasses import dataclass, field


ARMS = ("draft", "lookup", "plain")
SCHEDULES = ("persistent", "transient")  # AdaFlashGenerationConfig.policy_schedule
# A probe or retry is made only if, with every position it verifies accepted, it would reach this fraction of the
# best arm's predicted tokens/s. On a CPU at 64 rows a drafted retry reaches 0.39-0.55 (2-3 tokens a row cost 4.6-5x
# one) and cost ~5 plain rounds each time; at 4-16 rows the probe reaches 0.9-1.05, and its information (the curve
# that later picks the width) is worth a round. Below 1 because the bound ignores what the probe teaches.
EXPLORE_FLOOR = 0.75
LEARNING_EXPLORE = 4  # while an online adapter learns, a losing drafter arm is retried at least every 4 rounds
SOURCES = ("drafter", "lookup")


@dataclass
class _Arm:
    last_round: int = -1
    interval: int = 0  # rounds between retries while the arm loses (doubles after each lost retry)
    tried: bool = False


@dataclass
class ProposalPolicy:
    """Count-and-cost-model policy over proposal arms and per-row sources (module docstring).

    Args:
        decay: weight of the newest round in the moving averages.
        explore_every: try an arm again after this many rounds without it.
        max_interval: longest gap between retries of a losing arm.
        frozen: keep the whole state fixed (estimates, round counter, retry intervals): no exploration, each round
            takes the arm with the best prediction.
    """

    decay: float = 0.3
    explore_every: int = 16
    max_interval: int = 128
    frozen: bool = False
    round: int = 0
    accepted: dict = field(default_factory=lambda: dict.fromkeys(SOURCES))  # EMA of accepted drafted tokens
    width: float | None = None  # EMA of drafted tokens verified per row in draft rounds (the verify width)
    arms: dict = field(default_factory=lambda: {a: _Arm() for a in ARMS})
    rows: dict = field(default_factory=dict)  # row key -> source -> EMA of accepted tokens (per run)
    pending: list | None = None  # rows of the last draft round, until it is recorded (module docstring)
    curves: dict = field(default_factory=lambda: {s: [] for s in SOURCES})  # source -> [EMA of P(k ok | < k ok)]
    row_curves: dict = field(default_factory=dict)  # row key -> source -> its own curve (per run)
    # the last choice's scratch (not state: a frozen policy compares equal whatever it chose)
    widths: dict = field(default_factory=dict, compare=False)  # arm -> the best verify width of the last scoring
    explored: bool = field(default=False, compare=False)  # the last choice explored: verify one position deeper
    scored: bool = field(default=False, compare=False)  # the last choice was between arms (else: no cut)
    remaining: list | None = field(default=None, compare=False)  # the last choice's drain objective (`_value`)

    @classmethod
    def from_generation_config(cls, config) -> "ProposalPolicy":
        return cls().configure(config)

    def configure(self, config) -> "ProposalPolicy":
        """Take the generation config's knobs (`policy_decay`, `policy_explore_every`); estimates are kept."""
        self.decay = float(getattr(config, "policy_decay", 0.3))
        self.explore_every = int(getattr(config, "policy_explore_every", 16))
        return self

    def copy(self) -> "ProposalPolicy":
        """An independent copy of the whole state (a `"transient"` call decodes with one)."""
        return copy.deepcopy(self)

    def reset(self) -> None:
        """Forget every estimate (the next rounds explore again)."""
        fresh = type(self)(decay=self.decay, explore_every=self.explore_every, max_interval=self.max_interval,
                           frozen=self.frozen)
        self.__dict__.update(fresh.__dict__)

    def start_run(self) -> None:
        """Per-row estimates describe one run's sequences: drop them (the batch-wide ones persist)."""
        self.rows = {}
        self.row_curves = {}
        self.pending = None

    # ------------------------------------------------------------------------------------------------ estimates
    def estimate(self, row, source: str) -> float | None:
        """Expected accepted drafted tokens of `row` with `source` (the batch's estimate when the row has none)."""
        value = self.rows.get(row, {}).get(source)
        return self.accepted[source] if value is None else value

    def row_source(self, row, lookup_len: int, draft_len: int) -> str:
        """`"lookup"` when row's lookup continuation promises at least as many accepted tokens as its block."""
        if lookup_len <= 0:
            return "drafter"
        lookup, draft = self.estimate(row, "lookup"), self.estimate(row, "drafter")
        lookup = lookup_len if lookup is None else min(lookup, lookup_len)
        draft = draft_len if draft is None else min(draft, draft_len)
        return "lookup" if lookup >= draft else "drafter"

    def expected_at(self, source: str, width: int, row=None) -> float | None:
        """Expected accepted tokens of `source` when `width` tokens are verified: from `row`'s own curve when it has
        one (this run's text: a request of repetitive prose is not a chat request), else the batch's; positions
        past the measured ones repeat the last measured rate. None before any round of `source` was recorded."""
        totals = self.expected_upto(source, width, row)
        return None if totals is None else totals[width]

    def expected_upto(self, source: str, width: int, row=None) -> list[float] | None:
        """`[expected_at(source, w, row) for w in 0 .. width]` in one pass over the curve (None without one)."""
        curve = self.row_curves.get(row, {}).get(source) or self.curves[source]
        if not curve:
            return None
        totals, alive = [0.0], 1.0
        for k in range(width):
            alive *= curve[min(k, len(curve) - 1)]
            totals.append(totals[-1] + alive)
        return totals

    def cut(self, arm: str) -> int | None:
        """The verify width for `arm` this round: the width the last `choose` scored best; 1 (a probe) while the arm
        has no curve yet; None (the whole budget) when the policy had no choice to make (a single possible arm). An
        exploration round, and every `explore_every`-th round, verifies one position deeper, so the curve keeps
        measuring the next position at the price of one token per row: never a whole block for every row of a
        large batch."""
        if not self.scored:
            return None
        if arm not in self.widths or self.explored or (self.round % self.explore_every == 0 and not self.frozen):
            return self._explore_width(arm)
        return self.widths[arm]

    def _explore_width(self, arm: str) -> int:
        """What an exploration round of `arm` verifies (`cut`): one position past its best width, or 1 (a probe)."""
        return self.widths[arm] + 1 if arm in self.widths else 1

    def _head_width(self, budgets: list[int]) -> int:
        """The width a length head's draft round verifies: the moving average of its widths, within the budget."""
        return max(budgets) if self.width is None else min(max(budgets), max(1, round(self.width)))

    def _expected(self, row, source: str, cap: int) -> float:
        value = self.estimate(row, source)
        if value is not None and self.remaining is not None:  # draining: shrunk towards the batch's (`_row_totals`)
            value = (value + self.accepted[source]) / 2 if self.accepted[source] is not None else value
        return float(cap) if value is None else min(value, float(cap))

    def _row_totals(self, source: str, cap: int, row) -> list[float] | None:
        """`expected_upto(source, cap, row)`; while the batch drains, halfway to the batch's curve. The drain's value
        turns on its slowest row, and the row that LOOKS slowest is the one whose moving averages (decay 0.3) were
        unluckiest: on the H200 reference at 48 rows, its drafter estimate near 0 made every draft round look like
        +15% cost for nothing, and lookup rounds took 58 rounds where drafted ones took 50."""
        own = self.expected_upto(source, cap, row)
        if own is None or self.remaining is None or not self.row_curves.get(row, {}).get(source):
            return own
        return [(a + b) / 2 for a, b in zip(own, self.expected_upto(source, cap))]

    # ------------------------------------------------------------------------------------------------ choices
    def choose(self, rows: list, lookup_lens: list[int], budgets: list[int], cost, allow_no_draft: bool = True,
               explore_every: int | None = None, draft_cut: bool = True, remaining: list[int] | None = None) -> str:
        """The arm of this round (see `_choose` for the arguments)."""
        if self.pending is not None and not self.frozen:  # the last draft round verified no drafted token
            pending, self.pending = self.pending, None
            self.record(pending, ["drafter"] * len(pending), [0] * len(pending), [0] * len(pending))
        self.remaining = list(remaining) if remaining is not None and len(rows) > 1 else None
        arm = self._choose(rows, lookup_lens, budgets, cost, allow_no_draft, explore_every, draft_cut)
        if not self.frozen:
            self.pending = list(rows) if arm == "draft" else None
        return arm

    def _choose(self, rows: list, lookup_lens: list[int], budgets: list[int], cost, allow_no_draft: bool = True,
                explore_every: int | None = None, draft_cut: bool = True) -> str:
        """The arm of this round.

        Args:
            rows: a stable key per row (e.g. the prompt index).
            lookup_lens: each row's lookup continuation length (0: no match, or lookup off).
            budgets: each row's most drafted tokens this round (0: the row may not draft).
            cost: the `TargetCostModel` of this device (required unless only one arm is possible).
            allow_no_draft: rounds without a drafter forward ("lookup", "plain") may be chosen; otherwise every
                round with a budget drafts (rows may still verify their lookup continuation instead of the block).
            explore_every: retry losing arms at least this often (e.g. while an online adapter improves the drafter,
                so that the policy notices); default `self.explore_every`.
            draft_cut: the engine verifies drafted blocks at the width `cut("draft")` returns. False when a length
                head chooses each row's length: the draft arm is then scored by what the head's rounds achieved
                (the accepted-token averages) at the width they verified (the max over rows, `self.width`), not
                by the position curves at a width the engine would not use.
            remaining (`choose` only): each row's most tokens still to commit, when no request waits for the rows'
                slots (the batch drains): arms are then scored by the drain's predicted time (`_value`), not by
                this round's tokens per second. None (requests wait, or one row): this round's tokens per second.
        """
        b = len(rows)
        options = []
        if max(budgets, default=0) > 0:
            options.append("draft")
        if allow_no_draft or not options:
            if max(lookup_lens, default=0) > 0:
                options.append("lookup")
            options.append("plain")
        self.explored, self.widths, self.scored = False, {}, len(options) > 1
        if len(options) > 1 and self.frozen:  # no state change, no exploration: the best prediction
            return max(options, key=lambda a: self._score(a, rows, lookup_lens, budgets, cost, b, draft_cut))
        if not self.frozen:
            self.round += 1
        if len(options) > 1 and "plain" in options:  # an untried arm's first round is a probe (`cut`): if even
            plain = self._score("plain", rows, lookup_lens, budgets, cost, b)  # full acceptance loses to plain: skip
            options = [arm for arm in options if arm == "plain" or self.arms[arm].tried or
                       self._worth_exploring(arm, rows, lookup_lens, budgets, cost, draft_cut, plain)]
        if len(options) == 1:
            return options[0]
        for arm in options:  # untried arms first
            if not self.arms[arm].tried:
                return self._pick(arm, explore=False)
        scores = {arm: self._score(arm, rows, lookup_lens, budgets, cost, b, draft_cut) for arm in options}
        best = max(options, key=lambda a: scores[a])
        gap = self.explore_every if explore_every is None else min(explore_every, self.explore_every)
        cap = self.max_interval if explore_every is None else gap
        for arm in options:  # a losing arm is retried now and then: the traffic may have changed
            state = self.arms[arm]
            if arm != best and self.round - state.last_round > min(state.interval or gap, cap) and \
                    self._worth_exploring(arm, rows, lookup_lens, budgets, cost, draft_cut, scores[best]):
                state.interval = min(2 * (state.interval or gap), cap)
                return self._pick(arm, explore=True)
        self.arms[best].interval = 0
        return self._pick(best, explore=False)

    def _pick(self, arm: str, explore: bool) -> str:
        self.explored = explore or not self.arms[arm].tried
        state = self.arms[arm]
        state.tried = True
        state.last_round = self.round
        return arm

    def _worth_exploring(self, arm, rows, lookup_lens, budgets, cost, draft_cut: bool, best_score: float) -> bool:
        """Whether a retry of `arm`, if every position it verifies were accepted, would reach `EXPLORE_FLOOR` x
        `best_score`.

        A retry verifies `cut(arm)` positions (one deeper than its best width; the head's width with a length head),
        so its best case is `sum_r (1 + min(width, cap_r))` tokens over that round's predicted seconds. Where the
        first verified tokens are the dearest (64 rows on a CPU: 2 tokens a row cost 4.6x one, 8 cost 6.4x), a
        retry that cannot pay even then is not made: it cost 5 plain rounds each time, ~25% of a 64-token run."""
        width = self._head_width(budgets) if arm == "draft" and not draft_cut else self._explore_width(arm)
        caps = [min(width, cap) for _, cap, _ in self._caps(arm, rows, lookup_lens, budgets)]
        best_case = self._value([1.0 + cap for cap in caps], max(caps, default=0), cost, drafts=arm == "draft")
        return best_case > EXPLORE_FLOOR * best_score

    def _caps(self, arm, rows, lookup_lens, budgets) -> list:
        """Per row, `(its key, most tokens it can verify in a round of `arm`, its source)`."""
        if arm == "lookup":
            return [(r, n, "lookup") for r, n in zip(rows, lookup_lens)]
        return [(r, min(n, budget), "lookup") if self.row_source(r, n, budget) == "lookup" else
                (r, budget, "drafter") for r, n, budget in zip(rows, lookup_lens, budgets)]  # <= the block

    def _score(self, arm, rows, lookup_lens, budgets, cost, b, draft_cut: bool = True) -> float:
        """Expected committed tokens per predicted second of the round at its best width (module docstring)."""
        if arm == "plain":
            return self._value([1.0] * b, 0, cost, drafts=False)
        caps = self._caps(arm, rows, lookup_lens, budgets)
        # A length head's rounds verify the widths it picks (per row; the forward runs at their max): the curves
        # extrapolated to a width it would not use overstate them (16 rows on a CPU drafted 5 rounds at a predicted
        # width 7 the head cut to 1-2 tokens).
        if (arm == "lookup" or draft_cut) and all(self.curves[source] for _, cap, source in caps if cap > 0):
            return self._score_widths(arm, caps, cost, b)
        if arm == "lookup":
            gains = [1.0 + (self._expected(r, "lookup", n) if n > 0 else 0.0) for r, n in zip(rows, lookup_lens)]
            return self._value(gains, max(lookup_lens), cost, drafts=False)
        width = self._head_width(budgets)
        gains = []
        for r, n, budget in zip(rows, lookup_lens, budgets):
            if self.row_source(r, n, budget) == "drafter":
                gains.append(1.0 + self._expected(r, "drafter", budget))
                continue
            # a lookup row of a head's round verifies at most the round's width (the head's longest length), and
            # before any lookup round its hindsight curve is the evidence: 64 rows drafted rounds the head cut to
            # nothing because 43 rows' never-verified continuations counted at their whole length
            seen = self.expected_at("lookup", min(n, width), r)
            gains.append(1.0 + (self._expected(r, "lookup", min(n, width)) if seen is None else seen))
        return self._value(gains, width, cost, drafts=True)

    def _score_widths(self, arm: str, caps: list, cost, b: int) -> float:
        """The best over verify widths `w` of `sum_r (1 + E_source_r(min(w, cap_r))) / round_seconds(w)`; the width
        is kept for `cut(arm)`. `caps`: per row, `(its key, most tokens it can verify, its source)`."""
        best, best_w = 0.0, 1
        # each row's expected tokens at every width, one pass over its curve (64 rows x 7 widths a round)
        totals = [self._row_totals(source, cap, r) if cap > 0 else [0.0] for r, cap, source in caps]
        for w in range(1, max((cap for _, cap, _ in caps), default=0) + 1):
            score = self._value([1.0 + row[min(w, len(row) - 1)] for row in totals], w, cost, drafts=arm == "draft")
            if score >= best:  # a tie (flat costs) goes to the wider width: its extra positions are free
                best, best_w = score, w
        self.widths[arm] = best_w
        return best

    def _value(self, gains: list[float], width: int, cost, drafts: bool) -> float:
        """Expected committed tokens per predicted second of a round in which row `r` commits `gains[r]` tokens and
        the forward verifies `width` tokens a row (with a drafting step when `drafts`).

        While requests wait for slots (`self.remaining` is None), a row that finishes early is refilled: this round's
        tokens over its seconds. When none waits (a wave's last rounds, or every request already in), what matters
        is when the LAST row is done: a round that speeds up some rows and not the slowest adds its extra cost and
        saves little (16 rows on a CPU: 35 lookup rounds at 1.5x a plain round's cost took 62 rounds instead of 63,
        16.2 s against 11.8 s). The round is then valued by the drain it leaves: its seconds plus `drain_seconds` of
        the rows' remaining tokens after it, decoded by plain rounds (one step of policy improvement over plain
        decoding, re-decided every round); the rows' remaining tokens over that total is the value. Assuming the
        round's gains for every later round instead over-rated lookup: a row with a match now has none in most later
        rounds (64 rows on a CPU ran 39 lookup rounds and lost 17% to plain rounds)."""
        if self.remaining is None:
            return sum(gains) / cost.round_seconds(width, len(gains), drafts=drafts)
        after = [max(n - g, 0.0) for n, g in zip(self.remaining, gains)]
        seconds = cost.round_seconds(width, len(gains), drafts=drafts) + drain_seconds(
            [1.0] * len(after), after, 0, cost, drafts=False)
        return sum(self.remaining) / seconds

    # ------------------------------------------------------------------------------------------------ feedback
    def record(self, rows: list, sources: list[str], accepted: list[int], verified: list[int] | None = None) -> None:
        """What each row's proposal achieved this round (`sources[r]` in SOURCES; others are ignored)."""
        if self.frozen:
            return
        if self.pending is not None:  # a draft round: its rows that verified nothing yielded 0 drafter tokens
            sources = ["drafter" if s == "none" else s for s in sources]
            self.pending = None
        d = self.decay
        # a row's estimates start from the batch's as they were before this round (a prior), not from one round
        prior_accepted, prior_curves = dict(self.accepted), {s: list(c) for s, c in self.curves.items()}
        for r, source, a in zip(rows, sources, accepted):
            if source not in SOURCES:
                continue
            row = self.rows.setdefault(r, {})
            for table, old in ((row, row.get(source, prior_accepted[source])), (self.accepted, self.accepted[source])):
                table[source] = float(a) if old is None else old + d * (a - old)
        for r, source, a, v in zip(rows, sources, accepted, verified or []):
            if source in SOURCES:  # a drafted block cut to nothing counts as a miss at its first position
                self._record_positions(self.curves[source], int(a), max(int(v), 1))
                row_curve = self.row_curves.setdefault(r, {}).setdefault(source, [])
                self._record_positions(row_curve, int(a), max(int(v), 1), prior_curves[source])
        drafted = [v for s, v in zip(sources, verified or []) if s == "drafter"]
        if drafted:
            w = float(max(drafted))
            self.width = w if self.width is None else self.width + d * (w - self.width)

    def record_hindsight(self, rows: list, matched: list[int], known: list[int], lengths: list[int]) -> None:
        """Lookup continuations a round found but did not verify, scored against what it committed: free evidence.

        Per row: `lengths` the continuation's length (0: skipped), `known` the tokens the round committed, `matched`
        how many leading continuation tokens equal them. Only positions within what was committed are known (a plain
        round tells position 1), so the lookup curves learn, from counts alone, whether a lookup would have paid on
        this text while plain rounds run, and an arm that would have paid is chosen without waiting for its next
        retry. The engines pass rows that verified no proposal only (`proposers.lookup_hindsight`)."""
        if self.frozen:
            return
        prior = list(self.curves["lookup"])
        for r, a, k, n in zip(rows, matched, known, lengths):
            if n > 0 and k > 0:
                self._record_positions(self.curves["lookup"], int(a), min(int(n), int(k)))
                curve = self.row_curves.setdefault(r, {}).setdefault("lookup", [])
                self._record_positions(curve, int(a), min(int(n), int(k)), prior)

    def _record_positions(self, curve: list, accepted: int, verified: int, prior: list | None = None) -> None:
        """Positions `1 .. min(accepted + 1, verified)` were reached; those `<= accepted` were accepted. A position
        seen for the first time starts from `prior`'s value there (a row's curve: the batch's), else from the hit."""
        for k in range(min(accepted + 1, verified)):
            hit = float(k < accepted)
            if k == len(curve):
                if not prior or k >= len(prior):
                    curve.append(hit)
                    continue
                curve.append(prior[k])
            curve[k] += self.decay * (hit - curve[k])


def drain_seconds(gains: list[float], remaining: list[int], width: int, cost, drafts: bool) -> float:
    """Predicted seconds until every row is done when each round commits `gains[r]` tokens of row `r` (of its
    `remaining[r]`) and costs `cost.round_seconds(width, rows still running)`: a fluid model in which row `r` needs
    `remaining[r] / gains[r]` rounds and the batch shrinks as rows finish (on a CPU later rounds get cheaper; on a
    flat-cost accelerator this is `rounds of the slowest row x one round`)."""
    rounds = sorted(n / max(g, 1e-9) for n, g in zip(remaining, gains))
    seconds, done, b = 0.0, 0.0, len(rounds)
    for k, n in enumerate(rounds):
        if n > done:
            seconds += (n - done) * cost.round_seconds(width, b - k, drafts=drafts)
            done = n
    return seconds


__all__ = ["ARMS", "LEARNING_EXPLORE", "SCHEDULES", "SOURCES", "ProposalPolicy", "drain_seconds"]
