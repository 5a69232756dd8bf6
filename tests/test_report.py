"""`adaflash-hf report`: the writer and verdicts on synthetic section results, and the CLI parsing.

The real benches never run here: sections are precomputed dicts in the shapes the benches return.
"""

import pytest

from adaflash_hf.bench import report
from adaflash_hf.cli import build_parser


DOMAINS = ("chat", "code", "math", "prose")
HEADER = {"command": "adaflash-hf report --quick --output-dir docs", "quick": True, "seed": 0, "commit": "abc1234",
          "date": "2026-01-01 00:00 UTC", "machine": "x86_64 Linux, 2 CPU cores", "torch": "2.13.0",
          "transformers": "5.24.0", "seconds": 123.0}


def drafter_row(taus):
    mean = sum(taus) / len(taus)
    std = (sum((t - mean) ** 2 for t in taus) / len(taus)) ** 0.5
    return {"path": "x", "tau_by_domain": dict(zip(DOMAINS, taus)), "tau_mean": mean, "tau_std": std,
            "overall_tau": mean, "identical": 4, "total": 4}


def compare_data(offline, opd):
    return {"drafters": {"offline": drafter_row(offline), "opd": drafter_row(opd)}, "config": {}}


def concurrency_data(fixed_tps, ada_tps, fixed_vpc=4.0, ada_vpc=2.0):
    detail = {}
    for level, f, a in zip(("1", "4"), fixed_tps, ada_tps):
        detail[level] = {
            "plain_batched": {"tokens_per_s": 20.0, "identical": int(level), "total": int(level)},
            "fixed_block": {"tokens_per_s": f, "tau": 1.7, "verified_per_committed": fixed_vpc,
                            "identical": int(level), "total": int(level)},
            "adaptive": {"tokens_per_s": a, "tau": 1.5, "verified_per_committed": ada_vpc,
                         "identical": int(level), "total": int(level)},
        }
    return {"concurrency": {k: {m: v["tokens_per_s"] for m, v in d.items()} for k, d in detail.items()},
            "detail": detail, "methods": ["plain_batched", "fixed_block", "adaptive"], "max_new_tokens": 16}


def online_data(taus, rates=None, known=None):
    """An unseen block (last 100 requests: `taus`, `rates`) then a known block (`known` taus, default static's)."""
    def segments(name, tau, rate):
        known_tau = (known or {}).get(name, taus["static"])
        unseen = {"domain": "sql", "span": [0, 200], "requests": 200, "tau": tau, "tokens_per_s": rate,
                  "last": {"tail": 100, "requests": 100, "tau": tau, "tokens_per_s": rate}}
        after = {"domain": "code", "span": [200, 250], "requests": 50, "tau": known_tau, "tokens_per_s": 20.0,
                 "last": {"tail": 50, "requests": 50, "tau": known_tau, "tokens_per_s": 20.0}}
        return [unseen, after]

    algos = {}
    for name, tau in taus.items():
        rate = (rates or {}).get(name, 20.0 * tau / taus["static"] if "static" in taus else 20.0)
        algos[name] = {"tau": tau, "tau_over_time": [tau - 0.1, tau, tau + 0.1], "cumulative_loss": 10.0,
                       "hindsight_loss": None if name == "static" else 9.0, "regret": None if name == "static" else 1.0,
                       "learning_ms_per_request": {} if name == "static" else {"total": 80.0, "critical_path": 5.0},
                       "tokens_per_s": rate, "identical": 6, "total": 6, "segments": segments(name, tau, rate)}
    return {"algorithms": algos, "stream": {"domains": ["sql", "code"], "requests": 250, "max_new_tokens": 32}}


def bench_row(rate, speedup, tau, identical, total=4):
    return {"tokens_per_s": rate, "speedup": speedup, "tau": tau, "identical": identical, "total": total}


def speedup_data(speedup, identical=4):
    methods = {}
    for name, (s, tau, same) in {"plain": (1.0, 1.0, 4), "prompt_lookup": (1.2, 2.1, 4),
                                 "drafter_only": (0.8, 1.7, 4), "adaflash": (speedup, 1.66, identical)}.items():
        methods[name] = {"overall": bench_row(20 * s, s, tau, same),
                         "domains": {d: bench_row(20 * s, s, tau, same // 4, 1) for d in DOMAINS}}
    ours = methods["adaflash"]
    return {"overall": ours["overall"], "domains": ours["domains"], "tau_cross_domain_std": 0.0, "methods": methods,
            "config": {"dtype": "float32", "max_new_tokens": 32}}


def ok(data, **config):
    return {"status": "ok", "data": data, "config": config, "seconds": 5.0}


# -------------------------------------------------------------------------------------------------- verdicts
def test_verdict_a_needs_std_drop_and_mean():
    assert report.verdict_a(compare_data([1.2, 1.8, 2.2, 1.6], [1.8, 1.9, 2.0, 1.9]))[0] == "held"
    # std drops but the mean drops too
    assert report.verdict_a(compare_data([1.2, 1.8, 2.2, 1.6], [1.5, 1.6, 1.6, 1.5]))[0] == "did not hold"
    # mean up, std only ~10% lower
    verdict, why = report.verdict_a(compare_data([1.0, 2.0, 1.0, 2.0], [1.1, 2.0, 1.1, 2.0]))
    assert verdict == "did not hold" and "reduction" in why


def test_verdict_b_every_level():
    assert report.verdict_b(concurrency_data([20, 30], [25, 35]))[0] == "held"
    assert report.verdict_b(concurrency_data([20, 30], [25, 29]))[0] == "did not hold"  # slower at c=4
    assert report.verdict_b(concurrency_data([20, 30], [25, 35], ada_vpc=4.5))[0] == "did not hold"
    no_head = concurrency_data([20, 30], [25, 35])
    no_head["methods"] = ["plain_batched", "fixed_block"]
    assert report.verdict_b(no_head)[0] == "not tested"


def test_verdict_c_needs_gains_on_unseen_traffic_no_forgetting_and_no_slowdown():
    verdict, why = report.verdict_c(online_data({"static": 1.3, "ogd": 1.5, "optimistic": 1.45, "ensemble": 1.55}))
    assert verdict == "held" and "best on the last 100 sql requests: ensemble" in why
    # a gain below 1.15x on the unseen block is not the claim
    assert report.verdict_c(online_data({"static": 1.3, "ogd": 1.4}))[0] == "did not hold"
    # a higher tau that does not pay for its learning (tokens/s below 1.05x) is not the claim
    slower = online_data({"static": 1.3, "ogd": 1.6}, rates={"static": 20.0, "ogd": 20.5})
    assert report.verdict_c(slower)[0] == "did not hold"
    # forgetting: tau on the known domains afterwards more than 3% below static's
    forgot = online_data({"static": 1.3, "ogd": 1.6}, known={"static": 1.7, "ogd": 1.6})
    assert report.verdict_c(forgot)[0] == "did not hold" and "known domains" in report.verdict_c(forgot)[1]
    # one algorithm below 0.97x static tokens/s over the stream fails the floor even if the best wins
    floor = online_data({"static": 1.3, "ogd": 1.6, "optimistic": 1.31}, rates={"optimistic": 18.0})
    assert report.verdict_c(floor)[0] == "did not hold"
    assert report.verdict_c(online_data({"static": 1.8}))[0] == "not tested"
    no_blocks = online_data({"static": 1.3, "ogd": 1.6})
    for entry in no_blocks["algorithms"].values():
        entry.pop("segments")
    assert report.verdict_c(no_blocks)[0] == "not tested"


def test_table_c_reads_known_domains_as_the_verdict_does():
    """The table's "known after" column is the verdict's figure: pooled over every request after the unseen block
    (two known blocks here, the second one worse for ogd), not the first known block alone."""
    data = online_data({"static": 1.3, "ogd": 1.6}, known={"static": 1.8, "ogd": 1.8})
    for name, per_request in (("static", [(10, 8), (10, 8)]), ("ogd", [(10, 8), (10, 4)])):  # (rounds, accepted)
        entry = data["algorithms"][name]
        entry["segments"].append({**entry["segments"][1], "span": [250, 260], "domain": "prose"})
        entry["per_request"] = [{"rounds": 5, "accepted": 3}] * 200 + [{"rounds": r, "accepted": a}
                                                                       for r, a in per_request]
    known = [line for line in report.table_c(data) if line.startswith("| ogd")][0].split(" | ")[5]
    assert known == f"{12 / 20 + 1:.3f} ({(12 / 20 + 1) / (16 / 20 + 1):.2f}x)"
    assert f"tau {(12 / 20 + 1) / (16 / 20 + 1):.3f}x static" in report.verdict_c(data)[1]


def test_verdict_d_needs_speedup_and_identical():
    assert report.verdict_d(speedup_data(1.24))[0] == "held"
    assert report.verdict_d(speedup_data(0.95))[0] == "did not hold"
    assert report.verdict_d(speedup_data(1.24, identical=3))[0] == "did not hold"


# ---------------------------------------------------------------------------------------------------- writer
def test_write_report_all_sections(tmp_path):
    sections = {
        "a": ok(compare_data([1.2, 1.8, 2.2, 1.6], [1.8, 1.9, 2.0, 1.9]), prompts=1),
        "b": ok(concurrency_data([20, 30], [25, 29])),
        "c": ok(online_data({"static": 1.3, "ogd": 1.5, "optimistic": 1.45, "ensemble": 1.55})),
        "d": ok(speedup_data(1.24)),
    }
    path = report.write_report(sections, HEADER, tmp_path)
    text = path.read_text()
    assert path == tmp_path / "results.md"
    for needle in ("adaflash-hf report --quick", "2 CPU cores", "2.13.0", "5.24.0", "Quick mode", "## Summary",
                   "| offline | 1.20 | 1.80 | 2.20 | 1.60 |", "| 4 | - | 20.0 | 30.0 | 29.0 | 1.70 | 1.50 | 4.00 | 2.00 | 12/12 |", "| ensemble | 1.550 |",
                   "| adaflash | 24.8 | 1.24x | 1.66 |", "| plain | 20.0 | 1.00x | 1.00 |"):
        assert needle in text, needle
    for key in report.SECTIONS:
        assert report.CLAIMS[key] in text and report.TITLES[key] in text
    summary = text.split("## Summary", 1)[1].split("## (a)", 1)[0]
    assert summary.count("**held**") == 3 and summary.count("**did not hold**") == 1  # (b) slower at c=4
    for _, name in report.PLOTS.values():
        assert (tmp_path / name).stat().st_size > 1000, name
        assert f"]({name})" in text
    # every table row has as many cells as its header
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            width = lines[i - 1].count("|")
            j = i + 1
            while j < len(lines) and lines[j].startswith("|"):
                assert lines[j].count("|") == width, lines[j]
                j += 1


def test_write_report_not_available_and_failed(tmp_path):
    sections = {
        "a": {"status": "not_available", "reason": "no OPD drafter at checkpoints/x", "seconds": 0.0},
        "b": {"status": "error", "reason": "RuntimeError: boom", "seconds": 1.0},
        "c": {"status": "not_available", "reason": "not available yet: no module", "seconds": 0.0},
        "d": ok(speedup_data(0.9)),
    }
    text = report.write_report(sections, {**HEADER, "quick": False}, tmp_path).read_text()
    assert "**Verdict: not available** (no OPD drafter at checkpoints/x)" in text
    assert "**Verdict: failed** (RuntimeError: boom)" in text
    assert "not available yet: no module" in text
    assert "**Verdict: did not hold.**" in text and "Quick mode" not in text
    assert not (tmp_path / "results_a_opd.png").exists() and (tmp_path / "results_d_speedup.png").exists()
    # sections not selected are listed as not run
    text = report.write_report({"d": ok(speedup_data(1.1))}, HEADER, tmp_path / "only_d").read_text()
    assert text.count("**Verdict: not run**") == 3 and "**Verdict: held.**" in text


def test_missing_checkpoints_say_not_available(tmp_path):
    (tmp_path / "none").mkdir()  # a folder without a checkpoint in it (a missing folder fails at parse time)
    args = build_parser().parse_args(["report", "--opd-drafter", str(tmp_path / "none"),
                                      "--length-head", str(tmp_path / "none")])
    a = report.section_a(args, report.SETTINGS["quick"]["a"], None)
    b = report.section_b(args, report.SETTINGS["quick"]["b"], None)
    assert a["status"] == b["status"] == "not_available"
    assert "no OPD drafter" in a["reason"] and "no length head" in b["reason"]


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_parsing(tmp_path):
    args = build_parser().parse_args(["report"])
    assert args.command == "report" and not args.quick and str(args.output_dir) == "docs"
    assert args.sections == report.SECTIONS and args.seed == 0 and args.json is None
    assert report.command_line(args) == "adaflash-hf report --output-dir docs"
    args = build_parser().parse_args(["report", "--quick", "--output-dir", str(tmp_path), "--sections", "d,A",
                                      "--seed", "3"])
    assert args.quick and args.output_dir == tmp_path and args.sections == ("a", "d") and args.seed == 3
    assert report.command_line(args) == f"adaflash-hf report --quick --output-dir {tmp_path} --sections a,d --seed 3"
    args = build_parser().parse_args(["report", "--device", "cpu", "--repeats", "2"])
    assert (args.device, args.repeats) == ("cpu", 2)
    assert report.command_line(args) == "adaflash-hf report --output-dir docs --device cpu --repeats 2"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "--sections", "a,z"])
    # the other subcommands still parse
    from adaflash_hf.checkpoints import default_drafter_dir

    shipped = str(default_drafter_dir())  # `--drafters` checks each folder holds a drafter checkpoint
    assert build_parser().parse_args(["compare", "--drafters", f"{shipped},{shipped}"]).drafters == [shipped] * 2
    assert build_parser().parse_args(["bench", "--max-prompts", "1"]).max_prompts == 1


def test_quick_settings_are_never_larger_than_full():
    quick, full = report.SETTINGS["quick"], report.SETTINGS["full"]
    assert set(quick) == set(full) == set(report.SECTIONS)
    for key, settings in quick.items():
        for name, value in settings.items():
            if name in full[key]:
                big = full[key][name]
                assert (max(value) <= max(big) and len(value) <= len(big)) if isinstance(value, list) \
                    else value <= big, (key, name)


def test_section_c_takes_a_finished_bench_online_run(tmp_path):
    import argparse
    import json

    data = online_data({"static": 1.3, "ogd": 1.5})
    path = tmp_path / "online.json"
    path.write_text(json.dumps(data))
    args = argparse.Namespace(online_json=path, seed=0)
    section = report.section_c(args, dict(report.SETTINGS["full"]["c"]), models=None)  # no model is loaded
    assert section["status"] == "ok" and section["data"] == data
    assert str(path) in section["config"]["measured in"]
    lines, verdict, _ = report.render_section("c", section, tmp_path)
    assert verdict == "held" and any("| ogd | 1.500 |" in line for line in lines)  # 1.15x, tok/s alike


def test_rerunning_one_section_keeps_the_others_from_the_earlier_report(tmp_path):
    sections = {"a": ok(compare_data([1.2, 1.8, 2.2, 1.6], [1.8, 1.9, 2.0, 1.9]), prompts=1),
                "b": ok(concurrency_data([20, 30], [25, 29])),
                "c": ok(online_data({"static": 1.3, "ogd": 1.4})), "d": ok(speedup_data(1.24))}
    first = report.write_report(sections, {**HEADER, "commit": "aaa1111"}, tmp_path).read_text()
    again = report.write_report({"c": ok(online_data({"static": 1.3, "ogd": 1.5}))},
                                {**HEADER, "commit": "bbb2222"}, tmp_path, keep_other_sections=True).read_text()
    block = lambda text, key: text.split(f"## ({key})", 1)[1].split("\n## ", 1)[0]  # noqa: E731
    for key in "abd":
        assert block(again, key) == block(first, key)
    assert "| ogd | 1.500 |" in block(again, "c") and "| ogd | 1.400 |" in block(first, "c")
    summary = again.split("## Summary", 1)[1].split("## (a)", 1)[0]
    assert summary.count("| (") == 4 and summary.count("**held**") == 3  # (c) now held, (b) still did not
    assert "| sections kept from an earlier run | (a), (b), (d):" in again and "aaa1111" in again
    third = report.write_report({"c": ok(online_data({"static": 1.3, "ogd": 1.6}))}, {**HEADER, "commit": "ccc3333"},
                                tmp_path, keep_other_sections=True).read_text()
    assert "aaa1111" in third.split("## Summary")[0]  # kept twice: still credited to the run that measured them
    # without the flag the other sections say they were not run
    plain = report.write_report({"c": ok(online_data({"static": 1.3}))}, HEADER, tmp_path).read_text()
    assert plain.count("not selected with --sections") == 3
