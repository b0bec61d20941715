"""How soon `dflash serve` answers after it starts, and serves again after its verifier replica is killed.

    python -m dflash_serve.services.bench.restart --kills 3 --out restart [-- dflash serve flags]

Starts `dflash serve` (its embedded default unless flags follow `--`) in a Ray of its own and sends
a 4-token request every --probe-s until one is answered: the time from the process's start to
that answer. Then, --kills times, SIGKILLs the Verifier replica's process (as the kernel's OOM
killer or a crash would) and probes again: the time from the kill to the next answer (which the
engine process may give while no replica has it: `engine_adoption_s`), and to the new replica's
engine being ready or adopted. Each start's timeline comes from the replica's log lines (their own
timestamps: the replica started, its engine process up, the engine imported and its models named,
the KV cache allocated, graphs captured, round costs measured or loaded, or the engine adopted).
`dflash serve`'s own lines add Ray's and Serve's start to the first. Writes OUT/restart.json and the log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import grpc

from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc
from dflash_serve.services.bench.serving_path import Server

VERIFIER_TITLE = "ray::ServeReplica:dflash:Verifier"
PROBE = generation_pb2.GenerateRequest(prompt="def add(a, b):",
                                       sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0))
# A replica's log line as Ray prints it on the driver: (ServeReplica:dflash:Verifier pid=N) INFO 2026-12-02 01:14:46,623 ...
LOG_LINE = re.compile(r"\(ServeReplica:dflash:(\w+) pid=(\d+)\)\S* \w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+ -- (.*)")
MILESTONES = {"replica starting": "replica started", "engine process up": "engine process up",
              "models:": "models named (engine imported)", "target loaded": "target loaded (split)",
              "drafter actor's address received": "drafter actor up (split)",
              "drafter attached": "drafter attached", "KV cache:": "KV cache sized",
              "round graphs captured": "round graphs captured",
              "prefill graphs captured": "prefill graphs captured", "round costs measured": "round costs measured",
              "round costs from": "round costs loaded", "engine ready": "engine ready",
              "adopted the engine process": "engine adopted",
              "CUDA graphs captured": "CUDA graphs captured (after the engine answered)"}
ROUTER_MILESTONES = {"router starting": "router replica started", "router ready": "router ready"}
BACK = ("engine ready", "engine adopted")  # a new replica serves from either
# `dflash serve`'s own milestones, in seconds from its process's start: "dflash-serve: Ray is up (2.9 s after start)".
CLI_LINE = re.compile(r"^dflash-serve(?::| is) ([^\n]*?)\s*\((\d+\.\d+) s after start\)", re.MULTILINE)
CLI_MILESTONES = {"Ray is up": "Ray up", "Serve is up": "Serve up",
                  "answering": "dflash serve answering (its deployments ready)",
                  "up": "dflash serve up (warm: graphs captured, the drafter attached)"}


def verifier_pids() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(VERIFIER_TITLE.encode()):
                pids.append(int(pid))
        except OSError:  # it exited meanwhile
            continue
    return pids


# gRPC backs off exponentially (1 s, 1.6 s, … up to 2 min) while nothing listens on the port: a
# channel opened before the router had bound it reconnected 9–23 s after it had (on the H200), and
# those seconds were counted as the server's. The probe reconnects every 0.1 s instead.
PROBE_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                         ("grpc.max_reconnect_backoff_ms", 100)]


def wait_answered(stub, timeout_s: float, probe_s: float, process=None) -> float:
    """time.time() when a probe was first answered; `process`: the server's, which must not exit meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"dflash serve exited ({process.returncode}) before it answered")
        try:
            stub.Complete(PROBE, timeout=30)
            return time.time()
        except grpc.RpcError:  # not listening yet, not deployed yet (NOT_FOUND), no verifier running (UNAVAILABLE)
            time.sleep(probe_s)
    raise TimeoutError(f"no answer within {timeout_s:.0f} s")


def wait_until_up(log_path: Path, timeout_s: float) -> None:
    """Until `dflash serve` says it is up (warm): its timeline is whole, and a kill then finds one replica."""
    deadline = time.monotonic() + timeout_s
    while "dflash-serve is up" not in log_path.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"dflash serve not up within {timeout_s:.0f} s")
        time.sleep(0.2)


def wait_new_replica(log_path: Path, old_pid: int, since: float, timeout_s: float) -> tuple[int, dict[str, float]]:
    """The replica that replaced `old_pid`, once it logged its engine ready or adopted, and its timeline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in verifier_pids():
            if pid != old_pid and any(m in (found := timeline(log_path.read_text(), pid, since)) for m in BACK):
                return pid, found
        time.sleep(0.2)
    raise TimeoutError(f"no new verifier replica was ready within {timeout_s:.0f} s")


def timeline(log_text: str, pid: int, since: float) -> dict[str, float]:
    """Seconds from `since` to each milestone the Verifier replica `pid` logged, and a router
    replica's since then."""
    found = {}
    for match in LOG_LINE.finditer(log_text):
        deployment, at = match.group(1), datetime.strptime(match.group(3), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if deployment == "Verifier" and int(match.group(2)) == pid:
            milestones = MILESTONES
        elif deployment == "Router" and at >= since:
            milestones = ROUTER_MILESTONES
        else:
            continue
        for prefix, name in milestones.items():
            if match.group(4).startswith(prefix) and name not in found:
                found[name] = round(at - since, 2)
    return found


def cli_timeline(log_text: str) -> dict[str, float]:
    """`dflash serve`'s own milestones: seconds from its start."""
    found = {}
    for match in CLI_LINE.finditer(log_text):
        for prefix, name in CLI_MILESTONES.items():
            if match.group(1).startswith(prefix) and name not in found:
                found[name] = float(match.group(2))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--probe-s", type=float, default=0.2, help="seconds between probes")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the most a start may take")
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument("--out", default="restart")
    parser.add_argument("serve_flags", nargs="*", help="after --: dflash serve's flags")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "serve.log"
    started = time.time()
    # Probed from its start: it answers before it says it is up (`answering`, then `is up` once warm).
    server = Server(["--grpc-port", str(args.grpc_port), *args.serve_flags], log_path, wait_until_up=False)
    report: dict = {"serve_flags": args.serve_flags, "kills": []}
    try:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{args.grpc_port}",
                                                                        options=PROBE_CHANNEL_OPTIONS))
        report["first_answer_s"] = round(wait_answered(stub, args.timeout_s, args.probe_s, server.process) - started, 2)
        wait_until_up(log_path, args.timeout_s)
        (pid,) = verifier_pids()
        log_text = log_path.read_text()
        report["first_start"] = dict(sorted({**cli_timeline(log_text), **timeline(log_text, pid, started)}.items(),
                                            key=lambda item: item[1]))
        print(f"answered {report['first_answer_s']} s after start: {report['first_start']}", flush=True)
        for _ in range(args.kills):
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            answered = wait_answered(stub, args.timeout_s, args.probe_s)
            pid, found = wait_new_replica(log_path, pid, killed, args.timeout_s)
            kill = {"served_again_s": round(answered - killed, 2),
                    "replica_back_s": min(found[m] for m in BACK if m in found), "timeline": found}
            report["kills"].append(kill)
            print(f"served again {kill['served_again_s']} s after the kill, a new replica serving at "
                  f"{kill['replica_back_s']} s: {kill['timeline']}", flush=True)
    finally:
        server.stop()
    (out / "restart.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
