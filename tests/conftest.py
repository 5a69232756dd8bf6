"""Shared fixtures: tiny random Llama targets and drafters built for them."""

import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import adaflash_hf
from adaflash_hf import AdaFlashDrafterModel, AdaFlashGenerationConfig


VOCAB = 96


def make_tiny_target(seed: int = 0, vocab_size: int = VOCAB, hidden_size: int = 64, num_layers: int = 4, eos=None):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Unit-norm LM-head rows: then the hidden state `W[t]` has `t` as its unique argmax (used by OracleDrafter).
    with torch.no_grad():
        w = model.lm_head.weight
        w.copy_(w / w.norm(dim=-1, keepdim=True))
    model.generation_config.do_sample = False
    return model


class OracleDrafter(AdaFlashDrafterModel):
    """A test drafter that knows the target's greedy continuation and drafts it with controlled errors.

    It runs the real drafter forward (so the DFlash cache bookkeeping is exercised), then replaces the block's
    output states by `lm_head.weight[token]` for tokens read from `reference` at the block's positions (taken from
    `position_ids`), corrupting each drafted token with probability `error_rate`. This gives partial acceptance of
    every length on tiny random targets, where a random drafter would accept nothing.
    """

    def setup_oracle(self, target, reference: torch.Tensor, error_rate: float = 0.3, seed: int = 0):
        self._head = target.lm_head.weight.detach()
        self._reference = reference[0]
        self._error_rate = error_rate
        self._rng = torch.Generator().manual_seed(seed)
        return self

    def forward(self, noise_embeds, context_hidden_states=None, attention_mask=None, position_ids=None, cache=None, **kw):
        out = super().forward(noise_embeds, context_hidden_states, attention_mask, position_ids, cache, **kw)
        block = noise_embeds.shape[1]
        anchor_pos = int(position_ids[0, -block])
        states = out.last_hidden_state.clone()
        for k in range(1, block):
            pos = anchor_pos + k
            token = int(self._reference[pos]) if pos < len(self._reference) else 0
            if torch.rand(1, generator=self._rng).item() < self._error_rate:
                token = (token + 1 + int(torch.randint(0, self._head.shape[0] - 1, (1,), generator=self._rng))) % self._head.shape[0]
            states[0, k] = self._head[token] * 10.0
        out.last_hidden_state = states
        return out


def record_tiny_dataset(target, layer_ids, n_sequences: int, max_new_tokens: int = 30, seed: int = 0):
    """Greedy target responses to random 6-token prompts, recorded as a training dataset. The prompts (drawn one by
    one, as before) all have 6 tokens and the tiny targets have no EOS, so one batched `generate` call (no padding)
    decodes them all: the same tokens as one call per prompt, in a fraction of the time."""
    from adaflash_hf.training import record_targets

    assert target.generation_config.eos_token_id is None  # every row runs to max_new_tokens: no padding in the batch
    g = torch.Generator().manual_seed(seed)
    prompts = torch.cat([torch.randint(0, VOCAB, (1, 6), generator=g) for _ in range(n_sequences)])
    with torch.no_grad():
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max_new_tokens,
                              do_sample=False)
    sequences = [{"input_ids": row.tolist(), "prompt_len": 6, "domain": "tiny"} for row in out]
    return record_targets(target, sequences, layer_ids, batch_size=8)


@pytest.fixture
def tiny_target():
    return make_tiny_target()


ALWAYS_DRAFT = {"hybrid_lookup": False, "allow_no_draft": False}  # every round drafts (tests of the drafter path)


def with_knobs(drafter, **knobs):
    """Give `drafter` a generation config with these knobs (the way users set decoding choices)."""
    drafter.generation_config = AdaFlashGenerationConfig(**knobs)
    return drafter


def split_knobs(kwargs: dict) -> tuple[dict, dict]:
    """`(generation knobs, config overrides)` of mixed keyword arguments."""
    names = set(inspect.signature(AdaFlashGenerationConfig.__init__).parameters) | {
        "num_assistant_tokens", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
        "max_matching_ngram_size"}
    return {k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names}


def build_drafter(target, num_layers=1, block_size=4, seed=None, **kwargs):
    """A random drafter for `target`; generation knobs among `kwargs` go to its generation config (default: every
    round drafts), the rest to `from_target`."""
    if seed is not None:
        torch.manual_seed(seed)
    knobs, overrides = split_knobs({**ALWAYS_DRAFT, **kwargs})
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=num_layers, block_size=block_size, **overrides)
    return with_knobs(drafter.eval(), **knobs)


@pytest.fixture
def tiny_drafter(tiny_target):
    return build_drafter(tiny_target, seed=1)


def make_oracle(target, reference, block_size=5, error_rate=0.3, seed=0, **kwargs):
    torch.manual_seed(seed)
    knobs, overrides = split_knobs({**ALWAYS_DRAFT, **kwargs})
    config = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=block_size, **overrides).config
    drafter = with_knobs(OracleDrafter(config).eval(), **knobs)
    return drafter.setup_oracle(target, reference, error_rate=error_rate, seed=seed)


assert adaflash_hf.generation.is_installed()


def speculate(target, prompt, drafter, **kwargs):
    """`target.generate(prompt, assistant_model=drafter, ...)` -> `(sequences, SpeculationStats or None)`."""
    out = target.generate(prompt, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    return out.sequences, getattr(out, "speculation_stats", None)


def device_cost(points: dict, draft: float = 0.0):
    """A hand-made `TargetCostModel` stamped as measured on this CPU (so it is applied, not re-calibrated)."""
    from adaflash_hf.generation.cost_model import TargetCostModel, device_name

    return TargetCostModel(points=points, draft={b: draft for b in points}, device=device_name("cpu"),
                           dtype="float32", threads=torch.get_num_threads())


# ---------------------------------------------------------------------------------- the real testbed model, loaded once


@pytest.fixture(scope="session")
def real_target():
    """`(target, tokenizer)`: the offline testbed model (SmolLM2-135M-Instruct, fp32, eval mode), loaded once for the
    whole session and shared by every real-model test module (loading it was several seconds per module). Tests
    must not modify it; each module loads its own drafter (small, and drafters carry per-module knobs)."""
    from adaflash_hf.testbed import load_testbed

    target, tokenizer = load_testbed(dtype=torch.float32)
    assert not target.training and not target.generation_config.do_sample
    return target, tokenizer


def chat_inputs(tokenizer, prompt: str) -> dict:
    """The chat-template inputs of one user message, as the README builds them."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


def plain_greedy_batch(target, tokenizer, prompts: list[str], max_new_tokens: int) -> dict[str, torch.Tensor]:
    """`{prompt: target.generate(**chat_inputs(tokenizer, prompt), max_new_tokens=..., do_sample=False)}` for every
    prompt, computed in one left-padded batched `generate` call (one forward per token for all prompts, instead of
    one per prompt per token), each output cut back to what the unpadded single-prompt call returns: the prompt's
    own ids, then its new tokens up to and including the first EOS. Each prompt's ids are checked to be exactly the
    unpadded chat-template ids."""
    singles = [chat_inputs(tokenizer, p)["input_ids"][0] for p in prompts]
    width = max(len(ids) for ids in singles)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, ids in enumerate(singles):
        input_ids[i, width - len(ids):] = ids
        attention_mask[i, width - len(ids):] = 1
    with torch.inference_mode():
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=pad)
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    result = {}
    for prompt, ids, row in zip(prompts, singles, out):
        new = row[width:].tolist()
        end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        result[prompt] = torch.cat([ids, row[width:width + end]])[None]
    return result
