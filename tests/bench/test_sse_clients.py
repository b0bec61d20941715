"""The client-cost benchmark on the CPU: both HTTP clients read every stub stream at every load and
report their first-event times (no value is asserted: timings never are)."""

from __future__ import annotations

import json

import pytest

from dflash_serve.services.bench import sse_clients


def test_both_clients_read_every_stream_at_every_load(tmp_path, capsys):
    out = tmp_path / "sse.json"
    assert sse_clients.main(["--concurrency", "1,3", "--events", "4", "--gap", "0.001",
                             "--requests-per-stream", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["events"], report["gap_s"]) == (4, 0.001)
    assert [(r["client"], r["concurrency"], r["requests"]) for r in report["rows"]] == [
        ("httpx", 1, 2), ("aiohttp", 1, 2), ("httpx", 3, 6), ("aiohttp", 3, 6)]
    for r in report["rows"]:
        assert r["requests_per_s"] > 0 and 0 < r["first_event_median_ms"] <= r["first_event_p90_ms"]
    assert capsys.readouterr().out.count("| httpx |") == 2


@pytest.mark.parametrize("flags, says", [(["--concurrency", "0"], "must be positive"),
                                         (["--clients", "curl"], "unknown client 'curl'")])
def test_bad_flags_are_refused(flags, says, capsys):
    with pytest.raises(SystemExit):
        sse_clients.main(flags)
    assert says in capsys.readouterr().err
