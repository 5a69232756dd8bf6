# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the AdaFlash block-diffusion drafter.

This file is copied next to saved checkpoints (``auto_map``) so that a drafter loads with
``AutoModel.from_pretrained(path, trust_remote_code=True)`` where ``adaflash_hf`` is not installed:
it may import only ``transformers`` / ``huggingface_hub``.
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation.configuration_utils import GenerationConfig


LENGTH_POLICIES = ("auto", "full", "head", "confidence", "heuristic")
# config.json keys of older checkpoints -> AdaFlashGenerationConfig fields
LEGACY_GENERATION_KEYS = {
    "hybrid_lookup": "hybrid_lookup",
    "allow_no_draft": "allow_no_draft",
    "lookup_num_tokens": "prompt_lookup_num_tokens",
    "lookup_max_ngram": "max_matching_ngram_size",
}
# config.json fields `AdaFlashDrafterModel.from_pretrained` requires (a `null` counts as written): the weights'
# shapes and meaning depend on them, so a class default standing in for a missing one would load the weights wrongly
# (e.g. `block_size` 16 for a drafter trained with 8). Not required: training-only (`attention_dropout`,
# `initializer_range`) or derived/unused (`layer_types`, `sliding_window`, `tie_word_embeddings`) fields.
REQUIRED_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
    "attention_bias", "mlp_bias", "block_size", "mask_token_id", "target_layer_ids", "num_target_layers",
    "target_model_type", "tokenizer_fingerprint", "draft_vocab_size",
)


@strict
class AdaFlashDrafterConfig(PreTrainedConfig):
    r"""
    Configuration of [`AdaFlashDrafterModel`], a DFlash-style block-diffusion drafter.

    The drafter owns no embedding and no LM head: it embeds its block with the *target's* input embeddings and
    turns its output states into tokens with the *target's* LM head. It reads the target's hidden states at
    `target_layer_ids` (concatenated on the feature axis, then projected by `fc` + `hidden_norm`) and injects them
    as extra keys/values in every layer.

    Args:
        vocab_size (`int`): vocabulary size of the target (the drafter predicts with the target's LM head).
        hidden_size (`int`): hidden size; must equal the target's (the context projection maps
            `len(target_layer_ids) * hidden_size -> hidden_size` and the target's LM head reads the output).
        intermediate_size (`int`): inner size of the gated MLP.
        num_hidden_layers (`int`): number of drafter decoder layers.
        num_attention_heads (`int`), num_key_value_heads (`int`), head_dim (`int`): grouped-query attention shape.
        hidden_act (`str`): activation of the gated MLP.
        rms_norm_eps (`float`): RMSNorm epsilon.
        rope_parameters (`dict`): RoPE parameters (`rope_type`, `rope_theta`, ...), usually the target's.
        max_position_embeddings (`int`): longest position the RoPE tables are meant for.
        attention_bias (`bool`): bias on q/k/v/o projections.
        mlp_bias (`bool`): bias on the MLP projections.
        attention_dropout (`float`): dropout on attention weights during training.
        layer_types (`list[str]`): per-layer attention type; only `"full_attention"` is supported.
        block_size (`int`): tokens per drafted block, anchor included (a round proposes `block_size - 1` tokens).
        mask_token_id (`int`): id of the token whose *target* embedding fills block positions 1..block_size-1.
            The "mask" embedding is therefore the target's embedding row of this id (as in the public DFlash
            drafters); pick a token that never occurs in real text (e.g. an unused special token).
        target_layer_ids (`list[int]`): zero-indexed target decoder layers whose outputs form the context.
        num_target_layers (`int`): depth of the target the drafter was built for (used to validate pairs).
        target_model_type (`str`, *optional*): `model_type` of the target the drafter was built for; when set, a
            target of another `model_type` is refused (`compatibility_errors`). Exported to the z-lab layout.
        tokenizer_fingerprint (`str`, *optional*): hash of the target tokenizer's vocabulary; when set and a
            tokenizer is given to `generate`, a mismatch is refused before any compute.
        draft_vocab_size (`int`, *optional*): if set, the drafter only ever proposes these many tokens (the target's
            most frequent outputs, stored as the `draft_vocab` buffer): drafting then multiplies by a
            `[draft_vocab_size, hidden]` slice of the target's LM head instead of the whole vocabulary. Verification
            still uses the full target, so outputs are unchanged; a rare token is simply never drafted.
        initializer_range (`float`): std of the normal init of linear layers.

    `save_pretrained` writes every field; `AdaFlashDrafterModel.from_pretrained` refuses a `config.json` that lacks
    one of `REQUIRED_CONFIG_FIELDS` (every field above but `attention_dropout`, `initializer_range`, `layer_types`).
    """

    model_type = "adaflash_drafter"
    default_theta = 10_000.0

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 1
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    target_model_type: str | None = None
    tokenizer_fingerprint: str | None = None
    draft_vocab_size: int | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        # Decoding knobs that older checkpoints kept here now live in `AdaFlashGenerationConfig` (the drafter's
        # `generation_config.json`); `AdaFlashDrafterModel.from_pretrained` migrates them. Not architecture: dropped.
        for key in LEGACY_GENERATION_KEYS:
            kwargs.pop(key, None)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            self.target_layer_ids = [0]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation: refuses shapes the drafter cannot run."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one drafted token), got {self.block_size}.")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} hidden layers."
            )
        if any(t != "full_attention" for t in self.layer_types):
            raise ValueError(f"Only 'full_attention' layers are supported, got layer_types={self.layer_types}.")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer.")
        if self.num_target_layers is not None and any(
            not 0 <= i < self.num_target_layers for i in self.target_layer_ids
        ):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must lie in [0, num_target_layers={self.num_target_layers})."
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must lie in (0, vocab_size={self.vocab_size}].")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}).")


class AdaFlashGenerationConfig(GenerationConfig):
    r"""
    How `adaflash_hf` decodes with a drafter: the drafter's `generation_config` (saved as `generation_config.json`
    beside its weights, loadable from the Hub), as transformers' `AssistedCandidateGenerator` reads its knobs from
    `assistant_model.generation_config`. Decoding choices, not architecture: none of this is in `config.json`.

    transformers' own fields keep their meaning:
        num_assistant_tokens (`int`, *optional*): most drafted tokens verified per round (`None`: the whole block,
            `block_size - 1`).
        assistant_confidence_threshold (`float`): the `"confidence"` length policy's threshold.
        prompt_lookup_num_tokens (`int`), max_matching_ngram_size (`int`): the hybrid n-gram lookup proposal's
            length and longest n-gram (transformers' `PromptLookupCandidateGenerator`).
    Ours:
        length_policy (`str`): how many drafted tokens a round verifies. `"auto"`: the length head when one is
            attached (`SpeculationRuntime.length_head`), else the whole block; `"full"`: the whole block (up to
            `num_assistant_tokens`); `"head"`: the length head (required); `"confidence"`: transformers'
            confidence rule on the block (cut after the first token below `assistant_confidence_threshold`);
            `"heuristic"`: transformers' heuristic schedule (+2 after a fully accepted round, -1 otherwise).
        hybrid_lookup (`bool`): also propose the n-gram prompt-lookup continuation; each round (and, in the batched
            engine, each row) verifies the proposal expected to commit more tokens per second.
        allow_no_draft (`bool`): the proposal policy may also run plain rounds (no drafter forward, one token per
            row) when speculation is not paying, so a weak drafter never makes decoding much slower than plain.
            With `hybrid_lookup=False` and `allow_no_draft=False` every round drafts.
        policy_decay (`float`): weight of the newest round in the policy's moving averages.
        policy_explore_every (`int`): an option not chosen for this many rounds is tried again.
        policy_schedule (`str`): `"persistent"` (default): the proposal policy's state (estimates, round counter,
            retry intervals; kept in the drafter's `SpeculationRuntime`) carries over from call to call, adapting to
            the traffic; `"transient"`: every call starts from the same policy state (the call decodes with a copy
            of the runtime's policy, which it leaves untouched), so the same seed gives the same text, like
            transformers' `num_assistant_tokens_schedule="heuristic_transient"`.
        draft_candidates (`int`): the batched engine's most candidate blocks per row and round: the drafter's top
            first tokens, each with the drafted rest, verified together as a token tree in one forward
            (`generation/candidates.py`). How many a round uses, and how deep, is the device's cost model's call:
            only shapes that fit in a verify costing what one block's does (on a launch-bound accelerator, several;
            on a CPU, one). Greedy decoding with sequence-free processors only. Default `1` (one block per row):
            +14% tau replayed at the H200's flat width, but the projected H200 serving bench did not win with it yet
            (docs/fast_where_users_run.md, section 10).
    """

    def __init__(self, length_policy: str = "auto", hybrid_lookup: bool = True, allow_no_draft: bool = True,
                 policy_decay: float = 0.3, policy_explore_every: int = 16, policy_schedule: str = "persistent",
                 draft_candidates: int = 1, **kwargs):
        kwargs.setdefault("prompt_lookup_num_tokens", 10)
        kwargs.setdefault("max_matching_ngram_size", 2)
        kwargs.setdefault("assistant_confidence_threshold", 0.4)
        self.length_policy = length_policy
        self.hybrid_lookup = bool(hybrid_lookup)
        self.allow_no_draft = bool(allow_no_draft)
        self.policy_decay = float(policy_decay)
        self.policy_explore_every = int(policy_explore_every)
        self.policy_schedule = policy_schedule
        self.draft_candidates = int(draft_candidates)
        if policy_schedule not in ("persistent", "transient"):
            raise ValueError(f"policy_schedule must be 'persistent' or 'transient', got {policy_schedule!r}")
        super().__init__(**kwargs)

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None):
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        errors = []
        if self.length_policy not in LENGTH_POLICIES:
            errors.append(f"length_policy must be one of {LENGTH_POLICIES}, got {self.length_policy!r}")
        if self.num_assistant_tokens is not None and self.num_assistant_tokens < 1:
            errors.append(f"num_assistant_tokens must be >= 1 or None, got {self.num_assistant_tokens}")
        if not 0 < self.policy_decay <= 1:
            errors.append(f"policy_decay must be in (0, 1], got {self.policy_decay}")
        if self.policy_explore_every < 1:
            errors.append(f"policy_explore_every must be >= 1, got {self.policy_explore_every}")
        if not (self.prompt_lookup_num_tokens or 0) >= 1 or not (self.max_matching_ngram_size or 0) >= 1:
            errors.append("prompt_lookup_num_tokens and max_matching_ngram_size must be >= 1")
        if self.draft_candidates < 1:
            errors.append(f"draft_candidates must be >= 1, got {self.draft_candidates}")
        if errors:
            raise ValueError("Invalid AdaFlashGenerationConfig: " + "; ".join(errors) + ".")


__all__ = ["REQUIRED_CONFIG_FIELDS", "AdaFlashDrafterConfig", "AdaFlashGenerationConfig"]
