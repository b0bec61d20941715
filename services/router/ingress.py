"""The router's own servers: gRPC (`dflash.v1.Generation`, `grpc.health.v1.Health`) and HTTP (the
OpenAI API) in the router replica's process, on its event loop, instead of behind Ray Serve's
proxies.

Through a proxy every request is a Serve call from the proxy to the router and every streamed
message a Ray object on its way back: on an H200 that was +4 ms of each first token and, over
HTTP, most of what the served OpenAI API lost at c 32 (BENCHMARKS, the serving path). The sockets
take SO_REUSEPORT, so every router replica of a node listens on the same two ports and the kernel
spreads connections over them (gRPC sets it by default; the HTTP socket is bound here).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from starlette.requests import Request

from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc
from dflash_serve.services.router.openai_api import OpenAIServer
from dflash_serve.services.router.router import Router, RpcFailed

STOP_GRACE_S = 15.0  # in-flight calls get this long to end when the router stops (app.DRAIN_TIMEOUT_S)
WATCH_PERIOD_S = 1.0


class _GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The Router's gRPC methods for grpc.aio: a failed stream ends with its status through abort
    (the Router raises RpcFailed after setting it, which Serve's proxy needs)."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):  # noqa: N802 - gRPC method names
        try:
            async with contextlib.aclosing(self.router.Generate(request, context)) as responses:
                async for response in responses:
                    yield response
        except RpcFailed:
            await context.abort(context.code(), context.details())

    async def Complete(self, request, context):  # noqa: N802
        return await self.router.Complete(request, context)

    async def GetModelInfo(self, request, context):  # noqa: N802
        return await self.router.GetModelInfo(request, context)


class _HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 as the Router answers it; methods a newer grpcio-health-checking adds (List)
    keep the base class's UNIMPLEMENTED."""

    def __init__(self, router: Router):
        self.router = router

    async def Check(self, request, context):  # noqa: N802
        return await self.router.Check(request, context)

    async def Watch(self, request, context):  # noqa: N802
        """grpc.health.v1's stream: the status now, then each change (looked at every WATCH_PERIOD_S)."""
        last = None
        while True:
            response = await self.router.Check(request, context)
            if context.code() not in (None, grpc.StatusCode.OK):  # an unknown service
                await context.abort(context.code(), context.details())
            if response.status != last:
                last = response.status
                yield response
            await asyncio.sleep(WATCH_PERIOD_S)


class RouterIngress:
    """Both servers of one router replica. `bind` takes the ports (raising if it cannot), `serve`
    runs them on the running event loop until `stop`."""

    def __init__(self, router: Router, openai: OpenAIServer):
        self.router = router
        self.openai = openai
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._http_socket: socket.socket | None = None
        self._serving: asyncio.Task | None = None

    def bind(self, http_host: str, grpc_port: int, http_port: int) -> tuple[int, int]:
        """Takes both ports (0: any free one; gRPC on every interface); returns the ports taken."""
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        generation_pb2_grpc.add_GenerationServicer_to_server(_GenerationServicer(self.router), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(_HealthServicer(self.router), self._grpc)
        reflection.enable_server_reflection([generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                                             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME], self._grpc)
        grpc_address = f"[::]:{grpc_port}"
        try:
            grpc_port = self._grpc.add_insecure_port(grpc_address)
        except RuntimeError as err:
            raise RuntimeError(f"the router cannot listen for gRPC on {grpc_address}: {err}") from err
        sock = socket.socket(socket.AF_INET6 if ":" in http_host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((http_host, http_port))
        except OSError as err:
            sock.close()
            raise RuntimeError(f"the router cannot listen for HTTP on {http_host}:{http_port}: {err}") from err
        self._http_socket = sock
        return grpc_port, sock.getsockname()[1]

    async def serve(self) -> None:
        """Runs both servers until `stop` (or one fails)."""
        await self._grpc.start()
        config = uvicorn.Config(self._asgi, interface="asgi3", lifespan="off", access_log=False, log_level="warning",
                                log_config=None, timeout_keep_alive=60)
        self._http = uvicorn.Server(config)
        # Signals are the Ray worker's: uvicorn takes them over when it runs on the main thread.
        self._http.capture_signals = contextlib.nullcontext
        await self._http.serve(sockets=[self._http_socket])

    def start(self) -> asyncio.Task:
        """`serve` as a task of the running event loop."""
        self._serving = asyncio.get_running_loop().create_task(self.serve(), name="router-ingress")
        return self._serving

    def failure(self) -> str | None:
        """Why the servers stopped, if they did (the replica is then unhealthy)."""
        if self._serving is None or not self._serving.done():
            return None
        if self._serving.cancelled():
            return "the router's servers were stopped"
        err = self._serving.exception()
        return f"the router's servers failed: {err!r}" if err else "the router's servers stopped"

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(STOP_GRACE_S)
        if self._serving is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._serving, STOP_GRACE_S)

    async def _asgi(self, scope, receive, send) -> None:
        """The OpenAI API as an ASGI app: the same OpenAIServer that Serve's HTTP proxy calls."""
        if scope["type"] != "http":
            return
        response = await self.openai(Request(scope, receive))
        await response(scope, receive, send)

