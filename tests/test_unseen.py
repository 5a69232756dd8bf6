"""The unseen-traffic stream of OnlineSpec's bench: text-to-SQL requests, then known-domain held-out prompts."""

import pytest

from adaflash_hf.bench.online import _segments
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
