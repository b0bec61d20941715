"""The host's price of one hop: a message's round trip to another process over loopback TCP, made
the ways the served path makes them. The TTFT that serving adds at c 1 (issue 67) is a handful of
such hops (client → router → engine process → router → client) and the wake-ups between them, so
this tells how much of it a machine charges before any of our code runs.

    python -m dflash_serve.services.bench.hop_latency --out hop_latency.json

The echoing process waits in `selectors` between messages, as the engine loop does when idle. The
sender, by mode:
- blocking: blocks in recv for the echo (a process that sleeps between messages: a wake-up each way).
- busy: polls its non-blocking socket (a core spent so that its own wake-up is skipped).
- asyncio: awaits the echo on an asyncio stream (the router's side of every hop).
Per mode: round-trip µs (median, p90, p99) over --messages messages of --bytes bytes, after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

MODES = ("blocking", "busy", "asyncio")
WARMUP = 200


@contextlib.contextmanager
def process_on_a_port(target: Callable, *args) -> Iterator[int]:
    """A spawned helper process `target(port_out, *args)` that listens on a loopback port and sends
    it through `port_out` first; yields the port, and kills the process at the end."""
    context = multiprocessing.get_context("spawn")
    port_in, port_out = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(port_out, *args), daemon=True)
    process.start()
    try:
        yield port_in.recv()
    finally:
        process.kill()
        process.join()


def _echo_forever(port_out) -> None:
    """Echo every connection's bytes back, one connection after another, waiting in a selector."""
    server = socket.create_server(("127.0.0.1", 0))
    port_out.send(server.getsockname()[1])
    port_out.close()
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with selectors.DefaultSelector() as selector, conn:
            selector.register(conn, selectors.EVENT_READ)
            while True:
                selector.select()
                data = conn.recv(1 << 16)
                if not data:
                    break
                conn.sendall(data)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _timed(round_trip: Callable[[], None], messages: int) -> list[float]:
    for _ in range(WARMUP):
        round_trip()
    times = []
    for _ in range(messages):
        t0 = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - t0)
    return times


def _blocking(port: int, message: bytes, messages: int) -> list[float]:
    with _connect(port) as sock:
        def round_trip() -> None:
            sock.sendall(message)
            got = 0
            while got < len(message):
                got += len(sock.recv(1 << 16))

        return _timed(round_trip, messages)


def _busy(port: int, message: bytes, messages: int) -> list[float]:
    with _connect(port) as sock:
        sock.sendall(message)  # connected, before going non-blocking
        got = 0
        while got < len(message):
            got += len(sock.recv(1 << 16))
        sock.setblocking(False)

        def round_trip() -> None:
            sock.send(message)  # a few hundred bytes always fit an empty loopback send buffer
            got = 0
            while got < len(message):
                try:
                    got += len(sock.recv(1 << 16))
                except BlockingIOError:
                    pass

        return _timed(round_trip, messages)


def _asyncio(port: int, message: bytes, messages: int) -> list[float]:
    async def run() -> list[float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(WARMUP + messages):
            t0 = time.perf_counter()
            writer.write(message)
            await reader.readexactly(len(message))
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        writer.close()
        await writer.wait_closed()
        return times

    return asyncio.run(run())


def measure(messages: int, size: int) -> dict:
    """Round-trip µs per mode, against an echoing process of its own."""
    with process_on_a_port(_echo_forever) as port:
        message = os.urandom(size)
        senders = {"blocking": _blocking, "busy": _busy, "asyncio": _asyncio}
        results = {}
        for mode in MODES:
            us = [1e6 * t for t in senders[mode](port, message, messages)]
            median, p90, p99 = np.percentile(us, [50, 90, 99])
            results[mode] = {"median_us": round(float(median), 1), "p90_us": round(float(p90), 1),
                             "p99_us": round(float(p99), 1)}
    return {"machine": {"kernel": platform.release(), "cpus": os.cpu_count()}, "messages": messages, "bytes": size,
            "modes": results}


def table(report: dict) -> str:
    lines = [f"kernel {report['machine']['kernel']}, {report['machine']['cpus']} CPUs; {report['messages']} round "
             f"trips of {report['bytes']} bytes a mode", "", "| sender | median µs | p90 µs | p99 µs |",
             "|---|---:|---:|---:|"]
    for mode, r in report["modes"].items():
        lines.append(f"| {mode} | {r['median_us']:.1f} | {r['p90_us']:.1f} | {r['p99_us']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--bytes", type=int, default=256, help="a message's size (a step's frame for one request "
                                                               "is ~100-300 bytes)")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.messages < 1 or not 1 <= args.bytes <= 1 << 16:
        parser.error("--messages must be positive and --bytes in [1, 65536]")
    report = measure(args.messages, args.bytes)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
