"""What the benchmark's HTTP client costs: the same SSE streams read by httpx and by aiohttp.

`dflash bench --backend openai` times a request's first token and its gaps from the client, so
whatever the client library spends per event is in every served TTFT it reports (issue 67). A
stub server in a process of its own answers every POST with EVENTS chat-completion chunks, one
every GAP seconds from the first, as a server stepping every GAP would; each client keeps c
streams going (a new request as one ends) and reports its first-event time and requests/s.
Nothing here is our server: the difference between the rows is the client's alone.

    python -m dflash_serve.services.bench.sse_clients --concurrency 1,8,32 --out sse_clients.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time

import numpy as np

from dflash_serve.services.bench.hop_latency import process_on_a_port

CHUNK = json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " tok"},
                                                                    "finish_reason": None, "logprobs": None}]})
BODY = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _serve(port_out, events: int, gap: float) -> None:
    """The stub: HTTP/1.1 keep-alive, chunked SSE, no parsing beyond the request's length."""
    event = f"data: {CHUNK}\n\n".encode()
    frame = b"%x\r\n%s\r\n" % (len(event), event)
    done = b"data: [DONE]\n\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + frame)
                for _ in range(events - 1):
                    await asyncio.sleep(gap)
                    writer.write(frame)
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_out.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


async def _httpx_streams(url: str, concurrency: int, requests: int) -> list[float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one() -> float:
            start, first = time.perf_counter(), None
            async with client.stream("POST", url, json=BODY) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data:") and line[5:].strip() != "[DONE]":
                        json.loads(line[5:])
                        first = time.perf_counter()
            return first - start

        return await _closed_loop(one, concurrency, requests)


async def _aiohttp_streams(url: str, concurrency: int, requests: int) -> list[float]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:

        async def one() -> float:
            start, first = time.perf_counter(), None
            async with client.post(url, json=BODY) as response:
                async for line in response.content:
                    if first is None and line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        json.loads(line[5:])
                        first = time.perf_counter()
            return first - start

        return await _closed_loop(one, concurrency, requests)


async def _closed_loop(one, concurrency: int, requests: int) -> list[float]:
    left = iter(range(requests))

    async def stream() -> list[float]:
        return [await one() for _ in left]

    return [t for times in await asyncio.gather(*(stream() for _ in range(concurrency))) for t in times]


CLIENTS = {"httpx": _httpx_streams, "aiohttp": _aiohttp_streams}


def measure(url: str, client: str, concurrency: int, requests: int) -> dict:
    asyncio.run(CLIENTS[client](url, concurrency, concurrency))  # warm: imports, the server's first accepts
    start = time.perf_counter()
    firsts = asyncio.run(CLIENTS[client](url, concurrency, requests))
    elapsed = time.perf_counter() - start
    median, p90 = np.percentile(firsts, [50, 90])
    return {"client": client, "concurrency": concurrency, "requests": requests,
            "requests_per_s": requests / elapsed, "first_event_mean_ms": 1e3 * float(np.mean(firsts)),
            "first_event_median_ms": 1e3 * float(median), "first_event_p90_ms": 1e3 * float(p90)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--events", type=int, default=40, help="chunks a response streams")
    parser.add_argument("--gap", type=float, default=0.002, help="seconds between a response's chunks")
    parser.add_argument("--requests-per-stream", type=int, default=30)
    parser.add_argument("--clients", default="httpx,aiohttp")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    loads = [int(c) for c in args.concurrency.split(",")]
    clients = args.clients.split(",")
    if min(loads) < 1 or args.events < 1 or args.gap < 0 or args.requests_per_stream < 1:
        parser.error("--concurrency, --events and --requests-per-stream must be positive, --gap >= 0")
    if unknown := set(clients) - set(CLIENTS):
        parser.error(f"unknown client {sorted(unknown)[0]!r}; choose from {', '.join(CLIENTS)}")
    with process_on_a_port(_serve, args.events, args.gap) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        rows = [measure(url, client, c, c * args.requests_per_stream) for c in loads for client in clients]
    print(f"{platform.release()}, {os.cpu_count()} CPUs; {args.events} events a response, one every "
          f"{1e3 * args.gap:g} ms\n")
    print("| client | c | requests/s | first event ms mean | median | p90 |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['client']} | {r['concurrency']} | {r['requests_per_s']:,.0f} | {r['first_event_mean_ms']:.2f} | "
              f"{r['first_event_median_ms']:.2f} | {r['first_event_p90_ms']:.2f} |")
    if args.out:
        report = {"machine": {"kernel": platform.release(), "cpus": os.cpu_count()}, "events": args.events,
                  "gap_s": args.gap, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
