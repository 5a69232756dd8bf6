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

The adapter lives in the drafter's runtime (`SpeculationRuntime.online_adapter`), so it keeps learning across
`generate` calls and requests; both engines feed it (`generation/candidate_generator.py`, `generation/batch.py`).
"""

import json
import math
import os
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig
from peft.functional import (
    delete_adapter,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_adapter,
    set_peft_model_state_dict,
)
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from ..generation.runtime import SpeculationRuntime
from .background import BackgroundUpdates
from .feedback import RoundFeedback, SequenceFeedback, round_loss, sequence_loss
from .learners import Hedge, OnlineLearner
from .online_config import CONFIG_NAME, OnlineSpecConfig


STATE_NAME = "online_state.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class OnlineStats:
    """The stream as the learner saw it: one entry per round it learned from."""

    losses: list[float] = field(default_factory=list)  # online loss l_t(theta_t), before learning from round t
    acceptance: list[float] = field(default_factory=list)  # accepted / drafted of round t
    accepted: list[int] = field(default_factory=list)
    update_seconds: float = 0.0  # all learning compute (serving thread and background worker)
    critical_seconds: float = 0.0  # the part the serving thread spent (sync updates, waiting for the worker, swaps)
    updates: int = 0
    positions: list[int] = field(default_factory=list)  # drafted positions each update learned from
    gains: list[float] = field(default_factory=list)  # static loss - adapter loss on each new request (gated modes)
    skipped: int = 0  # served requests not learned from (learning was not paying)
    rollbacks: list[int] = field(default_factory=list)  # rounds at which a rollback happened
    weights: list[list[float]] = field(default_factory=list)  # Hedge weights after each round (ensemble)

    @property
    def rounds(self) -> int:
        return len(self.losses)

    @property
    def cumulative_loss(self) -> float:
        return float(sum(self.losses))


class OnlineSpecAdapter:
    """LoRA adapter(s) on `drafter`, updated online from verification feedback. See the module docstring.

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
        lora = LoraConfig(r=self.config.lora_r, lora_alpha=self.config.lora_alpha,
                          lora_dropout=self.config.lora_dropout, target_modules=list(self.config.target_modules))
        # Only the LoRA matrices learn: PEFT freezes the drafter's own weights; `detach` restores these flags.
        self._frozen = [p for p in drafter.parameters() if p.requires_grad]
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # ensembles: on purpose
            torch.manual_seed(self.config.seed)
            for name in names:
                inject_adapter_in_model(lora, drafter, adapter_name=name)
        self.lora_config = lora
        for n, p in drafter.named_parameters():
            if "lora_" not in n:
                p.requires_grad_(False)
        self._layers = [m for m in drafter.modules() if isinstance(m, BaseTunerLayer)]
        if not self._layers:
            raise ValueError(f"no drafter module matches target_modules={self.config.target_modules}.")
        self._base_scaling = {name: self._layers[0].scaling[name] for name in names}
        # The module that learns: the live drafter, or (background mode) a shadow copy whose LoRA weights are copied
        # into the live drafter at fixed points (`online/background.py`).
        self.trainee, self._train_layers, self.worker = drafter, self._layers, None
        if self.config.update_mode == "background":
            self.trainee = _shadow_copy(drafter)
            self._train_layers = [m for m in self.trainee.modules() if isinstance(m, BaseTunerLayer)]
            self.worker = BackgroundUpdates()
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
        self.trainee, self._train_layers, self.worker = self.drafter, [], None
        for name, module in list(self.drafter.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, BaseTunerLayer):
                    setattr(module, child_name, child.get_base_layer())
        self._layers = []
        for p in self._frozen:
            p.requires_grad_(True)
        if _runtime_adapter(self.drafter) is self:
            self.drafter.runtime.online_adapter = None

    def lora_parameters(self, name: str) -> list[torch.Tensor]:
        """The LoRA matrices of adapter `name` in the module that learns (A, B of each wrapped linear, in module
        order)."""
        params = []
        for layer in self._train_layers:
            params += [layer.lora_A[name].weight, layer.lora_B[name].weight]
        return params

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
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # a second adapter, on purpose
            torch.manual_seed(seed)
            inject_adapter_in_model(self.lora_config, self.trainee, adapter_name=name)
        self._base_scaling[name] = self._train_layers[0].scaling[name]
        try:
            yield self.lora_parameters(name)
        finally:
            set_adapter(self.trainee, self.config.adapter_names)
            delete_adapter(self.trainee, name, prefix="lora_")
            self._base_scaling.pop(name, None)
            self.activate_for_drafting()

    def _activate(self, names: list[str], scales: dict[str, float] | None = None, live: bool = False) -> None:
        """Activate adapters `names` (LoRA deltas scaled by `scales`) in the module that learns, or the live one."""
        module, layers = (self.drafter, self._layers) if live else (self.trainee, self._train_layers)
        set_adapter(module, names)
        for layer in layers:
            for name in names:
                layer.scaling[name] = self._base_scaling[name] * (scales or {}).get(name, 1.0)

    def activate_for_drafting(self) -> None:
        """Ensemble `mixture`: every member active, its LoRA delta scaled by its Hedge weight; `leader`: the best."""
        names = self.config.adapter_names
        live = self.trainee is not self.drafter
        if len(names) == 1:
            self._activate(names, live=live)
        elif self.config.ensemble_mode == "leader":
            self._activate([names[self.hedge.leader]], live=live)
        else:
            self._activate(names, dict(zip(names, self.hedge.weights)), live=live)


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
        result = {"loss": None, "updated": False, "rolled_back": False}
        if self.worker is not None:
            self.worker.wait()
            self._swap_in()
        if feedback is None:
            self.stats.skipped += 1
        else:
            with torch.inference_mode(False):
                if self.worker is None:
                    result = self._observe(feedback, lm_head)
                    self.activate_for_drafting()
                else:
                    self.worker.submit(lambda: self._observe(feedback, lm_head))
                    result["submitted"] = True
        self.stats.critical_seconds += time.perf_counter() - start
        return result

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
        with torch.no_grad():
            for source, target in zip(source_layers, target_layers):
                for name in self.config.adapter_names:
                    target.lora_A[name].weight.copy_(source.lora_A[name].weight)
                    target.lora_B[name].weight.copy_(source.lora_B[name].weight)

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

    # ------------------------------------------------------------------------------------------------ save / load
    def save_pretrained(self, folder) -> Path:
        """Crash-safely write the adapter(s) in PEFT format (+ `online_config.json`, `online_state.json`).

        One adapter: `adapter_config.json` + `adapter_model.safetensors` in `folder`; an ensemble: one such
        subfolder per member.

        Crash safety (old or new adapter loadable at every instant): everything is written and fsynced into a
        sibling `.NAME.tmp-<id>`, whose `online_state.json` is written last (atomically) and marks it complete; then
        `folder` is renamed aside to `.NAME.old-<id>`, the complete tmp folder renamed to `folder`, and the old one
        deleted. A crash before the first rename leaves the old `folder`; between the two renames `folder` is
        missing and `from_pretrained` loads the complete `.NAME.tmp-*` sibling (the new adapter), else the newest
        `.NAME.old-*` one (the previous adapter); after the second, `folder` is the new adapter. The next save
        puts `folder` back and deletes the leftovers. Concurrent saves to one folder are not supported.
        A background update still running is waited for and copied in first: what is saved is the latest adapter.
        """
        self.finish()
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = folder.with_name(f".{folder.name}.tmp-{tag}")
        tmp.mkdir()
        try:
            names = self.config.adapter_names
            for name in names:
                sub = tmp if len(names) == 1 else tmp / name
                sub.mkdir(exist_ok=True)
                self.lora_config.save_pretrained(str(sub))
                state = get_peft_model_state_dict(self.drafter, adapter_name=name)
                save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(sub / WEIGHTS_NAME))
            self.config.save_pretrained(tmp)
            _fsync_tree(tmp)
            part = tmp / f".{STATE_NAME}.part"  # the state file goes last, atomically: it marks `tmp` complete
            part.write_text(json.dumps({
                "rounds": self.stats.rounds, "updates": self.stats.updates, "rollbacks": self.stats.rollbacks,
                "hedge_cumulative": self.hedge.cumulative,
                "learner_steps": {n: l.steps for n, l in self.learners.items()},
            }, indent=2) + "\n")
            _fsync(part)
            os.replace(part, tmp / STATE_NAME)
            _fsync(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if folder.exists():
            os.replace(folder, folder.with_name(f".{folder.name}.old-{tag}"))
        os.replace(tmp, folder)
        _fsync(folder.parent)
        for leftover in _save_leftovers(folder):  # this save's old folder, and those of crashed saves
            shutil.rmtree(leftover, ignore_errors=True)
        return folder

    @classmethod
    def from_pretrained(cls, drafter, folder, attach: bool = True) -> "OnlineSpecAdapter":
        """Load an adapter saved by `save_pretrained` onto `drafter` (and attach it, by default).

        If `folder` is missing because a save was interrupted between its two renames, the adapter is loaded from
        the save's complete temporary sibling, else from the previous one (see `save_pretrained`). Only safetensors
        weights are read (pickle is refused), and every LoRA tensor the adapter needs must be there, with its shape
        and finite values.
        """
        from ..interop.safety import PICKLE_SUFFIXES, CheckpointError, _pickle_message

        folder = _recover_saved_folder(Path(folder))
        config = OnlineSpecConfig.from_pretrained(folder)
        adapter = cls(drafter, config)
        names = config.adapter_names
        for name in names:
            sub = folder if len(names) == 1 else folder / name
            path = sub / WEIGHTS_NAME
            if not path.is_file():
                pickles = sorted(p for p in sub.iterdir() if p.suffix in PICKLE_SUFFIXES) if sub.is_dir() else []
                if pickles:
                    raise CheckpointError(_pickle_message(pickles))
                raise FileNotFoundError(f"{path} missing: incomplete OnlineSpec adapter folder.")
            found, expected = load_file(str(path)), get_peft_model_state_dict(drafter, adapter_name=name)
            missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
            if missing:
                raise ValueError(f"{path}: incomplete adapter, missing {len(missing)} of {len(expected)} LoRA "
                                 f"tensors: {missing}.")
            if unexpected:
                raise ValueError(f"{path}: weights do not fit this drafter (unexpected tensors {unexpected}).")
            wrong = [f"{k} {list(found[k].shape)} (expected {list(v.shape)})" for k, v in expected.items()
                     if found[k].shape != v.shape]
            bad = [k for k, t in found.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            if wrong or bad:
                raise ValueError(f"{path}: corrupt adapter: " + "; ".join(
                    ([f"wrong shapes {wrong}"] if wrong else []) + ([f"non-finite values in {bad}"] if bad else [])))
            set_peft_model_state_dict(drafter, found, adapter_name=name)
        state_path = folder / STATE_NAME
        if state_path.is_file():
            state = json.loads(state_path.read_text())
            adapter.hedge.cumulative = list(state.get("hedge_cumulative", adapter.hedge.cumulative))
        adapter._sync_trainee()  # the loaded weights are in the live drafter; a background shadow learns from them
        adapter._good = adapter._snapshot()
        adapter.activate_for_drafting()
        if attach:
            SpeculationRuntime.of(drafter).online_adapter = adapter
        return adapter


def _fsync(path) -> None:
    """Flush a file's or a folder's entry to disk (best effort: some filesystems refuse folder fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(root)


def _save_leftovers(folder: Path) -> list[Path]:
    """`.NAME.tmp-*` and `.NAME.old-*` siblings of `folder` (what interrupted or finished saves leave)."""
    prefix = f".{folder.name}."
    if not folder.parent.is_dir():
        return []
    return sorted(p for p in folder.parent.iterdir()
                  if p.name.startswith((prefix + "tmp-", prefix + "old-")) and p.is_dir())


def _recover_saved_folder(folder: Path) -> Path:
    """`folder`, or when a save was interrupted between its renames, the complete sibling to load instead."""
    if folder.exists():
        return folder
    leftovers = _save_leftovers(folder)
    new = [p for p in leftovers if p.name.startswith(f".{folder.name}.tmp-") and (p / STATE_NAME).is_file()]
    old = [p for p in leftovers if p.name.startswith(f".{folder.name}.old-") and (p / CONFIG_NAME).is_file()]
    for candidates, marker in ((new, STATE_NAME), (old, CONFIG_NAME)):
        if candidates:
            chosen = max(candidates, key=lambda p: (p / marker).stat().st_mtime)
            warnings.warn(f"{folder} is missing (a save was interrupted); loading {chosen.name} instead. The next "
                          "save_pretrained puts the folder back.", stacklevel=3)
            return chosen
    return folder


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
