"""The speculation policy's host-time benchmark runs and reports both policies at each batch size."""

from __future__ import annotations

import json

import pytest

from dflash_serve.services.bench import policy as bench


def test_policy_bench_times_both_policies_at_every_batch_size(tmp_path, capsys):
    out = tmp_path / "policy.json"
    rows = bench.main(["--batch-sizes", "1,4", "--rounds", "20", "--reps", "2", "--out", str(out)])
    assert [(r["mode"], r["batch"]) for r in rows] == [("fixed", 1), ("fixed", 4), ("adaptive", 1), ("adaptive", 4)]
    for row in rows:
        assert row["choose_us"] > 0 and row["observe_us"] > 0
    assert json.loads(out.read_text()) == rows
    table = capsys.readouterr().out
    assert table.count("\n| adaptive |") == 2 and "choose µs/round | observe µs/round" in table


def test_policy_bench_refuses_empty_work_and_says_what_to_give(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--batch-sizes", "8,x"])
    assert "give batch sizes as integers" in capsys.readouterr().err
