"""The router's direct intake: requests go straight to the verifiers' engine processes over one
connection to each (`output_stream.EngineChannel`), which also brings their outputs back, instead
of one Ray Serve call each (3-5 ms of every first token; BENCHMARKS, the serving path).

Serve still places, health-checks and restarts the verifier replicas; it no longer sees these
requests, so a router takes the direct intake only where the verifier count is fixed (Serve's
autoscaler counts the requests of its calls). The engines are those the replicas registered
(`verifier.intake_registry`), looked up again every REFRESH_PERIOD_S while requests come.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from dflash_serve.services.verifier.output_stream import EngineChannel, OutputListener, StreamAddress

log = logging.getLogger(__name__)
REFRESH_PERIOD_S = 1.0


class DirectIntake:
    def __init__(self, listener: OutputListener, registered: Callable[[], Awaitable[dict[str, StreamAddress]]],
                 forget: Callable[[str], Awaitable[None]]):
        """registered: the engines' intake addresses by replica name; forget: deletes the
        registration of an engine that refuses connections (its replica was killed)."""
        self.listener = listener
        self._registered = registered
        self._forget = forget
        self._channels: dict[str, EngineChannel] = {}  # the registered engines this router reached
        self._refreshed = -math.inf
        self._refreshing: asyncio.Task | None = None

    def pick(self) -> EngineChannel | None:
        """The engine with the fewest of this router's requests, or None while none is reachable
        (the request then goes through Serve). Starts a look for new engines when one is due."""
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_PERIOD_S and (self._refreshing is None or self._refreshing.done()):
            self._refreshed = now
            self._refreshing = asyncio.create_task(self._refresh())
        reachable = [channel for channel in self._channels.values() if not channel.closed]
        return min(reachable, key=lambda channel: len(channel.requests), default=None)

    async def _refresh(self) -> None:
        try:
            registered = await self._registered()
        except Exception:  # noqa: BLE001 - requests go through Serve meanwhile; the next look may work
            log.warning("could not list the verifiers' intakes", exc_info=True)
            return
        for name in [name for name, channel in self._channels.items() if channel.closed or name not in registered]:
            # A deregistered engine's open requests finish on their connection, which its engine closes.
            del self._channels[name]
        for name, address in registered.items():
            if name in self._channels:
                continue
            try:
                self._channels[name] = await self.listener.connect(address)
            except ConnectionRefusedError:
                log.info("the intake of verifier %s at %s:%d refuses connections: its replica is gone", name,
                         address.host, address.port)
                try:
                    await self._forget(name)
                except Exception:  # noqa: BLE001 - a later look tries again
                    log.warning("could not delete the registration of verifier %s", name, exc_info=True)
            except (OSError, TimeoutError) as err:
                log.warning("cannot reach the intake of verifier %s at %s:%d: %s", name, address.host, address.port,
                            err)
