"""The hop benchmark on the CPU: each sender mode makes its round trips against a real echoing
process and reports its latency percentiles (no value is asserted: timings never are)."""

from __future__ import annotations

import json

from dflash_serve.services.bench import hop_latency


def test_every_sender_mode_reports_its_round_trips(tmp_path, capsys):
    out = tmp_path / "hop.json"
    assert hop_latency.main(["--messages", "50", "--bytes", "300", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["messages"], report["bytes"]) == (50, 300) and report["machine"]["cpus"] >= 1
    assert list(report["modes"]) == list(hop_latency.MODES)
    for r in report["modes"].values():
        assert 0 < r["median_us"] <= r["p90_us"] <= r["p99_us"]
    assert capsys.readouterr().out.strip() == hop_latency.table(report)


def test_a_message_too_large_for_one_echo_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        hop_latency.main(["--bytes", str(1 << 17)])
    assert "--bytes in [1, 65536]" in capsys.readouterr().err
