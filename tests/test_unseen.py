"""The unseen-traffic stream of OnlineSpec's bench: text-to-SQL requests, then known-domain held-out prompts."""

import pytest

from adaflash_hf.bench.online import _mixed_spans, _segments, _windows, markdown_online
from adaflash_hf.testbed import DOMAINS, read_prompts_jsonl, split_of
from adaflash_hf.testbed.__main__ import main as run_testbed_cli
from adaflash_hf.testbed.unseen import sql_requests, unseen_stream


def test_sql_requests_are_seeded_distinct_and_well_formed():
    first = sql_requests(60, seed=1)
    assert first == sql_requests(60, seed=1)
    assert [r["prompt"] for r in first] != [r["prompt"] for r in sql_requests(60, seed=2)]
    assert len({r["prompt"] for r in first}) == 60 and len({r["id"] for r in first}) == 60
    assert all(r["domain"] == "sql" and r["source"] == "faker-sql" and "SQL" in r["prompt"] for r in first)
    # the requests vary in kind, not only in values
    verbs = {kind for r in first for kind in ("query", "statement", "CREATE TABLE") if kind in r["prompt"]}
    assert verbs == {"query", "statement", "CREATE TABLE"}
    with pytest.raises(ValueError, match="count must be >= 1"):
        sql_requests(0)


def test_unseen_stream_is_sql_then_held_out_known_domains(tmp_path):
    stream = unseen_stream(unseen=12, known=8, seed=0)
    assert [r["domain"] for r in stream[:12]] == ["sql"] * 12
    tail = stream[12:]
    assert len(tail) == 8 and {r["domain"] for r in tail} == set(DOMAINS)
    assert all(split_of(r["source"], r["id"]) == "eval" for r in tail)  # never trained on
    with pytest.raises(ValueError, match="known must be >= 0"):
        unseen_stream(unseen=3, known=-1)
    out = tmp_path / "stream.jsonl"
    run_testbed_cli(["unseen-stream", "--out", str(out), "--unseen", "12", "--known", "8"])
    assert [r["prompt"] for r in read_prompts_jsonl(out)] == [r["prompt"] for r in stream]


def test_segments_pool_each_contiguous_domain_run_and_its_tail():
    def row(domain, accepted, seconds=1.0):
        return {"domain": domain, "accepted": accepted, "new_tokens": sum(accepted) + len(accepted),
                "seconds": seconds}

    rows = [row("sql", [0, 0]), row("sql", [2]), row("sql", [3, 1]), row("code", [1]), row("code", [0, 0, 0])]
    sql, code = _segments(rows, tail=2)
    assert (sql["domain"], sql["span"], code["span"]) == ("sql", [0, 3], [3, 5])
    assert sql["tau"] == pytest.approx(6 / 5 + 1)  # pooled over rounds, not averaged per request
    assert sql["last"]["tail"] == 2 and sql["last"]["tau"] == pytest.approx(6 / 3 + 1)
    assert sql["tokens_per_s"] == pytest.approx(11 / 3)
    assert code["tau"] == pytest.approx(1 / 4 + 1) and code["last"]["requests"] == 2


def test_short_domain_runs_are_one_mixed_stretch_in_the_tables():
    """A known tail cycling through domains (runs of one request) is one pooled row, with its ratio to static."""
    def rows(accepted):
        return [{"domain": d, "accepted": [a], "new_tokens": a + 1, "seconds": 1.0, "static": i >= 13}
                for i, (d, a) in enumerate([("sql", 1)] * 12 + list(zip(["code", "math", "chat"] * 2, accepted)))]

    per_request = lambda rs: [{"rounds": 1, "accepted": sum(r["accepted"]), "new_tokens": r["new_tokens"],  # noqa: E731
                               "seconds": r["seconds"], "static": r["static"]} for r in rs]
    algos = {}
    for name, accepted in (("static", [2] * 6), ("ogd", [1] * 6)):
        rs = rows(accepted)
        algos[name] = {"tau": 2.0, "tokens_per_s": 2.0, "identical": 18, "total": 18, "segments": _segments(rs),
                       "per_request": per_request(rs), "over_time": _windows(rs, 6)}
    assert _mixed_spans(algos["ogd"]["segments"]) == [(12, 18, ["code", "math", "chat"])]
    result = {"algorithms": algos, "stream": {"requests": 18, "domains": ["sql", "code", "math", "chat"],
                                              "max_new_tokens": 4, "update_mode": "background", "path": "drafter"}}
    mixed = [line for line in markdown_online(result) if "mixed" in line]
    assert len(mixed) == 2 and "| ogd | mixed: code/math/chat | 12-18 | 5 | 2.000 (0.667x) |" in mixed[1]
