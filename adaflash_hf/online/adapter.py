# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`OnlineSpecAdapter`: a PEFT LoRA adapter on the drafter that learns from every verification round (OnlineSpec).

Every verification round already computes the target's logits at each drafted position: free supervision on the
traffic actually served. After a round, the adapter

1. replays the round's drafting forward WITH gradients, cache-free, on a window of the last `context_window` target
   hidden states before the anchor (`RoundFeedback`),
2. scores the drafted positions against the target's raw logits (cross-entropy on the target's greedy token, or
   reverse KL), up to and including the first rejected position, with DFlash's position decay,
3. updates the LoRA matrices (`OnlineLearner`: ogd / optimistic, sgd / adam; an ensemble updates each member on
   its own loss and reweights them with Hedge),
4. checks safety: a non-finite loss or parameter, or a window of rounds whose mean acceptance fell
   `rollback_drop` below the last good window's, restores the last good snapshot.

The base drafter is never modified: LoRA wraps its linears (PEFT `inject_adapter_in_model`) and `detach()` puts the
original modules back. LoRA is NOT put on `k_proj`, `v_proj` or `fc`: the drafter's `DFlashCache` holds context
keys/values computed by those alone, so it stays exact after any update (no re-projection, no cache reset).
Decoding stays lossless whatever the adapter learns: the target verifies every drafted token.

The adapter lives in the drafter's runtime (`SpeculationRuntime.online_adapter`), so it keeps learning across
`generate` calls and requests; the candidate generator feeds it (see `generation/candidate_generator.py`).
"""

import json
import math
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.functional import get_peft_model_state_dict, inject_adapter_in_model, set_adapter, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from ..generation.runtime import SpeculationRuntime
from .learners import Hedge, OnlineLearner
from .online_config import CONFIG_NAME, OnlineSpecConfig


STATE_NAME = "online_state.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class RoundFeedback:
    """What one verification round of one sequence teaches the drafter.

    Attributes:
        noise_embeds: `[1, B, H]` the block's query embeddings (anchor + mask tokens), as drafted.
        context: `[1, W, F]` target hidden states (at `target_layer_ids`) of the `W <= context_window` tokens
            before the anchor.
        position_ids: `[1, W + B]` positions of the context tokens, then of the block.
        target_logits: `[n, V']` the target's raw logits at drafted positions 1..n, restricted to the drafter's
            draft vocabulary (`V' = draft_vocab_size`, or the full vocabulary).
        target_tokens: `[n]` index in `V'` of the target's greedy token (-100 where it lies outside the draft vocab).
        num_accepted: drafted tokens the target accepted this round (`0 <= num_accepted <= n`).
        draft_logits: optional `[n, V']` drafted logits WITH their autograd graph, from the drafting forward itself
            (then learning needs no replay forward); used once, for the update of this round, then dropped.
    """

    noise_embeds: torch.Tensor
    context: torch.Tensor
    position_ids: torch.Tensor
    target_logits: torch.Tensor
    target_tokens: torch.Tensor
    num_accepted: int
    draft_logits: torch.Tensor | None = None

    @property
    def num_drafted(self) -> int:
        return self.target_logits.shape[0]

    @classmethod
    def from_round(cls, drafter, noise_embeds, context, position_ids, raw_logits, num_accepted: int,
                   draft_logits: torch.Tensor | None = None):
        """Build from the round's data; `raw_logits` `[n, V]` are the target's logits over its full vocabulary."""
        raw_logits = raw_logits.detach().float()
        tokens = raw_logits.argmax(dim=-1)
        vocab = getattr(drafter, "draft_vocab", None)
        if vocab is not None:
            vocab = vocab.to(raw_logits.device)
            index = torch.full((raw_logits.shape[-1],), -100, dtype=torch.long, device=raw_logits.device)
            index[vocab] = torch.arange(vocab.numel(), device=raw_logits.device)
            tokens, raw_logits = index[tokens], raw_logits[:, vocab]
        return cls(noise_embeds.detach(), context.detach(), position_ids.detach(), raw_logits, tokens,
                   int(num_accepted), draft_logits)


@dataclass
class OnlineStats:
    """The stream as the learner saw it: one entry per round it learned from."""

    losses: list[float] = field(default_factory=list)  # online loss l_t(theta_t), before learning from round t
    acceptance: list[float] = field(default_factory=list)  # accepted / drafted of round t
    accepted: list[int] = field(default_factory=list)
    update_seconds: float = 0.0
    updates: int = 0
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
        factors = self.config.ensemble_lr_factors if self.config.algorithm == "ensemble" else (1.0,)
        rule = self.config.ensemble_base if self.config.algorithm == "ensemble" else self.config.algorithm
        self.learners = {name: OnlineLearner(self._params(name), rule, self.config.optimizer,
                                             self.config.learning_rate * f) for name, f in zip(names, factors)}
        self.hedge = Hedge(len(names), self.config.hedge_eta)
        self.stats = OnlineStats()
        self.stream: list[RoundFeedback] = []
        self._pending: list[RoundFeedback] = []
        self._recent: list[RoundFeedback] = []
        self._good = self._snapshot()
        self._reference: float | None = None
        self._activate_for_drafting()

    # ------------------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def attach(cls, drafter, config: OnlineSpecConfig | None = None) -> "OnlineSpecAdapter":
        adapter = cls(drafter, config)
        SpeculationRuntime.of(drafter).online_adapter = adapter
        return adapter

    def detach(self) -> None:
        """Remove every LoRA layer: the drafter's modules are exactly the original ones again."""
        for name, module in list(self.drafter.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, BaseTunerLayer):
                    setattr(module, child_name, child.get_base_layer())
        self._layers = []
        for p in self._frozen:
            p.requires_grad_(True)
        if _runtime_adapter(self.drafter) is self:
            self.drafter.runtime.online_adapter = None

    def _params(self, name: str) -> list[torch.Tensor]:
        params = []
        for layer in self._layers:
            params += [layer.lora_A[name].weight, layer.lora_B[name].weight]
        return params

    def _activate(self, names: list[str], scales: dict[str, float] | None = None) -> None:
        set_adapter(self.drafter, names)
        for layer in self._layers:
            for name in names:
                layer.scaling[name] = self._base_scaling[name] * (scales or {}).get(name, 1.0)

    def _activate_for_drafting(self) -> None:
        """Ensemble `mixture`: every member active, its LoRA delta scaled by its Hedge weight; `leader`: the best."""
        names = self.config.adapter_names
        if len(names) == 1:
            self._activate(names)
        elif self.config.ensemble_mode == "leader":
            self._activate([names[self.hedge.leader]])
        else:
            self._activate(names, dict(zip(names, self.hedge.weights)))

    # ------------------------------------------------------------------------------------------------ learning
    @property
    def learns_from_draft(self) -> bool:
        """Whether the drafting forward itself may be recorded for learning (one adapter, no replay needed)."""
        return len(self.config.adapter_names) == 1

    def round_loss(self, feedback: RoundFeedback, lm_head, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Loss of one round under the currently active adapter(s) (a scalar with gradients).

        `logits` `[n, V']`: the round's drafted logits if already computed with gradients (else a replay forward).
        """
        n = feedback.num_drafted
        if logits is None:
            states = self.drafter(noise_embeds=feedback.noise_embeds, context_hidden_states=feedback.context,
                                  position_ids=feedback.position_ids).last_hidden_state[:, 1 : 1 + n]
            rows = self._head_rows(lm_head)
            logits = F.linear(states.to(device=rows.device, dtype=rows.dtype), rows)[0]
        logits = logits.float()  # [n, V']
        if self.config.loss == "ce":
            per = F.cross_entropy(logits, feedback.target_tokens, ignore_index=-100, reduction="none")
        else:  # KL(q_drafter || p_target) over the draft vocabulary
            log_q = logits.log_softmax(-1)
            per = (log_q.exp() * (log_q - feedback.target_logits.log_softmax(-1))).sum(-1)
        per = per.clamp(max=self.config.kl_clip)
        k = torch.arange(n, device=per.device, dtype=torch.float32)
        weights = torch.ones_like(k) if self.config.loss_decay_gamma is None else torch.exp(
            -k / self.config.loss_decay_gamma)
        if not self.config.learn_after_rejection:
            weights = weights * (k <= feedback.num_accepted)  # up to and including the first rejected position
        if self.config.loss == "ce":
            weights = weights * (feedback.target_tokens != -100)
        return (per * weights).sum() / weights.sum().clamp_min(1e-8)

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
        with torch.inference_mode(False):
            if any(t.is_inference() for t in (feedback.noise_embeds, feedback.context, feedback.target_logits)):
                feedback = RoundFeedback(*(t.clone() for t in (feedback.noise_embeds, feedback.context,
                                                                feedback.position_ids, feedback.target_logits,
                                                                feedback.target_tokens)), feedback.num_accepted)
            elif feedback.draft_logits is not None and feedback.draft_logits.grad_fn is None:
                feedback.draft_logits = None  # no graph to learn through: replay the round instead
            return self._observe(feedback, lm_head)

    def _observe(self, feedback: RoundFeedback, lm_head) -> dict:
        start = time.perf_counter()
        result = {"loss": None, "updated": False, "rolled_back": False}
        if feedback.num_drafted == 0:
            return result
        if self.config.record_stream:
            self.stream.append(feedback)
        self._pending.append(feedback)
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
                    params = self._params(name)
                    # Pending rounds were drafted with the current parameters: their recorded logits are exact.
                    losses = [self.round_loss(fb, lm_head, fb.draft_logits if len(names) == 1 else None)
                              for fb in batch]
                    loss = torch.stack(losses).mean()
                    # The online loss of round t is the CURRENT round's loss before learning from it.
                    member_losses.append(float(losses[len(self._pending) - 1].detach()))
                    if self.learners[name].lr > 0 and torch.isfinite(loss):
                        grads[name] = torch.autograd.grad(loss, params, allow_unused=True)
            online = sum(w * x for w, x in zip(self.hedge.weights, member_losses)) if len(names) > 1 else \
                member_losses[0]
            result["loss"] = online
            self.stats.losses.append(online)
            if not all(math.isfinite(x) for x in member_losses):
                self._rollback(result)
            else:
                for name, g in grads.items():
                    g = [torch.zeros_like(p) if gi is None else gi for p, gi in zip(self._params(name), g)]
                    norm = torch.sqrt(sum((gi.float() ** 2).sum() for gi in g))
                    scale = min(1.0, self.config.grad_clip / (float(norm) + 1e-12))
                    self.learners[name].step([gi * scale for gi in g])
                self.hedge.update(member_losses)
                self.stats.updates += 1
                result["updated"] = True
                if not all(torch.isfinite(p).all() for name in names for p in self._params(name)):
                    self._rollback(result)
            for fb in self._pending:
                fb.draft_logits = None  # their graph is used up (and parameters have moved)
            self._recent = (self._recent + self._pending)[-max(self.config.replay_window, 1) :]
            self._pending = []
        else:  # no update this round: still account its online loss
            with torch.no_grad():
                logits = None if feedback.draft_logits is None else feedback.draft_logits.detach()
                result["loss"] = float(self.round_loss(feedback, lm_head, logits))
            self.stats.losses.append(result["loss"])
        self._safety_window(result)
        self._activate_for_drafting()
        if len(names) > 1:
            self.stats.weights.append(self.hedge.weights)
        self.stats.update_seconds += time.perf_counter() - start
        return result

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
        window = self.config.rollback_window
        if len(self.stats.acceptance) % window:
            return
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
        """
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
        adapter._good = adapter._snapshot()
        adapter._activate_for_drafting()
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


def _runtime_adapter(drafter):
    runtime = getattr(drafter, "runtime", None)
    return None if runtime is None else runtime.online_adapter


__all__ = ["OnlineSpecAdapter", "OnlineStats", "RoundFeedback"]
