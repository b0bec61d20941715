"""The first token of a one-token request at c 1, in the engine and through a running server by three
clients: where the TTFT that serving adds goes (issue 67). The bench's own clients (grpc.aio, httpx)
cost something of their own; a bare socket speaking HTTP/1.1 costs next to nothing, so

    served by socket − engine   = the server's share (router, the hops, the engine process's intake)
    served by grpc/httpx − socket = the client library's share

    python -m dflash_serve.services.bench.first_token --embedded [engine flags, as `dflash generate`]
    python -m dflash_serve.services.bench.first_token --grpc 127.0.0.1:9000 --http http://127.0.0.1:8000

Every request is the same 16 prompt token ids (`PROMPT_IDS`, valid in any vocabulary of 116 ids
or more), one new token, T 0, one after another; the first `WARMUP` are not timed. Prints one line
a path (median, p10, p90 in ms); `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

PROMPT_IDS = list(range(100, 116))
WARMUP = 10


def summary(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds[WARMUP:])
    return {"median_ms": round(statistics.median(ms), 3), "p10_ms": round(ms[len(ms) // 10], 3),
            "p90_ms": round(ms[len(ms) * 9 // 10], 3), "requests": len(ms)}


def embedded(engine, requests: int) -> list[float]:
    """add_request to the step whose outputs hold the first token, as `dflash bench --embedded` times it."""
    from dflash_serve.services.engine.sampling import SamplingParams

    times = []
    for _ in range(WARMUP + requests):
        t0, first = time.perf_counter(), None
        request_id = engine.add_request(PROMPT_IDS, SamplingParams(max_tokens=1, temperature=0.0))
        while True:
            outputs = [o for o in engine.step() if o.request_id == request_id]
            if first is None and any(o.new_token_ids for o in outputs):
                first = time.perf_counter() - t0
            if any(o.finished for o in outputs):
                break
        engine.release(request_id)
        times.append(first)
    return times


def by_grpc(address: str, requests: int) -> list[float]:
    import grpc

    from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc

    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT_IDS),
                                             sampling=generation_pb2.SamplingParams(max_tokens=1, temperature=0.0))

    async def run() -> list[float]:
        times = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for _ in range(WARMUP + requests):
                t0, first = time.perf_counter(), None
                async for _response in stub.Generate(request):
                    first = first or time.perf_counter() - t0
                times.append(first)
        return times

    return asyncio.run(run())


def _completion_body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0.0, "stream": True}


def by_httpx(base_url: str, model: str, requests: int) -> list[float]:
    import httpx

    async def run() -> list[float]:
        times = []
        async with httpx.AsyncClient(base_url=base_url) as client:
            for _ in range(WARMUP + requests):
                t0, first = time.perf_counter(), None
                async with client.stream("POST", "/v1/completions", json=_completion_body(model)) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if first is None and line.startswith("data:"):
                            first = time.perf_counter() - t0
                times.append(first)
        return times

    return asyncio.run(run())


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


def served_model(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    from dflash_serve.services.cli.flags import add_engine_flags, auto_device, given_config_flags, model_pair
    from dflash_serve.services.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedded", action="store_true", help="the engine in this process (engine flags below)")
    parser.add_argument("--grpc", help="a server's gRPC address (host:port)")
    parser.add_argument("--http", help="a server's base URL (http://host:port), for httpx and the bare socket")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", help="write the results as JSON here")
    add_engine_flags(parser)
    args = parser.parse_args(argv)
    if args.requests < 1 or not (args.embedded or args.grpc or args.http):
        parser.error("give --embedded, or a server's --grpc and/or --http; --requests must be positive")
    probes: dict[str, Callable[[], list[float]]] = {}
    if args.embedded:
        from dflash_serve.services.engine.loader import build_engine

        flags = given_config_flags(args, EngineConfig)
        engine = build_engine(EngineConfig.load(flags, defaults={"device": auto_device(), **model_pair(flags)}))
        probes["embedded"] = lambda: embedded(engine, args.requests)
    if args.grpc:
        probes["grpc"] = lambda: by_grpc(args.grpc, args.requests)
    if args.http:
        base_url = args.http.rstrip("/")
        model = served_model(base_url)
        probes["httpx"] = lambda: by_httpx(base_url, model, args.requests)
        probes["socket"] = lambda: by_socket(base_url, model, args.requests)
    results = {path: summary(probe()) for path, probe in probes.items()}
    for path, r in results.items():
        print(f"{path}: first token {r['median_ms']:.3f} ms median (p10 {r['p10_ms']:.3f}, p90 {r['p90_ms']:.3f}; "
              f"{r['requests']} requests)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
