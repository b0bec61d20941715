"""The serving-path benchmark end to end at tiny size on the CPU: the same prompts through the
embedded engine and through a running `dflash serve` (gRPC and OpenAI), one table. No ratio is
asserted (timings are never asserted in tests); that every path ran, completed every request and
reported throughput and TTFT is."""

from __future__ import annotations

import json

from dflash_serve.services.bench import serving_path
from tests.integration.conftest import free_port


def test_the_tiny_target_case_runs_embedded_and_served_over_both_protocols(tmp_path, capsys):
    assert serving_path.main(["--case", "qwen3-8b-target", "--size", "tiny", "--device", "cpu", "--out",
                              str(tmp_path), "--grpc-port", str(free_port()), "--http-port", str(free_port()),
                              "--metrics-port", str(free_port())]) == 0
    results = json.loads((tmp_path / "serving_path.json").read_text())["results"]
    paths = {(r["path"], r["protocol"], r["concurrency"]) for r in results}
    assert paths == {(path, protocol, c) for path, protocol in [("embedded", "in-process"), ("colocated", "grpc"),
                                                                 ("colocated", "openai")] for c in (1, 2)}
    assert all(r["failed"] == 0 and r["output_tok_s"] > 0 and r["ttft_mean_ms"] > 0 for r in results)
    table = (tmp_path / "serving_path.md").read_text()
    assert capsys.readouterr().out.endswith(table)  # the table printed is the one written
    assert "| qwen3-8b-target | random | 0 | 1 |" in table and "colocated grpc" in table and "colocated openai" in table
