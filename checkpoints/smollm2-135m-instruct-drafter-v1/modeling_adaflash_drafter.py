# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""AdaFlash block-diffusion drafter (DFlash architecture) as a transformers `PreTrainedModel`.

One forward drafts a whole block: the queries are the block `[anchor, mask, ..., mask]` (embedded with the
*target's* embeddings), the keys/values are the projected target context followed by the block itself, and the
block attends bidirectionally to itself and to all the context. Weight names follow the public DFlash drafters
(`layers.N.self_attn.{q,k,v,o}_proj`, `layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.{gate,up,down}_proj`,
`layers.N.{input,post_attention}_layernorm`, `fc`, `hidden_norm`, `norm`), so checkpoints convert by config.

The forward contract is the one transformers' `DFlashTokenCandidateGenerator` calls (`noise_embeds`,
`context_hidden_states`, `attention_mask`, `position_ids`, `cache`), so `generate(..., speculation_type="dflash")`
runs this model unchanged.

This file is copied next to saved checkpoints (`auto_map`): it imports only torch, transformers, its config and
`checkpoint_checks.py` (the loading checks), copied with it.
"""

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import Cache, DFlashCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .checkpoint_checks import (
    CheckpointError,
    check_tensors,
    loaded_weight_problems,
    local_folder,
    pickle_message,
    read_pretrained_folder,
    refuse_explicit_pickle_file,
    safetensors_only_error,
    weights_file,
)
from .configuration_adaflash_drafter import (
    LEGACY_GENERATION_KEYS,
    REQUIRED_CONFIG_FIELDS,
    AdaFlashDrafterConfig,
    AdaFlashGenerationConfig,
)


def apply_rotary_pos_emb(q, k, cos, sin):
    """RoPE where keys are `[context, block]` and queries only the block: queries take the LAST `q_len` angles.

    q: `[batch, heads, q_len, head_dim]`; k: `[batch, kv_heads, kv_len, head_dim]`;
    cos/sin: `[batch, kv_len, head_dim]` (computed from the full `position_ids`).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = q.shape[-2]
    q_embed = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed, k_embed


class AdaFlashDrafterAttention(nn.Module):
    """GQA attention with QK-norm whose keys/values are the projected target context followed by the block."""

    def __init__(self, config: AdaFlashDrafterConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        h, nq, nkv, bias = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(h, nq * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, nkv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, nkv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(nq * self.head_dim, h, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states: `[batch, q_len, hidden]`; context_states: `[batch, ctx_len, hidden]` or None."""
        bsz, q_len, _ = hidden_states.shape
        kv_states = hidden_states if context_states is None else torch.cat([context_states, hidden_states], dim=1)
        kv_len = kv_states.shape[1]

        query = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_states).view(bsz, kv_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_states).view(bsz, kv_len, -1, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(attn_output.reshape(bsz, q_len, -1).contiguous())


class AdaFlashDrafterDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer. The context is normed once by the model's `hidden_norm`, not per layer (as DFlash)."""

    def __init__(self, config: AdaFlashDrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = AdaFlashDrafterAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context_states, position_embeddings, attention_mask, cache, **kwargs
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class AdaFlashDrafterPreTrainedModel(PreTrainedModel):
    config: AdaFlashDrafterConfig
    config_class = AdaFlashDrafterConfig
    base_model_prefix = ""
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AdaFlashDrafterDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True


def tokenizer_fingerprint(tokenizer) -> str:
    """A short, stable hash of a tokenizer's vocabulary (token -> id), used to refuse mismatched pairs."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def spread_layer_ids(num_target_layers: int, num_context_layers: int = 5) -> list[int]:
    """Target layers spread from layer 1 to `num_target_layers - 3`, the public DFlash recipe's choice."""
    n = max(1, min(num_context_layers, num_target_layers))
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    if n == 1:
        return [end]
    return sorted({round(start + i * (end - start) / (n - 1)) for i in range(n)})


_MASK_TOKEN_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]", "<empty_output>", "<|fim_pad|>")


class AdaFlashDrafterModel(AdaFlashDrafterPreTrainedModel):
    """A block-diffusion drafter: `noise_embeds` + target context -> block hidden states (no LM head of its own).

    Use the target's LM head on `last_hidden_state[:, 1:]` to get the logits of the `block_size - 1` drafted tokens.
    """

    def __init__(self, config: AdaFlashDrafterConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(
            [AdaFlashDrafterDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        # Ids of the tokens the drafter may propose (see `AdaFlashDrafterConfig.draft_vocab_size`); None: all.
        vocab = torch.arange(config.draft_vocab_size) if config.draft_vocab_size is not None else None
        self.register_buffer("draft_vocab", vocab, persistent=True)
        self.gradient_checkpointing = False
        self._head_slice = None
        # Decoding knobs (`generation_config.json` beside the weights), as transformers' assistant models carry them.
        self.generation_config = AdaFlashGenerationConfig()
        # What adaflash_hf decodes with besides the weights: length head, cost model, online adapter and the
        # proposal policy's state (`adaflash_hf.generation.SpeculationRuntime`, attached with `runtime.attach`).
        # Never saved with the drafter; None until something is attached.
        self.runtime = None
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def _supports_logits_to_keep(self) -> bool:
        # transformers asks this of an ordinary assistant model before drafting with it; answering lets it reach
        # `generate` below, which refuses with a clear message (instead of an AttributeError on this method).
        return False

    def generate(self, *args, **kwargs):
        """Refused: a block drafter drafts from the target's hidden states and cannot decode on its own.

        transformers calls this when the drafter is passed as a plain assistant model (`generate(assistant_model=
        drafter)` without `speculation_type`, and without `import adaflash_hf`). It is reached before any forward.
        """
        raise TypeError(
            f"{type(self).__name__} is a block (DFlash) drafter: it drafts from the target's hidden states and cannot "
            "generate on its own. Use `target.generate(..., assistant_model=drafter, speculation_type='dflash')` "
            "(transformers' DFlash path), or `import adaflash_hf` first and pass `assistant_model=drafter`."
        )

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, plus the drafter's `generation_config.json` (its decoding knobs)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(save_directory)
        return result

    def load_generation_config(self, pretrained_model_name_or_path, subfolder: str = "") -> "AdaFlashGenerationConfig":
        """Set `self.generation_config` from a checkpoint: its `generation_config.json`, else the decoding keys that
        older checkpoints kept in `config.json` (migrated), else the defaults. Returns it."""
        folder = Path(pretrained_model_name_or_path) / subfolder
        if not folder.is_dir():  # a Hub repository
            try:
                self.generation_config = AdaFlashGenerationConfig.from_pretrained(
                    pretrained_model_name_or_path, subfolder=subfolder)
            except OSError:
                self.generation_config = AdaFlashGenerationConfig()
        elif (folder / "generation_config.json").is_file():
            self.generation_config = AdaFlashGenerationConfig.from_pretrained(folder)
        else:
            raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
            legacy = {new: raw[old] for old, new in LEGACY_GENERATION_KEYS.items() if old in raw}
            self.generation_config = AdaFlashGenerationConfig(**legacy)
        return self.generation_config

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict drafting to `token_ids` (`[K]`, e.g. the target's K most frequent output tokens)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() == 0 or int(token_ids.max()) >= self.config.vocab_size or int(token_ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must be non-empty and lie in [0, {self.config.vocab_size}).")
        self.config.draft_vocab_size = int(token_ids.numel())
        self.draft_vocab = token_ids.to(self.fc.weight.device)
        self._head_slice = None

    def draft_logits(self, block_states: torch.Tensor, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of drafted positions with the target's LM head.

        Args:
            block_states: `[..., hidden]` drafter output states of the positions to draft.
            lm_head: the target's output embedding (a bias-free `nn.Linear`).
        Returns:
            `(logits [..., K], vocab_ids [K] or None)`: with a draft vocabulary, logits over its K tokens and their
            ids; otherwise full-vocabulary logits and None.
        """
        weight = lm_head.weight
        states = block_states.to(weight.dtype)
        if self.draft_vocab is None:
            return lm_head(states), None
        cached = self._head_slice
        if cached is None or cached[0] is not weight or cached[1] != weight._version:
            # The slice of the target's LM head is cached; it is rebuilt if the head is replaced or updated.
            rows = weight[self.draft_vocab.to(weight.device)].detach().contiguous()
            self._head_slice = cached = (weight, weight._version, rows)
        return torch.nn.functional.linear(states, cached[2]), self.draft_vocab

    def project_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """`[batch, ctx_len, len(target_layer_ids) * hidden]` -> `[batch, ctx_len, hidden]` (fc + hidden_norm)."""
        expected = len(self.config.target_layer_ids) * self.config.hidden_size
        if context_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"context_hidden_states has feature size {context_hidden_states.shape[-1]}, expected {expected} "
                f"(= {len(self.config.target_layer_ids)} target layers x hidden {self.config.hidden_size})."
            )
        return self.hidden_norm(self.fc(context_hidden_states))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Args:
            noise_embeds (`torch.Tensor` of shape `[batch, q_len, hidden]`):
                Target embeddings of the block(s): the anchor (last committed token) then `block_size - 1` masks.
                For training, several blocks may be concatenated (`q_len = n_blocks * block_size`) with a 4D mask.
            context_hidden_states (`torch.Tensor` of shape `[batch, ctx_len, len(target_layer_ids) * hidden]`):
                Target hidden states at `target_layer_ids` (concatenated on the last axis) of the tokens not yet
                seen by the drafter's `cache` (the new accepted tokens). Projected by `fc` + `hidden_norm`.
            attention_mask (`torch.Tensor`, *optional*):
                2D padding mask `[batch, past + ctx_len + q_len]`, or a prepared 4D mask `[batch, 1, q_len, kv_len]`
                (e.g. the block-sparse training mask), or a dict `{"full_attention": mask}`.
            position_ids (`torch.LongTensor` of shape `[batch, ctx_len + q_len]`, *optional*):
                Positions of the context tokens followed by those of the block(s).
            cache (`DFlashCache`, *optional*):
                Holds the projected context keys/values of earlier rounds. The caller crops the block's entries
                after each round (transformers' DFlash generator does).
        Returns:
            `BaseModelOutputWithPast` whose `last_hidden_state` is `[batch, q_len, hidden]` (after the final norm).
        """
        if use_cache and cache is None:
            cache = DFlashCache(config=self.config)
        # The drafter computes in its own dtype, whatever the target's is (e.g. a bf16 drafter beside an fp32 target,
        # also on transformers' native DFlash path, which hands over the target's embeddings and hidden states as
        # they are); its output comes back in the dtype of the `noise_embeds` it was given, for the target's LM head.
        out_dtype = noise_embeds.dtype
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        noise_embeds = noise_embeds.to(device=device, dtype=dtype)
        context = None
        if context_hidden_states is not None and context_hidden_states.shape[1] > 0:
            context = self.project_context(context_hidden_states.to(device=device, dtype=dtype))
        ctx_len = 0 if context is None else context.shape[1]
        q_len = noise_embeds.shape[1]

        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + ctx_len + q_len, device=noise_embeds.device)[None]
        if position_ids.shape[-1] != ctx_len + q_len:
            raise ValueError(
                f"position_ids must cover the context and the block ({ctx_len} + {q_len}), got {position_ids.shape[-1]}."
            )

        position_ids = position_ids.to(device)
        mask = attention_mask.to(device) if isinstance(attention_mask, torch.Tensor) else attention_mask
        if isinstance(mask, dict):
            mask = mask["full_attention"]
        elif mask is None or mask.dim() == 2:
            if cache is not None:
                if isinstance(cache, DFlashCache):
                    cache.set_previous_accepted_tokens(ctx_len)
                mask = create_bidirectional_mask(
                    config=self.config, inputs_embeds=noise_embeds, attention_mask=mask, cache=cache
                )
            elif mask is not None:
                # No cache: keys are exactly [context, block]; tell the mask builder the kv length.
                kv_shape = noise_embeds.new_empty(noise_embeds.shape[0], ctx_len + q_len, 1)
                mask = create_bidirectional_mask(
                    config=self.config, inputs_embeds=noise_embeds, attention_mask=mask, encoder_hidden_states=kv_shape
                )

        hidden_states = noise_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, position_embeddings, mask, cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states).to(out_dtype), cache=cache)

    # ------------------------------------------------------------------ building and checking pairs

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        num_context_layers: int = 5,
        mask_token_id: int | None = None,
        tokenizer=None,
        init_from_target: bool = True,
        **config_overrides,
    ) -> "AdaFlashDrafterModel":
        """Build a drafter whose shapes match `target` (hidden size, heads, RoPE, vocab, dtype, device).

        Args:
            target: a decoder-only causal LM (Llama/Qwen/Mistral-style config).
            num_layers: drafter depth.
            block_size: tokens per block, anchor included.
            target_layer_ids: context layers; default `num_context_layers` layers spread over the target's depth.
            mask_token_id: token whose target embedding fills the mask positions; by default an unused special
                token of `tokenizer` (e.g. `<|mask|>`, `<empty_output>`), else the target's pad id, else the last id.
            tokenizer: the target's tokenizer (recorded as a fingerprint so mismatches are refused later).
            init_from_target: copy the last `num_layers` target decoder layers and the final norm into the drafter
                (where names and shapes match) and make `fc` average the context layers: a much better start than
                random for training.
        """
        tc = target.config.get_text_config()
        num_target_layers = tc.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = spread_layer_ids(num_target_layers, num_context_layers)
        if mask_token_id is None:
            mask_token_id = _default_mask_token_id(tc, tokenizer)
        rope = dict(tc.rope_parameters) if getattr(tc, "rope_parameters", None) else None
        config = AdaFlashDrafterConfig(
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters=rope,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            target_model_type=tc.model_type,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
            pad_token_id=getattr(tc, "pad_token_id", None),
            **config_overrides,
        )
        config._attn_implementation = getattr(target.config, "_attn_implementation", None) or "sdpa"
        model = cls(config).to(device=target.device, dtype=target.dtype)
        if init_from_target:
            model._init_from_target(target)
        return model

    @torch.no_grad()
    def _init_from_target(self, target: PreTrainedModel) -> None:
        decoder = target.get_decoder()
        target_layers = decoder.layers[-len(self.layers) :]
        for ours, theirs in zip(self.layers, target_layers):
            src = theirs.state_dict()
            for name, param in ours.state_dict().items():
                if name in src and src[name].shape == param.shape:
                    param.copy_(src[name])
        final_norm = getattr(decoder, "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(final_norm.weight)
        k, h = len(self.config.target_layer_ids), self.config.hidden_size
        self.fc.weight.copy_(torch.eye(h, dtype=self.fc.weight.dtype).repeat(1, k) / k)

    def compatibility_errors(self, target: PreTrainedModel, tokenizer=None) -> list[str]:
        """Every reason this drafter cannot draft for `target` (empty when the pair is usable)."""
        cfg, tc = self.config, target.config.get_text_config()
        errors = []
        if tc.hidden_size != cfg.hidden_size:
            errors.append(f"hidden size: target {tc.hidden_size} vs drafter {cfg.hidden_size}")
        target_vocab = target.get_input_embeddings().weight.shape[0]
        if cfg.vocab_size not in (tc.vocab_size, target_vocab):
            errors.append(f"vocabulary size: target {tc.vocab_size} vs drafter {cfg.vocab_size}")
        n_layers = tc.num_hidden_layers
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < n_layers]
        if bad:
            errors.append(f"target_layer_ids {bad} out of range for a target with {n_layers} layers")
        if cfg.num_target_layers is not None and cfg.num_target_layers != n_layers:
            errors.append(f"drafter was built for a {cfg.num_target_layers}-layer target, this one has {n_layers}")
        if cfg.target_model_type is not None and cfg.target_model_type not in (tc.model_type, target.config.model_type):
            errors.append(f"drafter was built for a {cfg.target_model_type!r} target (config.target_model_type), "
                          f"this one is {tc.model_type!r}")
        if not 0 <= cfg.mask_token_id < target_vocab:
            errors.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary [0, {target_vocab})")
        if target.get_output_embeddings() is None:
            errors.append("the target has no output embeddings (LM head) for the drafter to use")
        if tokenizer is not None and cfg.tokenizer_fingerprint is not None:
            fp = tokenizer_fingerprint(tokenizer)
            if fp != cfg.tokenizer_fingerprint:
                errors.append(f"tokenizer fingerprint {fp} differs from the drafter's {cfg.tokenizer_fingerprint}")
        return errors

    def check_compatible(self, target: PreTrainedModel, tokenizer=None) -> None:
        """Raise one `ValueError` listing every mismatch between this drafter and `target` (no compute)."""
        errors = self.compatibility_errors(target, tokenizer)
        if errors:
            raise ValueError(
                f"{type(self).__name__} does not match target {type(target).__name__}: " + "; ".join(errors) + "."
            )

    @classmethod
    def check_pretrained(cls, folder, config=None) -> AdaFlashDrafterConfig:
        """Check a local checkpoint folder without loading a weight; returns its config.

        `config.json` must exist, have `model_type` "adaflash_drafter" and every field of `REQUIRED_CONFIG_FIELDS`;
        the weights must be safetensors, not truncated or corrupt, and hold exactly the tensors `config` (given, or
        read from `config.json`) implies, `draft_vocab` exactly when `config.draft_vocab_size` is set. Else one
        `CheckpointError` (a `ValueError`; for pickle weights also an `OSError`) names the file and the field or
        tensor. `from_pretrained`, the CLI and `python -m adaflash_hf.interop inspect` all run this check.
        """
        config, found, expected = read_pretrained_folder(cls, folder, REQUIRED_CONFIG_FIELDS, config)
        k, vocab, problems = config.draft_vocab_size, found.pop("draft_vocab", None), []
        expected.pop("draft_vocab", None)
        files = ", ".join(sorted({str(info.file) for info in found.values()}))
        if vocab is not None and k is None:
            problems.append(f"{vocab.file}: tensor 'draft_vocab' is stored but config.draft_vocab_size is None")
        elif vocab is None and k is not None:
            problems.append(f"{files}: config.draft_vocab_size is {k} but the checkpoint holds no 'draft_vocab' "
                            f"tensor of {k} ids")
        elif vocab is not None and tuple(vocab.shape) != (k,):
            problems.append(f"{vocab.file}: tensor 'draft_vocab' has shape {list(vocab.shape)}, "
                            f"config.draft_vocab_size is {k}")
        check_tensors(found, expected, os.path.join(str(folder), "config.json"), problems)
        return config

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, safetensors only, refusing any checkpoint it would load half.

        A local folder is checked before anything is loaded (`check_pretrained`: required `config.json` fields,
        truncated or corrupt files, missing, unexpected or mis-shaped tensors). Pickle weights (`pytorch_model.bin`,
        ...) are refused: unpickling can run arbitrary code (`use_safetensors` is forced to True;
        `use_safetensors=False` is an error). After loading, the weights must satisfy what the drafter relies on,
        else a `ValueError` names the file and tensor: every tensor loaded, `draft_vocab` holding
        `config.draft_vocab_size` unique ids in `[0, vocab_size)`, every floating-point weight finite.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError(pickle_message(["use_safetensors=False"]))
        kwargs["use_safetensors"] = True
        subfolder = kwargs.get("subfolder") or ""
        refuse_explicit_pickle_file(pretrained_model_name_or_path, subfolder, kwargs.get("config"))
        folder = local_folder(pretrained_model_name_or_path, subfolder)
        if folder is not None:
            cls.check_pretrained(folder, kwargs.get("config"))
        wants_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except OSError as error:
            clearer = safetensors_only_error(pretrained_model_name_or_path, subfolder, error)
            if clearer is error:
                raise
            raise clearer from error
        _check_loaded_weights(model, info, pretrained_model_name_or_path, subfolder)
        model.load_generation_config(pretrained_model_name_or_path, subfolder)
        return (model, info) if wants_info else model


def _default_mask_token_id(text_config, tokenizer) -> int:
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        for token in _MASK_TOKEN_CANDIDATES:
            if token in vocab:
                return vocab[token]
        if tokenizer.mask_token_id is not None:
            return tokenizer.mask_token_id
    pad, eos = getattr(text_config, "pad_token_id", None), getattr(text_config, "eos_token_id", None)
    if pad is not None and pad != eos and not (isinstance(eos, list) and pad in eos):
        return pad
    return text_config.vocab_size - 1


def _loading_info_has(keys, name: str) -> bool:
    return any(k == name or (isinstance(k, (tuple, list)) and k and k[0] == name) for k in keys or ())


def _check_loaded_weights(model, info: dict, path, subfolder: str) -> None:
    """Raise one `ValueError` listing every tensor of a loaded drafter that breaks what the drafter relies on."""
    config, problems = model.config, []
    where = lambda name: weights_file(path, subfolder, name)  # noqa: E731
    k, vocab = config.draft_vocab_size, getattr(model, "draft_vocab", None)
    if _loading_info_has(info.get("unexpected_keys"), "draft_vocab"):
        problems.append(f"{where('draft_vocab')}: tensor 'draft_vocab' is stored but config.draft_vocab_size is None")
    elif _loading_info_has(info.get("missing_keys"), "draft_vocab") or _loading_info_has(
        info.get("mismatched_keys"), "draft_vocab"
    ):
        problems.append(f"{where('draft_vocab')}: config.draft_vocab_size is {k} but the checkpoint holds no "
                        f"'draft_vocab' tensor of {k} ids")
    elif vocab is not None and vocab.device.type != "meta":
        ids = vocab.detach().flatten().long().cpu()
        bad = ids[(ids < 0) | (ids >= config.vocab_size)]
        if ids.numel() != k:
            problems.append(f"{where('draft_vocab')}: tensor 'draft_vocab' has {ids.numel()} ids, "
                            f"config.draft_vocab_size is {k}")
        if bad.numel():
            problems.append(f"{where('draft_vocab')}: tensor 'draft_vocab' has {bad.numel()} ids outside "
                            f"[0, {config.vocab_size}) (e.g. {bad[:5].tolist()})")
        unique, counts = ids.unique(return_counts=True)
        if (counts > 1).any():
            repeated = unique[counts > 1][:5].tolist()
            problems.append(f"{where('draft_vocab')}: tensor 'draft_vocab' repeats ids {repeated}")
    problems += loaded_weight_problems(model, info, where, skip={"draft_vocab"})
    if problems:
        raise CheckpointError(f"corrupt {type(model).__name__} checkpoint: " + "; ".join(problems) + ".")


__all__ = ["AdaFlashDrafterModel", "AdaFlashDrafterPreTrainedModel"]
