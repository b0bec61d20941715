"""The first token of a one-token request at c 1, in the engine and through a running server by three
clients: where the TTFT that serving adds goes (issue 67). The bench's own clients (grpc.aio, aiohttp)
cost something of their own; a bare socket speaking HTTP/1.1 costs next to nothing, so

    served by socket − engine   = the server's share (router, the hops, the engine process's intake)
    served by grpc/aiohttp − socket = the client library's share

    python -m dflash_serve.services.bench.first_token --embedded [engine flags, as `dflash generate`]
    python -m dflash_serve.services.bench.first_token --grpc 127.0.0.1:9000 --http http://127.0.0.1:8000

Every request is the same 16 prompt token ids (`PROMPT_IDS`, valid in any vocabulary of 116 ids
or more), one new token, T 0, one after another; the first `WARMUP` are not timed. Prints one line
a path (median, p10, p90 in ms); `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

PROMPT_IDS = list(range(100, 116))
WARMUP = 10


def summary(seconds: list[float]) -> dict:
    ms = [1e3 * s for s in seconds[WARMUP:]]
    p10, median, p90 = np.percentile(ms, [10, 50, 90])
    return {"median_ms": round(float(median), 3), "p10_ms": round(float(p10), 3), "p90_ms": round(float(p90), 3),
            "requests": len(ms)}


def _one_token_runs(backend, requests: int) -> list[float]:
    """Through one of `dflash bench`'s backends (the same clients and timing as its TTFT), c 1."""
    from dflash_serve.services.bench.prompts import Prompt
    from dflash_serve.services.bench.workload import BenchSampling, Load

    prompts = [Prompt("first-token", str(i), "", token_ids=tuple(PROMPT_IDS)) for i in range(WARMUP + requests)]
    records = backend.run(prompts, BenchSampling(max_tokens=1, ignore_eos=True), Load(concurrency=1))
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} one-token requests failed: {failed[0]}")
    return [r.ttft for r in records]


def _completion_body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0.0, "stream": True}


def by_socket(base_url: str, model: str, requests: int) -> list[float]:
    """HTTP/1.1 on one kept-alive connection, the stream read until its last (empty) chunk."""
    url = urlsplit(base_url)
    body = json.dumps(_completion_body(model)).encode()
    message = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    times = []
    with socket.create_connection((url.hostname, url.port or 80)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(WARMUP + requests):
            t0, first, received = time.perf_counter(), None, b""
            sock.sendall(message)
            while not received.endswith(b"\r\n0\r\n\r\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the server closed the connection mid-stream")
                received += chunk
                if first is None and b"data:" in received:
                    first = time.perf_counter() - t0
            if not received.startswith(b"HTTP/1.1 200"):
                status = received.split(b"\r\n", 1)[0].decode()
                raise RuntimeError(f"the server answered {status!r}")
            times.append(first)
    return times


def main(argv: list[str] | None = None) -> int:
    from dflash_serve.services.cli.flags import add_engine_flags, auto_device, given_config_flags, model_pair
    from dflash_serve.services.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedded", action="store_true", help="the engine in this process (engine flags below)")
    parser.add_argument("--grpc", help="a server's gRPC address (host:port)")
    parser.add_argument("--http", help="a server's base URL (http://host:port), for aiohttp and the bare socket")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", help="write the results as JSON here")
    add_engine_flags(parser)
    args = parser.parse_args(argv)
    if args.requests < 1 or not (args.embedded or args.grpc or args.http):
        parser.error("give --embedded, or a server's --grpc and/or --http; --requests must be positive")
    from dflash_serve.services.bench.load_generators import EmbeddedBackend, GrpcBackend, OpenAIBackend

    probes: dict[str, Callable[[], list[float]]] = {}
    if args.embedded:
        from dflash_serve.services.engine.loader import build_engine

        flags = given_config_flags(args, EngineConfig)
        engine = build_engine(EngineConfig.load(flags, defaults={"device": auto_device(), **model_pair(flags)}))
        probes["embedded"] = lambda: _one_token_runs(EmbeddedBackend(engine), args.requests)
    if args.grpc:
        probes["grpc"] = lambda: _one_token_runs(GrpcBackend(args.grpc), args.requests)
    if args.http:
        openai = OpenAIBackend(args.http)
        openai.describe()  # the served model's name, from /v1/models
        probes["aiohttp"] = lambda: _one_token_runs(openai, args.requests)
        probes["socket"] = lambda: by_socket(openai.base_url, openai.model, args.requests)
    results = {path: summary(probe()) for path, probe in probes.items()}
    for path, r in results.items():
        print(f"{path}: first token {r['median_ms']:.3f} ms median (p10 {r['p10_ms']:.3f}, p90 {r['p90_ms']:.3f}; "
              f"{r['requests']} requests)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
