"""The restart benchmark's timeline: milestones read from the Verifier's and Router's log lines as Ray prints them."""

from __future__ import annotations

from datetime import datetime

from dflash_serve.services.bench.restart import timeline

LINES = """\
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:01,000 dflash_Verifier abc -- replica starting (config x)
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:02,500 dflash_Verifier abc -- engine process up (pid 50); importing the engine
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:05,000 dflash_Verifier abc -- models: target t; drafter d
(ServeReplica:dflash:Verifier pid=99) INFO 2026-12-02 18:00:05,100 dflash_Verifier abc -- models: another replica's
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:06,000 dflash_Verifier abc -- target loaded; waiting for the drafter actor's address
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:07,250 dflash_Verifier abc -- drafter actor's address received
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:07,500 dflash_Verifier abc -- KV cache: 100 blocks of 16 tokens (0.10 GiB)
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:08,000 dflash_Verifier abc -- round costs from /c (batch sizes [1])
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:09,000 dflash_Verifier abc -- engine ready
(ServeReplica:dflash:Router pid=42) INFO 2026-12-02 17:59:59,000 dflash_Router def -- router ready (an earlier start's)
(ServeReplica:dflash:Router pid=43) INFO 2026-12-02 18:00:01,500 dflash_Router def -- router starting (pid 43)
(ServeReplica:dflash:Router pid=43) INFO 2026-12-02 18:00:09,500 dflash_Router def -- router ready (tokenizer loaded, ports bound)
(ServeReplica:dflash:Verifier pid=41) INFO 2026-12-02 18:00:12,000 dflash_Verifier abc -- CUDA graphs captured in 3.0 s after the engine answered
"""


def test_each_milestone_of_the_replica_is_timed_from_the_start_once():
    since = datetime(2026, 12, 2, 18, 0, 0).timestamp()
    assert timeline(LINES, 41, since) == {
        "replica started": 1.0, "engine process up": 2.5, "models named (engine imported)": 5.0,
        "target loaded (split)": 6.0, "drafter actor up (split)": 7.25, "KV cache sized": 7.5,
        "round costs loaded": 8.0, "engine ready": 9.0, "router replica started": 1.5, "router ready": 9.5,
        "CUDA graphs captured (after the engine answered)": 12.0}
    assert timeline(LINES, 99, since) == {"models named (engine imported)": 5.1, "router replica started": 1.5,
                                          "router ready": 9.5}


def test_a_replica_that_adopted_its_predecessors_engine_is_back_when_it_says_so():
    adopted = ("(ServeReplica:dflash:Verifier pid=77) INFO 2026-12-02 18:00:03,000 dflash_Verifier abc -- replica starting "
               "(pid 77)\n(ServeReplica:dflash:Verifier pid=77) INFO 2026-12-02 18:00:03,040 dflash_Verifier abc -- "
               "adopted the engine process (pid 50) of a replica that died: its models, KV cache and requests in flight\n")
    since = datetime(2026, 12, 2, 18, 0, 0).timestamp()
    assert timeline(adopted, 77, since) == {"replica started": 3.0, "engine adopted": 3.04}


def test_dflash_serves_own_milestones_are_read_from_its_lines(capsys, monkeypatch):
    """Ray's and Serve's part of a start, from the lines `dflash serve` prints (`_milestone`)."""
    from dflash_serve.services.bench.restart import cli_timeline
    from dflash_serve.services.cli import serve

    monkeypatch.setattr(serve, "process_started", lambda: serve.time.time() - 2.94)
    serve._milestone("Ray is up")
    monkeypatch.setattr(serve, "process_started", lambda: serve.time.time() - 4.1)
    serve._milestone("Serve is up; starting the verifier replica (its engine loads the models) and the router")
    printed = capsys.readouterr().out
    assert printed.endswith("and the router (4.1 s after start)\n")
    answering = ("dflash-serve: answering (at full speed once warm: CUDA graphs captured, the drafter attached) "
                 "(15.0 s after start)\n")
    up = "dflash-serve is up (21.3 s after start): the OpenAI API on http://0.0.0.0:8000/v1 (model 'm'), gRPC ...\n"
    assert cli_timeline(printed + "(Verifier pid=1) INFO -- models: t (3.0 s after start)\n" + answering + up) == {
        "Ray up": 2.9, "Serve up": 4.1, "dflash serve answering (its deployments ready)": 15.0,
        "dflash serve up (warm: graphs captured, the drafter attached)": 21.3}


def test_this_process_started_before_its_modules_were_imported():
    from dflash_serve.services.cli import serve

    assert serve.process_started() <= serve._IMPORTED + 0.05
