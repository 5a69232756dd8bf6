"""The bench on tiny models: JSON schema, tau accounting, identical counts."""

import json

import torch

from adaflash_hf import SpeculationRuntime
from adaflash_hf.bench.runner import run_benchmark, summarize
from adaflash_hf.bench.runner import plot_bench, print_bench

from .conftest import VOCAB, build_drafter, device_cost, make_tiny_target


COST = device_cost({1: {1: 0.01, 4: 0.012}, 4: {1: 0.02, 4: 0.03}}, draft=0.002)


class CharTokenizer:
    chat_template = None
    pad_token_id = 0
    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in text]}


RECORDS = [
    {"prompt": "def add(a, b):", "domain": "code"},
    {"prompt": "What is 2 + 3?", "domain": "math"},
    {"prompt": "Hello there, how are you", "domain": "chat"},
]


def test_bench_json_schema_and_accounting(tmp_path, capsys):
    target = make_tiny_target()
    drafter = build_drafter(target, block_size=4, seed=0, hybrid_lookup=True, allow_no_draft=True)
    knobs, runtime = drafter.generation_config, SpeculationRuntime(cost_model=COST).attach(drafter)
    methods = ("plain", "prompt_lookup", "early_exit", "dflash_native", "drafter_only", "adaflash")
    results = run_benchmark(target, CharTokenizer(), drafter, RECORDS, methods=methods, max_new_tokens=12,
                            raw=True, progress=False)
    assert len(results) == len(RECORDS) * len(methods)
    summary = summarize(results, block_size=4)
    json.loads(json.dumps(summary))  # serialisable
    assert set(summary["overall"]) == {"tau", "speedup", "identical", "total"}
    assert set(summary["domains"]) == {"code", "math", "chat"}
    assert all(set(v) == {"tau", "speedup", "identical", "total"} for v in summary["domains"].values())
    assert summary["overall"]["total"] == 3 and summary["overall"]["identical"] == 3  # lossless
    plain = summary["methods"]["plain"]["overall"]
    assert abs(plain["tau"] - 1.0) < 1e-9 and abs(plain["speedup"] - 1.0) < 1e-9
    ours = summary["methods"]["adaflash"]["overall"]
    # tau from target forwards equals tau from the generator's own per-round statistics.
    rounds = sum(len(m.accepted) for m in results if m.method == "adaflash")
    committed = sum(sum(m.accepted) + len(m.accepted) for m in results if m.method == "adaflash")
    assert abs(ours["tau"] - committed / rounds) < 1e-9
    assert drafter.generation_config is knobs and drafter.runtime is runtime  # every method restored them
    assert "hybrid_lookup" not in drafter.config.to_dict()  # decoding knobs never touch the architecture config
    assert len(ours["acceptance_by_position"]) == 3
    assert set(ours["time_per_round_ms"]) == {"drafting", "verification_forward", "other"}
    for method in methods:
        assert summary["methods"][method]["overall"]["identical"] == 3, method
    print_bench(summary)
    assert "adaflash" in capsys.readouterr().out
    plot_bench(summary, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_concurrency_bench_schema_and_losslessness(tmp_path):
    from adaflash_hf.bench.concurrency import plot_concurrency, print_concurrency, run_concurrency
    from adaflash_hf.generation.cost_model import TargetCostModel
    from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig

    target = make_tiny_target()
    drafter = build_drafter(target, block_size=4, seed=0, hybrid_lookup=True, allow_no_draft=True)
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=64, block_size=4, head_dim=8)).eval()
    SpeculationRuntime(length_head=head, cost_model=COST).attach(drafter)
    result = run_concurrency(target, CharTokenizer(), drafter, RECORDS, levels=(1, 4), max_new_tokens=8, raw=True,
                             progress=False)
    assert set(result["concurrency"]) == {"1", "4"}
    for level in ("1", "4"):
        assert set(result["concurrency"][level]) == {"plain_batched", "fixed_block", "fixed_block_auto", "adaptive",
                                                     "hybrid"}
        for method, detail in result["detail"][level].items():
            assert detail["identical"] == detail["total"] == int(level), (level, method)
    assert result["detail"]["4"]["fixed_block"]["verified_per_committed"] > 0
    print_concurrency(result)
    plot_concurrency(result, tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()
