"""The serving-path benchmark end to end at tiny size on the CPU: the same prompts through the
embedded engine and through a running `dflash serve` (gRPC and OpenAI), one table. No ratio is
asserted (timings are never asserted in tests); that every path ran, completed every request and
reported throughput and TTFT is."""

from __future__ import annotations

import json

import pytest

from dflash_serve.services.bench import serving_path
from tests.integration.conftest import free_port


def test_the_tiny_target_case_runs_embedded_and_served_over_both_protocols(tmp_path, capsys):
    assert serving_path.main(["--case", "qwen3-8b-target", "--size", "tiny", "--device", "cpu", "--out",
                              str(tmp_path), "--grpc-port", str(free_port()), "--http-port", str(free_port()),
                              "--metrics-port", str(free_port())]) == 0
    everything = json.loads((tmp_path / "serving_path.json").read_text())["results"]
    results = [r for r in everything if "first_token" not in r]
    paths = {(r["path"], r["protocol"], r["concurrency"]) for r in results}
    assert paths == {(path, protocol, c) for path, protocol in [("embedded", "in-process"), ("colocated", "grpc"),
                                                                 ("colocated", "openai")] for c in (1, 2)}
    assert all(r["failed"] == 0 and r["output_tok_s"] > 0 and r["ttft_mean_ms"] > 0 for r in results)
    # The one-token probe: the engine, and the server by each client, 20 requests each after the warm-up.
    probed = {(r["path"], r["protocol"]): r["first_token"] for r in everything if "first_token" in r}
    assert set(probed) == {("embedded", "in-process"), *(("colocated", c) for c in ("socket", "aiohttp", "grpc"))}
    assert all(p["requests"] == 20 and 0 < p["p10_ms"] <= p["median_ms"] <= p["p90_ms"] for p in probed.values())
    table = (tmp_path / "serving_path.md").read_text()
    assert capsys.readouterr().out.endswith(table)  # the table printed is the one written
    assert "| qwen3-8b-target | colocated | socket |" in table and "added to the engine's" in table
    assert "| qwen3-8b-target | random | 0 | 1 |" in table and "colocated grpc" in table and "colocated openai" in table
    # Both sides without a prefix cache: the server would find the later runs' prompts cached.
    embedded = json.loads((tmp_path / "qwen3-8b-target" / "embedded-t0" / "results.json").read_text())
    assert embedded["setup"]["prefix_caching"] is False
    assert "--no-enable-prefix-caching" in serving_path.SAME_WORK


def test_a_profile_summary_counts_each_function_once_per_sample(tmp_path):
    """py-spy's raw output: one collapsed stack and its sample count a line; a recursive frame is one
    function that the sample passes through, not two; the innermost frame is where the sample was."""
    from dflash_serve.services.bench.py_spy import top_functions

    raw = tmp_path / "router.txt"
    raw.write_text("thread (1);main (a.py:1);loop (a.py:5);step (b.py:9) 6\n"
                   "thread (1);main (a.py:1);loop (a.py:5);loop (a.py:5);send (c.py:2) 3\n"
                   "thread (2);run (t.py:1) 1\n")
    samples, top = top_functions(raw, count=3)
    assert samples == 10
    assert top == [("loop (a.py:5)", 0.9), ("main (a.py:1)", 0.9), ("thread (1)", 0.9)]
    assert dict(top_functions(raw, count=10)[1])["send (c.py:2)"] == 0.3
    assert top_functions(raw, innermost=True) == (10, [("step (b.py:9)", 0.6), ("send (c.py:2)", 0.3),
                                                       ("run (t.py:1)", 0.1)])


def test_profiling_without_py_spy_says_what_to_install(monkeypatch):
    from dflash_serve.services.bench import py_spy

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="pip install py-spy"):
        py_spy.py_spy()


def test_a_profile_at_a_load_the_case_never_runs_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        serving_path.main(["--case", "qwen3-8b-target", "--size", "tiny", "--device", "cpu", "--out", str(tmp_path),
                           "--profile-concurrency", "32"])
    assert "--profile-concurrency 32 is not a load of case(s) ['qwen3-8b-target'] (theirs: 1,2)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no models written, no server started


def test_the_profile_load_lasts_the_samples_and_a_margin_at_the_measured_pace():
    """Two sets measured at c 32 (48 prompts in 0.75 and 0.9 s): the faster pace, 15.625 ms a
    prompt, fills 8 s of samples and the 4 s margin over both sets with 384 prompts each."""
    report = {"runs": [{"concurrency": 1, "completed": 48, "duration": 20.0},
                       {"concurrency": 32, "completed": 48, "duration": 0.75},
                       {"concurrency": 32, "completed": 48, "duration": 0.9}]}
    assert serving_path.PROFILE_MARGIN_S == 4.0
    assert serving_path.profile_prompts(report, 32, 8.0) == 384
    assert serving_path.profile_prompts(report, 1, 8.0) == 29  # one set at 0.42 s a prompt
    slow = {"runs": [{"concurrency": 32, "completed": 32, "duration": 60.0}]}
    assert serving_path.profile_prompts(slow, 32, 8.0) == 32  # never fewer prompts than the concurrency
    failed = {"runs": [{"concurrency": 32, "completed": 0, "duration": 3.0}]}
    with pytest.raises(RuntimeError, match="no request completed at c=32"):
        serving_path.profile_prompts(failed, 32, 8.0)


def test_the_profiled_processes_are_found_by_their_titles_the_drafter_actor_too(monkeypatch):
    """`ps` as a split server shows it: the proxy, the two replicas, the engine process (the
    Verifier's child) and the drafter's actor, all under the server; a Verifier elsewhere is not it."""
    import subprocess

    from dflash_serve.services.bench import py_spy

    table = "\n".join([
        "  100     1 python -m dflash_serve.services.cli serve",
        "  101   100 /usr/bin/raylet --node-ip-address=127.0.0.1",
        "  102   101 ray::ProxyActor",
        "  103   101 ray::ServeReplica:dflash:Router",
        "  104   101 ray::ServeReplica:dflash:Verifier",
        "  105   104 python -m dflash_serve.services.verifier.engine_process",
        "  106   101 ray::DrafterActor.address",
        "  200     1 ray::ServeReplica:other:Verifier",
    ]) + "\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=table))
    assert py_spy.server_processes(100) == {"proxy": 102, "router": 103, "verifier": 104, "engine": 105,
                                            "drafter": 106}


def test_the_table_without_embedded_rows_shows_the_served_ones_uncompared():
    """--no-embedded into a fresh folder: nothing to divide by, so each served cell is its tok/s and TTFT."""
    rows = [{"case": "default", "path": "split", "protocol": protocol, "temperature": 0.0, "dataset": "humaneval",
             "concurrency": 32, "output_tok_s": tok_s, "ttft_mean_ms": 20.0, "failed": 0}
            for protocol, tok_s in (("grpc", 15730.0), ("openai", 15481.0))]
    assert serving_path.table(rows).splitlines()[2] == (
        "| default | humaneval | 0 | 32 |  |  | 15,730 (TTFT 20.0 ms) | 15,481 (TTFT 20.0 ms) |")


def test_a_run_replaces_only_the_rows_it_measures_again():
    rows = [{"case": "default", "path": "embedded", "output_tok_s": 1.0},
            {"case": "default", "path": "colocated", "output_tok_s": 2.0},
            {"case": "default", "path": "colocated", "first_token": {"median_ms": 3.0}},
            {"case": "default", "path": "split", "output_tok_s": 4.0},
            {"case": "qwen3-8b-target", "path": "colocated", "output_tok_s": 5.0}]
    # colocated again without probes: its first-token row stays, as do other paths and cases
    assert serving_path.rows_kept(rows, ["default"], {"colocated"}, first_token=False) == [rows[0], *rows[2:]]
    assert serving_path.rows_kept(rows, ["default"], {"colocated"}, first_token=True) == [rows[0], *rows[3:]]
    assert serving_path.rows_kept(rows, ["default"], set(), first_token=True) == rows  # nothing run again


@pytest.mark.parametrize("flags, says", [(["--topologies", "none", "--no-embedded"], "runs nothing"),
                                         (["--topologies", "both"], "colocated and/or split, or none")])
def test_topologies_that_run_nothing_or_do_not_exist_are_refused(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit):
        serving_path.main(["--case", "qwen3-8b-target", "--size", "tiny", "--device", "cpu", "--out", str(tmp_path),
                           *flags])
    assert says in capsys.readouterr().err
