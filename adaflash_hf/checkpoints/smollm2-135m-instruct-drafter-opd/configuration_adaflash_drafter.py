# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the AdaFlash block-diffusion drafter.

This file is copied next to saved checkpoints (``auto_map``) so that a drafter loads with
``AutoModel.from_pretrained(path, trust_remote_code=True)`` where ``adaflash_hf`` is not installed:
it may import only ``transformers`` / ``huggingface_hub``.
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


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
        target_model_type (`str`): `model_type` of the target (informational, used to validate and export).
        tokenizer_fingerprint (`str`, *optional*): hash of the target tokenizer's vocabulary; when set and a
            tokenizer is given to `generate`, a mismatch is refused before any compute.
        draft_vocab_size (`int`, *optional*): if set, the drafter only ever proposes these many tokens (the target's
            most frequent outputs, stored as the `draft_vocab` buffer): drafting then multiplies by a
            `[draft_vocab_size, hidden]` slice of the target's LM head instead of the whole vocabulary. Verification
            still uses the full target, so outputs are unchanged; a rare token is simply never drafted.
        hybrid_lookup (`bool`): also consult n-gram prompt lookup every round and verify whichever proposal is
            expected to commit more tokens per second (`generation/policy.py`); `False` always drafts.
        allow_no_draft (`bool`): let that policy also choose to verify no draft at all (plain decoding) when
            drafting does not pay, so a weak drafter never makes generation slower than plain `generate`.
            With `hybrid_lookup=False` and `allow_no_draft=False` every round drafts.
        lookup_num_tokens (`int`), lookup_max_ngram (`int`): prompt-lookup proposal length and longest n-gram.
        initializer_range (`float`): std of the normal init of linear layers.
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
    hybrid_lookup: bool = True
    allow_no_draft: bool = True
    lookup_num_tokens: int = 10
    lookup_max_ngram: int = 2
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
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


__all__ = ["AdaFlashDrafterConfig"]
