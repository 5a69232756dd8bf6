"""The bench on tiny models: JSON schema, tau accounting, identical counts."""

import json

import pytest


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


def test_serving_bench_schema_latencies_and_losslessness(tmp_path, capsys):
    from adaflash_hf.bench.serving import METHODS, plot_serving, print_serving, request_stream, run_serving
    from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig

    target = make_tiny_target()
    target.generation_config.eos_token_id = None
    drafter = build_drafter(target, block_size=4, seed=0, hybrid_lookup=True, allow_no_draft=True)
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=64, block_size=4, head_dim=8)).eval()
    SpeculationRuntime(length_head=head, cost_model=COST).attach(drafter)
    result = run_serving(target, CharTokenizer(), drafter, RECORDS, levels=(1, 3), max_new_tokens=6, requests=4,
                         raw=True, progress=False, methods=METHODS)  # every method, the hybrid_trees ablation too
    assert result["methods"] == list(METHODS) and set(result["concurrency"]) == {"1", "3"}
    for level in ("1", "3"):
        assert result["peer"][level] in ("transformers_cb", "plain_batched")
        for method, d in result["detail"][level].items():
            assert d["identical"] == d["total"] == 4, (level, method)  # every output equals plain bs=1 greedy
            assert d["new_tokens"] == 4 * 6 and d["tokens_per_s"] == result["concurrency"][level][method]
            assert 0 < d["ttft_ms"]["p50"] <= d["ttft_ms"]["p99"] and d["itl_ms"]["p50"] <= d["itl_ms"]["p99"]
            assert d["vs_peer"] > 0
        assert result["detail"][level]["fixed_block"]["verified_per_committed"] > 1.0
    json.loads(json.dumps(result))
    print_serving(result)
    assert "transformers_cb" in capsys.readouterr().out
    plot_serving(result, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000
    stream = request_stream(5, 2, rate=10.0, seed=1)
    assert [i for i, _ in stream] == [0, 1, 0, 1, 0] and stream[0][1] == 0.0
    assert all(b[1] > a[1] for a, b in zip(stream, stream[1:]))  # Poisson arrivals, increasing


def test_serving_metrics_from_token_times():
    from adaflash_hf.bench.serving import Served, serving_metrics

    served = [Served(0, 0.0, [0.1, 0.3, 0.3, 0.6], [1, 2, 3, 4]), Served(1, 0.2, [0.5, 0.7], [5, 6])]
    m = serving_metrics(served, 1.0)
    assert m["tokens_per_s"] == 6 and m["requests"] == 2
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0)  # (100 + 300) / 2 ms
    # deliveries: request 0 at .1, .3 (two tokens at once), .6 -> gaps 200, 300 ms; request 1: 200 ms
    assert m["itl_ms"]["p50"] == pytest.approx(200.0) and m["itl_ms"]["p99"] == pytest.approx(298.0)
    assert m["tpot_ms"]["p50"] == pytest.approx((500 / 3 + 200) / 2)
