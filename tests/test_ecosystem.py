"""Fitting the ecosystem: pinned transformers internals (checked at import), pip extras (a core install decodes; a
missing extra is one line naming it), and a clear error where transformers' assisted generation serves one
sequence per call."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaflash_hf import compat
from adaflash_hf.utils.extras import EXTRAS, MissingExtraError, missing_extra_message, require

from .conftest import VOCAB, build_drafter


REPO_ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = sorted(EXTRAS)  # peft, trl, datasets, accelerate, gguf, matplotlib


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), **extra}


def _pyproject() -> str:
    return (REPO_ROOT / "pyproject.toml").read_text()


# ------------------------------------------------------------------------------------------- pinned versions


def test_pyproject_pins_the_tested_transformers_and_trl():
    text = _pyproject()
    assert f'"transformers{compat.SUPPORTED_TRANSFORMERS}"' in text
    assert re.search(r'"trl>=[\d.]+,<[\d.]+"', text), "trl (OPD imports trl.kernels) must be pinned"
    import transformers
    from packaging.specifiers import SpecifierSet

    assert transformers.__version__ in SpecifierSet(compat.SUPPORTED_TRANSFORMERS)  # we test what we declare


def test_the_installed_transformers_has_every_internal_we_wrap():
    assert compat.incompatibilities() == []


def test_a_changed_private_signature_is_refused_in_one_line(monkeypatch):
    """Simulate a transformers release whose `_assisted_decoding` (wrapped by the hook) takes other parameters."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    from adaflash_hf.generation import dispatch

    def changed(self, input_ids, logits_processor, stopping_criteria, generation_config, new_argument, **kw):
        pass

    monkeypatch.setitem(dispatch._ORIGINALS, "_assisted_decoding", changed)  # what install() found there
    monkeypatch.delattr(DFlashTokenCandidateGenerator, "_get_noise_embeds")
    problems = compat.incompatibilities()
    assert len(problems) == 2 and "_assisted_decoding" in problems[0] and "_get_noise_embeds is missing" in problems[1]
    with pytest.raises(ImportError) as info:
        compat.check_transformers()
    message = str(info.value)
    assert "\n" not in message and f"transformers{compat.SUPPORTED_TRANSFORMERS}" in message
    assert "pip install" in message


def test_import_refuses_a_changed_transformers_and_leaves_plain_generate_untouched():
    """A real `import adaflash_hf` in a fresh process where `GenerationMixin._get_candidate_generator` changed."""
    script = (
        "import traceback\n"
        "from transformers.generation.utils import GenerationMixin\n"
        "originals = {n: getattr(GenerationMixin, n) for n in "
        "('_validate_generation_mode', '_get_candidate_generator', '_assisted_decoding')}\n"
        "def _get_candidate_generator(self, generation_config, input_ids, renamed, **kwargs): pass\n"
        "GenerationMixin._get_candidate_generator = _get_candidate_generator\n"
        "originals['_get_candidate_generator'] = _get_candidate_generator\n"
        "try:\n"
        "    import adaflash_hf\n"
        "except ImportError as exc:\n"
        "    print('REFUSED', type(exc).__name__, str(exc))\n"
        "assert all(getattr(GenerationMixin, n) is f for n, f in originals.items()), 'something was wrapped'\n"
        "print('UNTOUCHED')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env(),
                         cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1 and "UnsupportedTransformersError" in refused[0], run.stdout
    assert f"transformers{compat.SUPPORTED_TRANSFORMERS}" in refused[0] and "_get_candidate_generator" in refused[0]
    assert "UNTOUCHED" in run.stdout


# ------------------------------------------------------------------------------------------------ extras


def test_core_dependencies_are_small_and_extras_cover_the_optional_modules():
    text = _pyproject()
    core = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    names = {re.match(r'\s*"([A-Za-z0-9_-]+)', line).group(1).lower() for line in core.splitlines()
             if line.strip().startswith('"')}
    assert names == {"transformers", "torch", "safetensors", "huggingface-hub"}
    extras = text.split("[project.optional-dependencies]", 1)[1].split("[project.scripts]", 1)[0]
    for module, extra in EXTRAS.items():
        line = next(line for line in extras.splitlines() if line.startswith(f"{extra} = "))
        assert f'"{module}' in line, (module, extra)
    assert 'dev = ["adaflash-hf[train,online,bench,testbed]", "pytest", "pytest-xdist>=3.5"]' in extras
    assert '".[dev]"' in (REPO_ROOT / "Makefile").read_text()  # make demo / make test install everything


def test_a_missing_extra_is_one_line_naming_it():
    with pytest.raises(MissingExtraError, match=r"^X needs the optional dependency `not_installed_x`, which is not "
                                                r"installed: pip install 'adaflash-hf\[dev\]'$"):
        require("X", "datasets", "not_installed_x")  # datasets is installed; a module of no extra: [dev]
    error = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    message = missing_extra_message(error, "adaflash-hf bench")
    assert message == ("adaflash-hf bench needs the optional dependency `matplotlib`, which is not installed: "
                       "pip install 'adaflash-hf[bench]'")
    assert missing_extra_message(ModuleNotFoundError("x", name="numpy")) is None


# A fresh interpreter where none of the optional modules can be imported (as after `pip install adaflash-hf`).
_BLOCK = "import sys\nfor _m in {blocked!r}:\n    sys.modules[_m] = None  # `import _m` raises ImportError\n"


@pytest.mark.slow
def test_a_core_install_imports_and_decodes_with_the_shipped_drafter():
    """Optional modules blocked: `import adaflash_hf` works, the shipped drafter decodes the testbed target
    losslessly; `adaflash_hf.training` / `adaflash_hf.online` / the CLI's plots refuse in one line naming their
    extra."""
    script = _BLOCK.format(blocked=OPTIONAL) + (
        "import json, torch\n"
        "import adaflash_hf\n"
        "from adaflash_hf import AdaFlashDrafterModel\n"
        "from adaflash_hf.checkpoints import default_drafter_dir\n"
        "from adaflash_hf.testbed import load_testbed\n"
        "errors = {}\n"
        "for name in ('adaflash_hf.training', 'adaflash_hf.online'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError as exc:\n"
        "        errors[name] = str(exc)\n"
        "target, tokenizer = load_testbed(dtype=torch.float32)\n"
        "drafter = AdaFlashDrafterModel.from_pretrained(default_drafter_dir(), dtype=torch.float32).eval()\n"
        "ids = tokenizer.apply_chat_template([{'role': 'user', 'content': 'Count from 1 to 20.'}],\n"
        "    add_generation_prompt=True, return_tensors='pt', return_dict=True)\n"
        "with torch.inference_mode():\n"
        "    plain = target.generate(**ids, max_new_tokens=12, do_sample=False)\n"
        "    out = target.generate(**ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,\n"
        "                          return_dict_in_generate=True)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in {blocked!r} and sys.modules[m] is not None)\n"
        # the CLI: a plot without matplotlib is one line naming [bench], status 2 (no bench run: only the plot's
        # lazy `import matplotlib` matters here)
        "import contextlib, io\n"
        "import adaflash_hf.bench.runner as runner, adaflash_hf.cli as cli\n"
        "cli.run_bench = lambda args: {}\n"
        "runner.print_bench = lambda result: None\n"
        "stderr = io.StringIO()\n"
        "with contextlib.redirect_stderr(stderr):\n"
        "    status = cli.main(['bench', '--plot', 'x.png'])\n"
        "print(json.dumps(dict(errors=errors, equal=torch.equal(plain, out.sequences), loaded=loaded,\n"
        "    rounds=out.speculation_stats.rounds, cli=[status, stderr.getvalue()])))\n"
    ).replace("{blocked!r}", repr(OPTIONAL))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_env(),
                         cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["equal"] and result["rounds"] > 0 and result["loaded"] == []
    assert set(result["errors"]) == {"adaflash_hf.training", "adaflash_hf.online"}
    assert "pip install 'adaflash-hf[train]'" in result["errors"]["adaflash_hf.training"]
    assert "pip install 'adaflash-hf[online]'" in result["errors"]["adaflash_hf.online"]
    assert all("\n" not in e for e in result["errors"].values())
    status, stderr = result["cli"]
    assert status == 2 and stderr.strip().count("\n") == 0 and "pip install 'adaflash-hf[bench]'" in stderr, stderr


# ------------------------------------------------------------------------------ one sequence per generate call


@pytest.fixture(scope="module")
def pair():
    from .conftest import make_tiny_target

    target = make_tiny_target()
    return target, build_drafter(target, seed=1)


def test_a_batch_of_two_prompts_points_to_generate_batch(pair):
    target, drafter = pair
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"a batch of 2 sequences: for batches use adaflash_hf\.generate_batch"):
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                        assistant_model=drafter)
    # transformers' own path for ordinary (non-AdaFlash) cases is unchanged: plain batched generate works
    assert target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False).shape == (2, 7)


def test_num_return_sequences_two_points_to_generate_batch(pair):
    target, drafter = pair
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"num_return_sequences=2: for batches use adaflash_hf\.generate_batch"):
        target.generate(ids, max_new_tokens=4, do_sample=True, num_return_sequences=2, assistant_model=drafter)
