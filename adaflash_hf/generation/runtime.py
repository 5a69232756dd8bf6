# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`SpeculationRuntime`: what a drafter decodes with besides its weights and its generation config.

A drafter's checkpoint holds its architecture (`config.json`), weights and decoding knobs
(`generation_config.json`, `AdaFlashGenerationConfig`). Three more things take part in decoding and are not part
of the drafter: an adaptive length head, the target's cost model on this device, and an OnlineSpec adapter; plus
the proposal policy's state, which adapts across calls (unless the generation config's `policy_schedule` is
`"transient"`). They live in one explicit runtime object, attached to the drafter's declared `runtime` attribute (as
PEFT keeps runtime-only settings out of what `to_dict()` saves):

```python
runtime = SpeculationRuntime(length_head=head, cost_model=TargetCostModel.load(".../cost_model.json", implicit=True))
runtime.attach(drafter)          # generate(assistant_model=drafter) and generate_batch now use them
SpeculationRuntime.of(drafter).policy.reset()  # forget what the policy learned; .frozen = True to fix it (works on
                                               # a freshly loaded drafter too: an empty runtime is attached first)
```

Per-call statistics are not kept here: `generate(..., return_dict_in_generate=True)` returns them as
`output.speculation_stats`, `generate_batch(..., return_stats=True)` as its second value.
"""

import contextlib
from dataclasses import dataclass, field

from .policy import SCHEDULES, ProposalPolicy


@dataclass
class SpeculationRuntime:
    """Runtime components of speculative decoding with one drafter (module docstring).

    Attributes:
        length_head: an `AdaFlashLengthHead` (used by the `"auto"` / `"head"` length policies), or None.
        cost_model: a `TargetCostModel`. Passed here by the user, it decides on any device (one measured on
            another device simulates that device: `TargetCostModel.load(FILE)`, `shipped_cost_model(NAME)`); one that
            came beside a checkpoint (`implicit`, e.g. a length head folder's) only on the device/dtype/threads it
            was measured on, otherwise one measured on the current device is used and cached
            (`cost_model.cost_model_for`).
        online_adapter: an `OnlineSpecAdapter` learning from every verification round, or None.
        policy: the proposal policy's state (adapts across calls with `policy_schedule="persistent"`; `reset()`,
            `frozen`). Its knobs (`decay`, `explore_every`) follow the generation config of each call.
    """

    length_head: object | None = None
    cost_model: object | None = None
    online_adapter: object | None = None
    policy: ProposalPolicy = field(default_factory=ProposalPolicy)

    def __post_init__(self):
        if self.policy is None:
            self.policy = ProposalPolicy()

    def attach(self, drafter) -> "SpeculationRuntime":
        """Make this the runtime of `drafter` (its declared `runtime` attribute). Returns self."""
        if not hasattr(drafter, "runtime"):
            raise TypeError(f"{type(drafter).__name__} has no `runtime` attribute: not an AdaFlash drafter.")
        drafter.runtime = self
        return self

    def detach(self, drafter) -> None:
        if getattr(drafter, "runtime", None) is self:
            drafter.runtime = None

    @classmethod
    def of(cls, drafter) -> "SpeculationRuntime":
        """The drafter's runtime; an empty one is attached first when it has none."""
        runtime = getattr(drafter, "runtime", None)
        if runtime is None:
            runtime = cls().attach(drafter) if hasattr(drafter, "runtime") else cls()
        return runtime

    def policy_for_call(self, generation_config) -> ProposalPolicy:
        """The policy one `generate` call decodes with, per-row estimates cleared (`start_run`).

        The generation config's knobs apply to the runtime's policy at every call (a later change of
        `policy_decay` / `policy_explore_every` takes effect; estimates are kept). `policy_schedule="persistent"`:
        the runtime's policy itself, so what the call learns carries over; `"transient"`: a copy of it, so every call
        starts from the same state.
        """
        schedule = getattr(generation_config, "policy_schedule", "persistent")
        if schedule not in SCHEDULES:
            raise ValueError(f"policy_schedule must be one of {SCHEDULES}, got {schedule!r}")
        if self.policy is None:
            self.policy = ProposalPolicy()
        self.policy.configure(generation_config)
        policy = self.policy.copy() if schedule == "transient" else self.policy
        policy.start_run()
        return policy


def runtime_of(drafter) -> SpeculationRuntime:
    """`SpeculationRuntime.of(drafter)`; a drafter loaded with `trust_remote_code` gets a detached empty one."""
    return SpeculationRuntime.of(drafter)


def generation_config_of(drafter):
    """The drafter's `AdaFlashGenerationConfig` (defaults for a drafter that carries none)."""
    from ..models.drafter.configuration_adaflash_drafter import AdaFlashGenerationConfig

    config = getattr(drafter, "generation_config", None)
    if isinstance(config, AdaFlashGenerationConfig):
        return config
    if config is None:
        return AdaFlashGenerationConfig()
    return AdaFlashGenerationConfig(**{k: v for k, v in config.to_dict().items() if k != "transformers_version"})


@contextlib.contextmanager
def decoding_setup(drafter, generation_config=None, runtime: SpeculationRuntime | None = None):
    """Decode with other knobs and/or runtime components for the duration of a `with` block.

    Swaps the drafter's two declared decoding attributes (`generation_config`, `runtime`) and restores them; the
    architecture config is never touched.
    """
    saved = drafter.generation_config, drafter.runtime
    try:
        if generation_config is not None:
            drafter.generation_config = generation_config
        if runtime is not None:
            drafter.runtime = runtime
        yield drafter
    finally:
        drafter.generation_config, drafter.runtime = saved


__all__ = ["SpeculationRuntime", "decoding_setup", "generation_config_of", "runtime_of"]
