# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`OnlineSpecAdapter`: a PEFT LoRA adapter on the drafter that learns from the traffic it serves (OnlineSpec).

Every verification already computes what the drafter should have drafted: free supervision on the traffic actually
served (`online/feedback.py`). By default (`update_mode="request"`) the adapter learns from each whole served request
(every committed position is a training anchor) between requests; `"background"` does the same in a worker thread on
a shadow copy, swapped in one request later (`online/background.py`); `"round"` learns from every drafter round's
verification on the spot. Each update

1. computes the loss of the feedback under the current adapter(s) (the online loss of that step, for regret),
2. updates the LoRA matrices (`OnlineLearner`: ogd / optimistic, sgd / adam; an ensemble updates each member on
   its own loss and reweights them with Hedge),
3. checks safety: a non-finite loss or parameter, or a window of feedbacks whose mean acceptance fell
   `rollback_drop` below the last good window's, restores the last good snapshot.

The base drafter is never modified: LoRA wraps its linears (PEFT `inject_adapter_in_model`) and `detach()` puts the
original modules back. LoRA is NOT put on `k_proj`, `v_proj` or `fc`: the drafter's `DFlashCache` holds context
keys/values computed by those alone, so it stays exact after any update (no re-projection, no cache reset).
Decoding stays lossless whatever the adapter learns: the target verifies every drafted token.

Saving and loading (`save_pretrained` / `from_pretrained`, `online/persistence.py`) keep the whole learner state
(`training_state`), so a resumed adapter continues exactly as an uninterrupted one would.

The adapter lives in the drafter's runtime (`SpeculationRuntime.online_adapter`), so it keeps learning across
`generate` calls and requests; both engines feed it (`generation/candidate_generator.py`, `generation/batch.py`).
"""

import math
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from ..generation.runtime import SpeculationRuntime
from . import lora
from .background import BackgroundUpdates
from .feedback import RoundFeedback, SequenceFeedback, feedback_from_state, feedback_state, round_loss, sequence_loss
from .learners import Hedge, OnlineLearner
from .observer import OnlineObserver
from .online_config import OnlineSpecConfig
from .persistence import STATE_VERSION, load_adapter, lora_keys, save_adapter
from .stats import OnlineStats
from .vocab import VocabGrowth, set_draft_vocab


class OnlineSpecAdapter(OnlineObserver):
    """LoRA adapter(s) on `drafter`, updated online from verification feedback. See the module docstring. Decoding
    engines call its `on_round` / `on_request_end` hooks (`online/observer.py`).

    Args:
        drafter: an `AdaFlashDrafterModel` (its weights stay untouched).
        config: an `OnlineSpecConfig` (default: ogd + adam, cross-entropy).
    Use `OnlineSpecAdapter.attach(drafter, config)`: it also registers the adapter on the drafter, which is what
    `target.generate(assistant_model=drafter)` and the batched generator look for.
    """

    def __init__(self, drafter, config: OnlineSpecConfig | None = None):
        if _runtime_adapter(drafter) is not None:
            raise ValueError("this drafter already carries an online adapter; detach() it first.")
        self.drafter = drafter
        self.config = config or OnlineSpecConfig()
        names = self.config.adapter_names
        self.lora_config = self.config.lora_config()
        # Only the LoRA matrices learn (PEFT freezes the drafter's own weights); `detach` undoes all of it.
        self._undo = lora.inject(drafter, self.lora_config, names, self.config.seed)
        self._layers = lora.lora_layers(drafter)
        if not self._layers:
            raise ValueError(f"no drafter module matches target_modules={self.config.target_modules}.")
        self._base_scaling = {name: self._layers[0].scaling[name] for name in names}
        # The module that learns: the live drafter, or (background mode) a shadow copy whose LoRA weights are copied
        # into the live drafter at fixed points (`online/background.py`).
        self.trainee, self._train_layers, self.worker = drafter, self._layers, None
        if self.config.update_mode == "background":
            self.trainee = _shadow_copy(drafter)
            self._train_layers = lora.lora_layers(self.trainee)
            self.worker = BackgroundUpdates()
        self.vocab = VocabGrowth(self.config.vocab_growth, self.config.vocab_min_count)
        self._requests = 0
        self._interval = 1  # learn from every `_interval`-th request (`learn_while_paying`)
        factors = self.config.ensemble_lr_factors if self.config.algorithm == "ensemble" else (1.0,)
        rule = self.config.ensemble_base if self.config.algorithm == "ensemble" else self.config.algorithm
        self.learners = {name: OnlineLearner(self.lora_parameters(name), rule, self.config.optimizer,
                                             self.config.learning_rate * f) for name, f in zip(names, factors)}
        self.hedge = Hedge(len(names), self.config.hedge_eta)
        self.stats = OnlineStats()
        self.stream: list[RoundFeedback | SequenceFeedback] = []
        self._pending: list[RoundFeedback | SequenceFeedback] = []
        self._recent: list[RoundFeedback | SequenceFeedback] = []
        self._good = self._snapshot()
        self._reference: float | None = None
        self._checked = 0  # acceptance rounds when the safety window was last checked
        self.activate_for_drafting()

    # ------------------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def attach(cls, drafter, config: OnlineSpecConfig | None = None) -> "OnlineSpecAdapter":
        adapter = cls(drafter, config)
        SpeculationRuntime.of(drafter).online_adapter = adapter
        return adapter

    def detach(self) -> None:
        """Remove every LoRA layer: the drafter's modules are exactly the original ones again."""
        self.finish()
        self.vocab.restore(self.drafter)
        self.trainee, self._train_layers, self.worker = self.drafter, [], None
        lora.remove(self.drafter, self._undo)
        self._layers = []
        if _runtime_adapter(self.drafter) is self:
            self.drafter.runtime.online_adapter = None

    def lora_parameters(self, name: str) -> list[torch.Tensor]:
        """The LoRA matrices of adapter `name` in the module that learns (A, B of each wrapped linear, in module
        order; `persistence.lora_keys` names them)."""
        return lora.parameters(self._train_layers, name)

    _params = lora_parameters

    def activate(self, names: list[str]) -> None:
        """Activate adapters `names` (at base scaling) in the module that learns, e.g. to measure one member or a
        comparator; `activate_for_drafting` restores the drafting set-up."""
        self._activate(names)

    @contextmanager
    def scratch_adapter(self, name: str, seed: int = 0):
        """A fresh LoRA adapter `name` of this adapter's shape in the module that learns (B = 0: it starts as the
        static drafter), e.g. a comparator fitted in hindsight (`online/regret.py`). Yields its parameters; on exit
        it is deleted and the adapter(s) are activated for drafting again. The online state is not touched."""
        if name in self._base_scaling:
            raise ValueError(f"adapter {name!r} already exists.")
        lora.add_scratch(self.trainee, self.lora_config, name, seed)
        self._base_scaling[name] = self._train_layers[0].scaling[name]
        try:
            yield self.lora_parameters(name)
        finally:
            lora.drop(self.trainee, self.config.adapter_names, name)
            self._base_scaling.pop(name, None)
            self.activate_for_drafting()

    def _activate(self, names: list[str], scales: dict[str, float] | None = None, live: bool = False) -> None:
        """Activate adapters `names` (LoRA deltas scaled by `scales`) in the module that learns, or the live one."""
        module, layers = (self.drafter, self._layers) if live else (self.trainee, self._train_layers)
        lora.activate(module, layers, names, self._base_scaling, scales)

    def activate_for_drafting(self) -> None:
        """Ensemble `mixture`: every member active, its LoRA delta scaled by its Hedge weight; `leader`: the best.
        Every delta off (the static drafter) while the adapter does not pay (`drafts_static`)."""
        names = self.config.adapter_names
        live = self.trainee is not self.drafter
        self._static_live = self.drafts_static  # read by the serving thread only (the worker may append gains)
        if self._static_live:
            self._activate(names, dict.fromkeys(names, 0.0), live=live)
        elif len(names) == 1:
            self._activate(names, live=live)
        elif self.config.ensemble_mode == "leader":
            self._activate([names[self.hedge.leader]], live=live)
        else:
            self._activate(names, dict(zip(names, self.hedge.weights)), live=live)


    @property
    def drafts_static(self) -> bool:
        """Whether the static drafter drafts: the adapter's loss on the last `fallback_window` served requests was
        higher on average than the static drafter's (`stats.gains`, measured by the `learn_while_paying` gate)."""
        window = self.config.fallback_window
        return window > 0 and sum(self.stats.gains[-window:]) < 0

    # ------------------------------------------------------------------------------------------------ learning
    @property
    def learns_from_draft(self) -> bool:
        """Whether the drafting forward itself may be recorded for learning (one adapter, no replay needed)."""
        return len(self.config.adapter_names) == 1 and self.config.update_mode == "round"

    @property
    def learns_from_sequences(self) -> bool:
        """Whether decoding hands over whole served requests (`observe_sequence`) instead of rounds."""
        return self.config.update_mode != "round"

    def round_loss(self, feedback, lm_head, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Loss of one round or one served request under the active adapter(s) of the module that learns (a scalar
        with gradients). `logits`: a round's drafted logits if already computed with gradients."""
        rows = self._head_rows(lm_head)
        if isinstance(feedback, SequenceFeedback):
            return sequence_loss(self.trainee, rows, feedback, self.config, getattr(self.drafter, "draft_vocab", None))
        return round_loss(self.trainee, rows, feedback, self.config, logits)

    def _head_rows(self, lm_head) -> torch.Tensor:
        """The target LM head's rows of the draft vocabulary `[V', H]`, cached (built outside inference mode, so
        that autograd may save it; the drafter's own cached slice may be an inference tensor)."""
        weight = lm_head.weight
        cached = getattr(self, "_head_cache", None)
        if cached is None or cached[0] is not weight or cached[1] != weight._version:
            vocab = getattr(self.drafter, "draft_vocab", None)
            rows = weight.detach() if vocab is None else weight.detach()[vocab.to(weight.device)]
            self._head_cache = cached = (weight, weight._version, rows.clone())
        return cached[2]

    def observe(self, feedback: RoundFeedback, lm_head) -> dict:
        """Learn from one round: online loss, (maybe) an update, the safety check. Returns what happened.

        Works inside `torch.no_grad()` / `torch.inference_mode()` (e.g. within `generate`): learning re-enables
        autograd locally.
        """
        start = time.perf_counter()
        with torch.inference_mode(False):
            if any(t.is_inference() for t in (feedback.noise_embeds, feedback.context, feedback.target_logits)):
                feedback = feedback.detached()
            elif feedback.draft_logits is not None and feedback.draft_logits.grad_fn is None:
                feedback.draft_logits = None  # no graph to learn through: replay the round instead
            result = self._observe(feedback, lm_head)
            self.activate_for_drafting()
        self.stats.critical_seconds += time.perf_counter() - start
        return result

    def observe_sequence(self, feedback: SequenceFeedback | None, lm_head) -> dict:
        """Learn from one served request (`update_mode` "request" or "background"; module docstring of
        `online/feedback.py`). In background mode the update runs in the worker on the shadow copy, and the previous
        request's update is copied into the live drafter first (`online/background.py`)."""
        start = time.perf_counter()
        self._requests += 1
        self.stats.static_requests += self._static_live  # how the live drafter served this request
        result = {"loss": None, "updated": False, "rolled_back": False}
        if self.worker is not None:
            self.worker.wait()
            self._swap_in()
        if feedback is None:
            self.stats.skipped += 1
        else:
            self._grow_vocab(feedback)
            with torch.inference_mode(False):
                if self.worker is None:
                    result = self._observe(feedback, lm_head)
                    self.activate_for_drafting()
                else:
                    self.worker.submit(lambda: self._observe(feedback, lm_head))
                    result["submitted"] = True
        self.stats.critical_seconds += time.perf_counter() - start
        return result

    def _grow_vocab(self, feedback: SequenceFeedback) -> None:
        """Append the request's frequent outside tokens to the draft vocabulary (`online/vocab.py`), on the serving
        thread with no update running, so the drafting and the learning forwards always agree on it."""
        if getattr(feedback, "committed", None) is None or not self.vocab.observe(self.drafter, feedback.committed):
            return
        if self.trainee is not self.drafter:
            set_draft_vocab(self.trainee, self.drafter.draft_vocab.clone())
        self._head_cache = None
        self.stats.vocab_added = len(self.vocab.added)

    def skip_unpaid_request(self, lm_head) -> bool:
        """Called when a request is served, before its feedback is built. While learning does not pay
        (`learn_while_paying`) and this request is not one to learn from, it is only counted
        (`observe_sequence(None, ...)`) and True is returned: the caller skips building the feedback. In background
        mode the previous update is waited for and copied in first, so the answer never depends on the worker."""
        self.finish()
        if self._requests % self._interval == 0:
            return False
        self.observe_sequence(None, lm_head)
        return True

    @property
    def requests_seen(self) -> int:
        """Served requests handed to `observe_sequence` so far (counted on the serving thread: deterministic)."""
        return self._requests

    def finish(self) -> None:
        """Wait for a background update and copy it into the live drafter (before saving, or at the end)."""
        if self.worker is not None:
            start = time.perf_counter()
            self.worker.wait()
            self._swap_in()
            self.stats.critical_seconds += time.perf_counter() - start

    def _copy_lora(self, source_layers, target_layers) -> None:
        lora.copy(source_layers, target_layers, self.config.adapter_names)

    def _sync_trainee(self) -> None:
        """Copy the live drafter's LoRA weights into the shadow that learns (background mode)."""
        if self.trainee is not self.drafter:
            self._copy_lora(self._layers, self._train_layers)

    def _swap_in(self) -> None:
        """Copy the shadow's LoRA weights into the live drafter and re-weight the ensemble for drafting."""
        if self.trainee is self.drafter:
            return
        self._copy_lora(self._train_layers, self._layers)
        self.activate_for_drafting()

    def _observe(self, feedback: RoundFeedback, lm_head) -> dict:
        start = time.perf_counter()
        result = {"loss": None, "updated": False, "rolled_back": False}
        if isinstance(feedback, RoundFeedback) and feedback.num_drafted == 0:
            return result
        if self.config.record_stream:
            self.stream.append(feedback)
        self._pending.append(feedback)
        if feedback.num_drafted:  # a request served without drafter rounds still teaches, but measures nothing
            self.stats.acceptance.append(feedback.num_accepted / feedback.num_drafted)
            self.stats.accepted.append(feedback.num_accepted)
        names = self.config.adapter_names
        if len(self._pending) >= self.config.update_every:
            batch = self._pending + self._recent[-self.config.replay_window :] if self.config.replay_window else \
                self._pending
            member_losses, grads = [], {}
            with torch.enable_grad():
                for name in names:
                    self._activate([name])
                    params = self.lora_parameters(name)
                    # Pending rounds were drafted with the current parameters: their recorded logits are exact.
                    losses = [self.round_loss(fb, lm_head, getattr(fb, "draft_logits", None) if len(names) == 1
                                              else None) for fb in batch]
                    loss = torch.stack(losses).mean()
                    # The online loss of round t is the CURRENT round's loss before learning from it.
                    member_losses.append(float(losses[len(self._pending) - 1].detach()))
                    if self.learners[name].lr > 0 and torch.isfinite(loss):
                        grads[name] = torch.autograd.grad(loss, params, allow_unused=True)
            online = sum(w * x for w, x in zip(self.hedge.weights, member_losses)) if len(names) > 1 else \
                member_losses[0]
            result["loss"] = online
            if isinstance(feedback, SequenceFeedback) and self.config.learn_while_paying:
                self._gate(feedback, lm_head, online)
            self.stats.losses.append(online)
            if not all(math.isfinite(x) for x in member_losses):
                self._rollback(result)
            else:
                for name, g in grads.items():
                    g = [torch.zeros_like(p) if gi is None else gi for p, gi in zip(self.lora_parameters(name), g)]
                    norm = torch.sqrt(sum((gi.float() ** 2).sum() for gi in g))
                    scale = min(1.0, self.config.grad_clip / (float(norm) + 1e-12))
                    self.learners[name].step([gi * scale for gi in g])
                self.hedge.update(member_losses)
                self.stats.updates += 1
                self.stats.positions.append(sum(fb.positions for fb in batch))
                result["updated"] = True
                if not all(torch.isfinite(p).all() for name in names for p in self.lora_parameters(name)):
                    self._rollback(result)
            for fb in self._pending:
                if isinstance(fb, RoundFeedback):
                    fb.draft_logits = None  # their graph is used up (and parameters have moved)
            self._recent = (self._recent + self._pending)[-max(self.config.replay_window, 1) :]
            self._pending = []
        else:  # no update this round: still account its online loss
            with torch.no_grad():
                logits = getattr(feedback, "draft_logits", None)
                logits = None if logits is None else logits.detach()
                result["loss"] = float(self.round_loss(feedback, lm_head, logits))
            self.stats.losses.append(result["loss"])
        self._safety_window(result)
        if len(names) > 1:
            self.stats.weights.append(self.hedge.weights)
        self.stats.update_seconds += time.perf_counter() - start
        return result

    def _gate(self, feedback: SequenceFeedback, lm_head, online: float) -> None:
        """Does learning pay? Compare with the static drafter on the new request, and set how often to learn."""
        names = self.config.adapter_names
        self._activate(names, dict.fromkeys(names, 0.0))  # every LoRA delta off: the static drafter
        with torch.no_grad():
            static = float(self.round_loss(feedback, lm_head))
        self._learn_interval(static - online)

    def _learn_interval(self, gain: float) -> None:
        """Learn from every request while the mean gain of the last `gate_window` updates is positive; back off
        (every 2nd, 4th, ... request, at most `gate_max_interval`) while it is not."""
        self.stats.gains.append(gain)
        recent = self.stats.gains[-self.config.gate_window :]
        if sum(recent) > 0:
            self._interval = 1
        elif len(recent) * 2 >= self.config.gate_window:
            self._interval = min(2 * self._interval, self.config.gate_max_interval)

    # ------------------------------------------------------------------------------------------------ safety
    def _snapshot(self) -> dict:
        return {"learners": {n: lrn.state_dict() for n, lrn in self.learners.items()},
                "hedge": list(self.hedge.cumulative)}

    def _rollback(self, result: dict) -> None:
        for name, state in self._good["learners"].items():
            self.learners[name].load_state_dict(state)
        self.hedge.cumulative = list(self._good["hedge"])
        self.stats.rollbacks.append(len(self.stats.acceptance))
        result["rolled_back"] = True

    def _safety_window(self, result: dict) -> None:
        """Every `rollback_window` rounds: keep a good snapshot, or roll back after a sustained acceptance drop."""
        window, count = self.config.rollback_window, len(self.stats.acceptance)
        # Keyed on the window's rounds, not on being called: an update that measured no round (a request served
        # without drafter rounds) must neither re-check the same window nor re-snapshot its state as "good".
        if count == self._checked or count % window:
            return
        self._checked = count
        mean = sum(self.stats.acceptance[-window:]) / window
        if self._reference is not None and mean < (1 - self.config.rollback_drop) * self._reference:
            self._rollback(result)
            # Re-baseline: a drop caused by the traffic rather than by the adapter costs one rollback, not a loop.
        else:
            self._good = self._snapshot()
        self._reference = mean

    # ------------------------------------------------------------------------------------------------ state
    def training_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Everything an exact resume needs besides the LoRA weights (which PEFT saves): `(state, tensors)`.

        `state` (JSON-able): the request counter (it seeds each request's anchors), the gate's interval, the safety
        check's reference and last checked window, Hedge's cumulative losses, each learner's step count, the good
        snapshot's, all `stats`, and an index of the feedback kept for later updates (pending rounds, the replay
        window, the recorded stream). `tensors`: each learner's optimizer buffers (Adam moments, optimistic hint)
        named `learner/<member>/<m|v|previous>/<lora key>`, the good snapshot (`good/<member>/<params|...>/...`)
        and the kept feedback (`feedback/<i>/<field>`). A background update still running is finished first.
        """
        self.finish()
        keys, tensors = lora_keys(self.trainee), {}

        def put(prefix: str, learner_state: dict, kinds) -> None:
            for kind in kinds:
                tensors.update((f"{prefix}/{kind}/{key}", t) for key, t in zip(keys, learner_state[kind]))

        for name, learner in self.learners.items():
            put(f"learner/{name}", learner.state_dict(), learner.buffer_names)
            put(f"good/{name}", self._good["learners"][name], ("params", *learner.buffer_names))
        kept, index = [], {}
        recent = self._recent[-self.config.replay_window :] if self.config.replay_window else []
        for fb in self._pending + recent + self.stream:
            if id(fb) not in index:
                index[id(fb)] = len(kept)
                meta, arrays = feedback_state(fb)
                tensors.update((f"feedback/{len(kept)}/{k}", t) for k, t in arrays.items())
                kept.append(meta)
        state = {
            "version": STATE_VERSION, "requests_seen": self._requests, "learn_interval": self._interval,
            "reference": self._reference, "checked": self._checked, "hedge_cumulative": list(self.hedge.cumulative),
            "learner_steps": {n: lrn.steps for n, lrn in self.learners.items()},
            "good": {"hedge_cumulative": list(self._good["hedge"]),
                     "learner_steps": {n: st["steps"] for n, st in self._good["learners"].items()}},
            "stats": asdict(self.stats), "feedback": kept, "vocab": self.vocab.state_dict(),
            **{key: [index[id(fb)] for fb in kept_list] for key, kept_list in
               (("pending", self._pending), ("recent", recent), ("stream", self.stream))},
        }
        return state, tensors

    def load_training_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `training_state` returned (on an adapter whose LoRA weights are already the saved ones, in
        the live drafter). `online/persistence.py` validates both first. A state without `version` (written before
        the learner state was saved) restores Hedge's weights only."""
        if self.worker is not None:
            self.worker.wait()  # a running update is dropped, not copied in: the live weights are the ones to keep
        self._sync_trainee()
        if "version" not in state:
            self.hedge.cumulative = [float(x) for x in state["hedge_cumulative"]]
            self._good = self._snapshot()
            self.activate_for_drafting()
            return
        keys = lora_keys(self.trainee)
        device = self._train_layers[0].lora_A[self.config.adapter_names[0]].weight.device

        def get(prefix: str, kind: str) -> list[torch.Tensor]:
            return [tensors[f"{prefix}/{kind}/{key}"].to(device) for key in keys]

        good = {"learners": {}, "hedge": [float(x) for x in state["good"]["hedge_cumulative"]]}
        for name, learner in self.learners.items():
            kinds = learner.buffer_names
            learner.load_state_dict({"params": [p.detach() for p in learner.params], "m": None, "v": None,
                                     "previous": None, **{k: get(f"learner/{name}", k) for k in kinds},
                                     "steps": int(state["learner_steps"][name])})
            good["learners"][name] = {"m": None, "v": None, "previous": None,
                                      **{k: get(f"good/{name}", k) for k in ("params", *kinds)},
                                      "steps": int(state["good"]["learner_steps"][name])}
        self._good = good
        self.hedge.cumulative = [float(x) for x in state["hedge_cumulative"]]
        self._requests, self._interval = int(state["requests_seen"]), int(state["learn_interval"])
        self._reference, self._checked = state["reference"], int(state["checked"])
        self.stats = OnlineStats(**state["stats"])
        if "vocab" in state:
            self.vocab.load_state_dict(state["vocab"], self.drafter)
            if self.trainee is not self.drafter and self.drafter.draft_vocab is not None:
                set_draft_vocab(self.trainee, self.drafter.draft_vocab.clone())
            self._head_cache = None
        kept = [feedback_from_state(meta, {k[len(f"feedback/{i}/") :]: t for k, t in tensors.items()
                                           if k.startswith(f"feedback/{i}/")}, device)
                for i, meta in enumerate(state["feedback"])]
        self._pending = [kept[i] for i in state["pending"]]
        self._recent = [kept[i] for i in state["recent"]]
        self.stream = [kept[i] for i in state["stream"]]
        self.activate_for_drafting()

    # ------------------------------------------------------------------------------------------------ save / load
    def save_pretrained(self, folder) -> Path:
        """Crash-safely write the adapter(s) in PEFT format, `online_config.json`, the learner state
        (`online_optimizer.safetensors`) and `online_state.json` (written last: it marks the folder complete and
        holds the other files' SHA-256). See `online/persistence.py` for the layout and the crash-safety protocol.
        A background update still running is waited for and copied in first: what is saved is the latest adapter."""
        return save_adapter(self, folder)

    @classmethod
    def from_pretrained(cls, drafter, folder, attach: bool = True) -> "OnlineSpecAdapter":
        """Load an adapter saved by `save_pretrained` onto `drafter` (and attach it, by default), learner state
        included: it continues exactly where the saved one was.

        Every file is validated (JSON, keys, tensor names and shapes, checksums) before `drafter` is touched, and a
        failure after that detaches again: a failed load leaves `drafter` as it was. If `folder` is missing because
        a save was interrupted between its two renames, the save's complete temporary sibling is loaded, else the
        previous one. Only safetensors weights are read (pickle is refused)."""
        return load_adapter(cls, drafter, folder, attach=attach)


def _shadow_copy(drafter):
    """A deep copy of the drafter (with its LoRA layers) that a background worker can train; the runtime (which
    holds the adapter itself) is not copied."""
    import copy

    runtime, drafter.runtime = drafter.runtime, None
    try:
        shadow = copy.deepcopy(drafter)
    finally:
        drafter.runtime = runtime
    return shadow


def _runtime_adapter(drafter):
    runtime = getattr(drafter, "runtime", None)
    return None if runtime is None else runtime.online_adapter


__all__ = ["OnlineSpecAdapter", "OnlineStats"]
