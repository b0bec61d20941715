"""A bounded soak of a running server: `streams` clients for `minutes`, each sending its next request
as soon as its last one ends, with random cancellations and bad inputs mixed in.

    python -m dflash_serve.services.bench.soak --address 127.0.0.1:9000 --target MODEL --streams 8 --minutes 30

Every greedy output is checked token for token against the target alone (an embedded target-only
engine in this process, on --device), so a speculative round that ever changed the output is a
mismatch. Reported: requests by kind, mismatches (with the first few), outcomes by status code,
failures (any outcome a request of its kind must not have), and the RSS of the server's replica
processes when they run on this machine (start after a warm-up, end, growth). Exits 1 on any
mismatch or failure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main():",
    "The capital of France is",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "Once upon a time, there was",
    "SELECT name, count(*) FROM users",
    "x = [i * i for i in",
]
# Requests the server must refuse with INVALID_ARGUMENT (the router validates them).
BAD_REQUESTS = [
    generation_pb2.GenerateRequest(),  # no input
    generation_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=0)),
    generation_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(top_p=1.5)),
    generation_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(temperature=-1)),
    generation_pb2.GenerateRequest(chat=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="wizard", content="x")])),
]
EXPECTED = {"greedy": {"OK"}, "cancelled": {"CANCELLED", "OK"}, "bad_input": {"INVALID_ARGUMENT"}}
# What a starting server answers: the proxy before the application is deployed, the router before
# its verifier replica runs.
STARTING_UP = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
# Replica processes of the server (Ray titles its actor processes ray::<class>).
SERVER_PROCESS_TITLES = ("ray::ServeReplica:", "ray::DrafterActor")


@dataclass
class SoakReport:
    streams: int
    duration_s: float = 0.0
    requests: Counter = field(default_factory=Counter)  # by kind
    outcomes: Counter = field(default_factory=Counter)  # by status code name
    failures: Counter = field(default_factory=Counter)  # "kind: status" a request of that kind must not end with
    greedy_tokens: int = 0
    mismatches: int = 0
    mismatch_examples: list[dict] = field(default_factory=list)
    rss_mb: dict | None = None
    complete: bool = False  # false in the progress reports: the soak is still running

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and not self.failures

    def to_dict(self) -> dict:
        return {"streams": self.streams, "duration_s": round(self.duration_s, 1), "requests": dict(self.requests),
                "outcomes": dict(self.outcomes), "failures": dict(self.failures), "greedy_tokens": self.greedy_tokens,
                "mismatches": self.mismatches, "mismatch_examples": self.mismatch_examples, "rss_mb": self.rss_mb,
                "complete": self.complete, "ok": self.ok}


class TargetOnlyReference:
    """Greedy outputs of the target alone, one run per prompt at the longest max_tokens: a shorter
    request's output is that run's prefix (or all of it, where the run stopped earlier)."""

    def __init__(self, target: str, device: str, prompts: list[str], max_tokens: int, dtype: str = "auto"):
        from dflash_serve.services.config import EngineConfig
        from dflash_serve.services.engine.loader import build_engine
        from dflash_serve.services.engine.sampling_params import SamplingParams

        # The reference shares its GPU with the server under test: a small KV pool, freed after use.
        engine = build_engine(EngineConfig(target=target, drafter=None, device=device, dtype=dtype,
                                           kv_memory_fraction=0.1))
        encoded = [engine.tokenizer.encode(p) for p in prompts]
        outputs = engine.generate(encoded, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        self.outputs = {prompt: list(out.output_ids) for prompt, out in zip(prompts, outputs)}
        del engine
        if device.startswith("cuda"):
            import torch

            gc.collect()  # the engine's graphs and pools hold cycles
            torch.cuda.empty_cache()

    def expected(self, prompt: str, max_tokens: int) -> list[int]:
        return self.outputs[prompt][:max_tokens]


def server_rss_mb() -> dict[str, float]:
    """"pid:class" -> RSS in MB of the server's replica processes on this machine (none: {}). The
    class, not the whole title: Ray retitles a replica while it runs a method."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith(SERVER_PROCESS_TITLES):
                continue
            rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            continue
        found[f"{pid}:{title.split('.')[0]}"] = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    return found


class Soak:
    def __init__(self, stub, reference: TargetOnlyReference, *, streams: int, max_tokens: int,
                 cancel_fraction: float, bad_fraction: float, seed: int, timeout_s: float):
        self.stub, self.reference = stub, reference
        self.streams, self.max_tokens, self.timeout_s = streams, max_tokens, timeout_s
        self.cancel_fraction, self.bad_fraction, self.seed = cancel_fraction, bad_fraction, seed
        self.report = SoakReport(streams=streams)
        self._lock = threading.Lock()

    def run(self, seconds: float, *, ready_timeout_s: float = 300.0, progress=None,
            progress_every_s: float = 60.0) -> SoakReport:
        """Wait until the server answers, then soak for `seconds`; `progress(report)` is called
        every `progress_every_s` (a run cut short still leaves its numbers)."""
        self.wait_until_ready(ready_timeout_s)
        for index in range(self.streams):  # warm-up: every stream's first request, not counted
            self._greedy(random.Random(self.seed - 1 - index), record=False)
        rss_start = server_rss_mb()
        start = time.monotonic()
        deadline = start + seconds
        threads = [threading.Thread(target=self._stream, args=(random.Random(self.seed + i), deadline), daemon=True)
                   for i in range(self.streams)]
        for thread in threads:
            thread.start()
        join_by, next_progress = deadline + self.timeout_s + 30, start + progress_every_s
        while any(t.is_alive() for t in threads) and time.monotonic() < join_by:
            time.sleep(0.5)
            if progress is not None and time.monotonic() >= next_progress:
                next_progress += progress_every_s
                with self._lock:
                    self.report.duration_s = time.monotonic() - start
                    progress(self.report)
        self.report.duration_s = time.monotonic() - start
        rss_end = server_rss_mb()
        if rss_start and rss_end:
            self.report.rss_mb = {"start": round(sum(rss_start.values()), 1), "end": round(sum(rss_end.values()), 1),
                                  "growth": round(sum(rss_end.values()) - sum(rss_start.values()), 1),
                                  "processes": {k: round(v, 1) for k, v in rss_end.items()},
                                  "replaced": sorted(set(rss_start) ^ set(rss_end))}
        self.report.complete = True
        return self.report

    def wait_until_ready(self, timeout_s: float) -> None:
        """A server just started takes connections before it serves: Serve's proxy answers
        NOT_FOUND until the application is deployed, and the router UNAVAILABLE until its verifier
        replica runs. The soak starts once a greedy request succeeds."""
        start = time.monotonic()
        request = generation_pb2.GenerateRequest(prompt=next(iter(self.reference.outputs)),
                                                 sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=1))
        while True:
            try:
                list(self.stub.Generate(request, timeout=self.timeout_s))
                return
            except grpc.RpcError as err:
                waited = time.monotonic() - start
                if err.code() not in STARTING_UP or waited > timeout_s:
                    raise RuntimeError(f"the server is not ready after {waited:.0f} s: {err.code().name} "
                                       f"{err.details()}") from err
            time.sleep(1.0)

    def _stream(self, rng: random.Random, deadline: float) -> None:
        while time.monotonic() < deadline:
            draw = rng.random()
            if draw < self.bad_fraction:
                self._bad_input(rng)
            elif draw < self.bad_fraction + self.cancel_fraction:
                self._cancelled(rng)
            else:
                self._greedy(rng)

    def _record(self, kind: str, status: str) -> None:
        with self._lock:
            self.report.requests[kind] += 1
            self.report.outcomes[status] += 1
            if status not in EXPECTED[kind]:
                self.report.failures[f"{kind}: {status}"] += 1

    def _greedy(self, rng: random.Random, record: bool = True) -> None:
        prompt, max_tokens = rng.choice(list(self.reference.outputs)), rng.randint(1, self.max_tokens)
        request = generation_pb2.GenerateRequest(prompt=prompt, sampling=generation_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens))
        try:
            ids = [t for r in self.stub.Generate(request, timeout=self.timeout_s) for t in r.token_ids]
        except grpc.RpcError as err:
            if record:
                self._record("greedy", err.code().name)
            return
        if not record:
            return
        self._record("greedy", "OK")
        expected = self.reference.expected(prompt, max_tokens)
        with self._lock:
            self.report.greedy_tokens += len(ids)
            if ids != expected:
                self.report.mismatches += 1
                if len(self.report.mismatch_examples) < 5:
                    self.report.mismatch_examples.append(
                        {"prompt": prompt, "max_tokens": max_tokens, "got": ids, "expected": expected})

    def _cancelled(self, rng: random.Random) -> None:
        """A long stream cancelled after 0-3 messages."""
        request = generation_pb2.GenerateRequest(prompt=rng.choice(list(self.reference.outputs)),
                                                 sampling=generation_pb2.SamplingParams(max_tokens=self.max_tokens * 4,
                                                                                        ignore_eos=True))
        call = self.stub.Generate(request, timeout=self.timeout_s)
        try:
            for _ in range(rng.randint(0, 3)):
                next(call)
            call.cancel()
            for _ in call:  # ends at once with CANCELLED (or OK, had it finished first)
                pass
            self._record("cancelled", "OK")
        except StopIteration:
            self._record("cancelled", "OK")
        except grpc.RpcError as err:
            self._record("cancelled", err.code().name)

    def _bad_input(self, rng: random.Random) -> None:
        try:
            list(self.stub.Generate(rng.choice(BAD_REQUESTS), timeout=self.timeout_s))
            self._record("bad_input", "OK")
        except grpc.RpcError as err:
            self._record("bad_input", err.code().name)


def soak(address: str, target: str, *, device: str = "cpu", dtype: str = "auto", streams: int = 4,
         seconds: float = 120, max_tokens: int = 48, cancel_fraction: float = 0.15, bad_fraction: float = 0.1,
         seed: int = 0, timeout_s: float = 120, prompts: list[str] | None = None, progress=None) -> SoakReport:
    if not (streams >= 1 and seconds > 0 and max_tokens >= 1):
        raise ValueError("streams and max_tokens must be at least 1 and the duration positive")
    if not (0 <= cancel_fraction and 0 <= bad_fraction and cancel_fraction + bad_fraction <= 1):
        raise ValueError("cancel_fraction and bad_fraction must be >= 0 and add up to at most 1")
    reference = TargetOnlyReference(target, device, prompts or PROMPTS, max_tokens, dtype)
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        runner = Soak(generation_pb2_grpc.GenerationStub(channel), reference, streams=streams,
                      max_tokens=max_tokens, cancel_fraction=cancel_fraction, bad_fraction=bad_fraction,
                      seed=seed, timeout_s=timeout_s)
        return runner.run(seconds, progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_serve.services.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the server's gRPC host:port")
    parser.add_argument("--target", required=True, help="the served target (folder or hub id), for the reference")
    parser.add_argument("--device", default="cpu", help="where the reference target runs")
    parser.add_argument("--dtype", default="auto",
                        help="the reference's dtype: the server's (EngineConfig.dtype). In bfloat16 a batch's "
                             "rounding differs from a lone sequence's, so greedy near-ties can differ: compare in float32")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy requests draw max_tokens from 1..this")
    parser.add_argument("--cancel-fraction", type=float, default=0.15)
    parser.add_argument("--bad-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", help="a file of prompts, one per line (default: a built-in set)")
    parser.add_argument("--out", help="write the report as JSON here too")
    args = parser.parse_args(argv)
    prompts = None
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        if not prompts:
            parser.error(f"--prompts {args.prompts}: no prompt in the file")
    def progress(report: SoakReport) -> None:
        print(f"{report.duration_s:.0f} s: {sum(report.requests.values())} requests, {report.mismatches} "
              f"mismatches, failures {dict(report.failures)}", file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report.to_dict(), indent=2) + "\n")

    try:
        report = soak(args.address, args.target, device=args.device, dtype=args.dtype, streams=args.streams,
                      seconds=args.minutes * 60, max_tokens=args.max_tokens, cancel_fraction=args.cancel_fraction,
                      bad_fraction=args.bad_fraction, seed=args.seed, prompts=prompts, progress=progress)
    except ValueError as err:
        parser.error(str(err))
    text = json.dumps(report.to_dict(), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
