"""Lossless speculative decoding on the real testbed model (SmolLM2-135M-Instruct, fp32)."""

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.checkpoints import default_drafter_dir

from .conftest import chat_inputs, plain_greedy_batch


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def testbed(real_target):
    from adaflash_hf.testbed import default_eval_prompts

    target, tokenizer = real_target  # loaded once per session (conftest)
    path = default_drafter_dir()
    if path is not None:
        drafter = AdaFlashDrafterModel.from_pretrained(path, dtype=torch.float32).eval()
    else:  # before a trained drafter is shipped, an untrained one still has to be lossless
        drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=8, tokenizer=tokenizer).eval()
    by_domain = {}
    for record in default_eval_prompts():
        by_domain.setdefault(record["domain"], []).append(record)
    prompts = [r for records in by_domain.values() for r in records[:2]]  # 2 per domain
    return target, tokenizer, drafter, prompts


_inputs = chat_inputs

SPEC_TOKENS = 32  # new tokens per speculative call: over a dozen verification rounds a prompt, rejections included
PLAIN_TOKENS = SPEC_TOKENS


@pytest.fixture(scope="module")
def plain(testbed):
    """`plain(prompt, n)`: plain greedy `generate` output with `n <= PLAIN_TOKENS` new tokens. Every prompt is decoded
    once, to PLAIN_TOKENS tokens (greedy: the output for fewer tokens is its prefix, or all of it if EOS came first), in one left-padded
    batch (`plain_greedy_batch`: cut back to exactly what the single-prompt call returns), shared by every test here
    (plain decoding was half of this module's time, one prompt at a time)."""
    target, tokenizer, _, prompts = testbed
    assert not target.generation_config.do_sample  # plain `generate(**inputs)` as the README writes it is greedy
    cache = plain_greedy_batch(target, tokenizer, [r["prompt"] for r in prompts], PLAIN_TOKENS)

    def get(prompt: str, n: int) -> torch.Tensor:
        assert n <= PLAIN_TOKENS
        prompt_len = _inputs(tokenizer, prompt)["input_ids"].shape[1]
        return cache[prompt][:, :prompt_len + n]

    return get


@pytest.mark.parametrize("path", [None, "dflash"])
def test_greedy_speculative_equals_plain_on_eval_prompts(testbed, plain, path):
    target, tokenizer, drafter, prompts = testbed
    accepted, drafted, rounds = 0, 0, []
    with torch.inference_mode():
        # ours on every prompt; transformers' native path (its own generator, our weights) on one per domain
        for record in prompts if path is None else prompts[::2]:
            inputs = _inputs(tokenizer, record["prompt"])
            reference = plain(record["prompt"], SPEC_TOKENS)
            out = target.generate(**inputs, max_new_tokens=SPEC_TOKENS, do_sample=False, assistant_model=drafter,
                                  speculation_type=path, tokenizer=tokenizer, return_dict_in_generate=True)
            assert torch.equal(out.sequences, reference), f"[{record['domain']}] {record['prompt'][:80]!r}"
            if path is None:
                stats = out.speculation_stats
                accepted, drafted = accepted + sum(stats.accepted), drafted + sum(stats.drafted)
                rounds.append(stats.rounds)
    if path is None:
        # every prompt took several verification rounds, and drafts were rejected along the way: the exactness
        # above covers rejections and corrections, not only fully accepted blocks
        assert min(rounds) >= 6 and drafted > accepted, (rounds, drafted, accepted)
        if default_drafter_dir() is not None:
            assert accepted > 0  # the shipped drafter is trained: its drafts are accepted on real prompts


def test_sampling_runs_on_the_real_model(testbed):
    target, tokenizer, drafter, prompts = testbed
    inputs = _inputs(tokenizer, prompts[0]["prompt"])
    torch.manual_seed(0)
    with torch.inference_mode():
        out = target.generate(**inputs, max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.95,
                              assistant_model=drafter, return_dict_in_generate=True)
    n_new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    assert 0 < n_new <= 24
    assert out.speculation_stats.rounds > 0


def test_wrong_tokenizer_is_refused_before_compute(testbed):
    target, tokenizer, drafter, prompts = testbed
    if drafter.config.tokenizer_fingerprint is None:
        pytest.skip("drafter carries no tokenizer fingerprint")

    class OtherTokenizer:
        mask_token_id = None

        def get_vocab(self):
            return {**tokenizer.get_vocab(), "<extra>": 10**6}

    inputs = _inputs(tokenizer, prompts[0]["prompt"])
    with pytest.raises(ValueError, match="tokenizer"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, tokenizer=OtherTokenizer())


# ------------------------------------------------------------------------------------- the README's recipes as written


README_RECIPE = """
import adaflash_hf  # registers the drafter with the Auto classes and teaches generate() to use it
from adaflash_hf import AdaFlashDrafterModel

drafter = AdaFlashDrafterModel.from_pretrained(DRAFTER)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=32)   # same text, fewer target forwards
"""


def test_readme_recipe_with_the_shipped_drafter_as_written(testbed, plain):
    """The README's first code block, verbatim: the shipped drafter is stored in bf16, the target is fp32."""
    target, tokenizer, _, prompts = testbed
    path = default_drafter_dir()
    if path is None:
        pytest.skip("no shipped drafter")
    for record in prompts[::4]:  # two prompts (two domains); every prompt is checked greedy above
        inputs = _inputs(tokenizer, record["prompt"])
        scope = {"target": target, "inputs": inputs, "DRAFTER": path}
        exec(README_RECIPE, scope)
        drafter = scope["drafter"]
        assert drafter.dtype == torch.bfloat16 and target.dtype == torch.float32
        reference = plain(record["prompt"], 32)  # = target.generate(**inputs, max_new_tokens=32)
        assert torch.equal(scope["out"], reference), record["prompt"][:80]
        native = target.generate(**inputs, assistant_model=drafter, max_new_tokens=32, speculation_type="dflash")
        assert torch.equal(native, reference), record["prompt"][:80]


REMOTE_REAL = """
import json, sys, torch
sys.modules["adaflash_hf"] = None  # adaflash_hf not installed: transformers only
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
target = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
inputs = tokenizer.apply_chat_template([{"role": "user", "content": sys.argv[3]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
plain = target.generate(**inputs, max_new_tokens=32, do_sample=False)
spec = target.generate(**inputs, max_new_tokens=32, do_sample=False, assistant_model=drafter,
                       speculation_type="dflash")
assert drafter.dtype == torch.bfloat16 and torch.equal(plain, spec)
# the shared reference of this module (one left-padded batch) is this process's single-prompt plain output
assert plain[0].tolist() == json.loads(sys.argv[4]), (plain[0].tolist(), sys.argv[4])
print("REMOTE_REAL_OK")
"""


def test_readme_recipe_without_the_package_installed(testbed, plain, tmp_path):
    """`AutoModel.from_pretrained(folder, trust_remote_code=True)` + `speculation_type="dflash"`, in a process
    where `import adaflash_hf` fails, on the shipped folder as it is installed. Its plain output also checks this
    module's batched references against a single-prompt `generate` in a fresh process."""
    import json
    import subprocess
    import sys

    from adaflash_hf.testbed import ensure_converted

    path = default_drafter_dir()
    if path is None:
        pytest.skip("no shipped drafter")
    _, _, _, prompts = testbed
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_REAL)
    expected = json.dumps(plain(prompts[0]["prompt"], 32)[0].tolist())
    result = subprocess.run([sys.executable, str(script), str(path), str(ensure_converted()), prompts[0]["prompt"],
                             expected],
                            capture_output=True, text=True, timeout=600,
                            env={"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
                                 "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                 "OMP_NUM_THREADS": "1"})  # torch's default (all cores) thrashes a shared CPU
    assert result.returncode == 0 and "REMOTE_REAL_OK" in result.stdout, result.stderr[-3000:]


def test_candidate_trees_on_the_h200_costs_equal_plain(testbed, plain):
    """The batched engine deciding with the H200 reference's costs verifies several candidate blocks per row (the
    verify forward is flat in width there); every row still equals plain greedy `generate`."""
    from adaflash_hf.generation import SpeculationRuntime
    from adaflash_hf.generation.batch import generate_batch, run_knobs
    from adaflash_hf.generation.cost_model import shipped_cost_model

    target, tokenizer, drafter, prompts = testbed
    ids = [_inputs(tokenizer, r["prompt"])["input_ids"][0].tolist() for r in prompts]
    runtime = SpeculationRuntime(cost_model=shipped_cost_model("h200-smollm2-135m"))
    knobs = run_knobs(drafter, draft_candidates=8)
    with torch.inference_mode():
        out, stats = generate_batch(target, drafter, ids, SPEC_TOKENS, generation_config=knobs, runtime=runtime,
                                    return_stats=True)
    for r, record in enumerate(prompts):
        reference = plain(record["prompt"], SPEC_TOKENS)[0, len(ids[r]):].tolist()
        assert out[r] == reference, f"[{record['domain']}] {record['prompt'][:80]!r}"
    assert stats.candidates and max(stats.candidates) > 1 and max(stats.verify_widths) <= 16
