"""The verifier's engine process: the engine, its loop, and its outputs' way to the routers.

A verifier replica's own process runs Ray Serve: its event loop, Ray's core-worker threads, the
calls from routers and the proxy, metric pushes. All of them take the GIL, and a round of the
default pair is 1-4 ms of host work, so every millisecond they held it the GPU idled (BENCHMARKS,
the serving path). So the engine has a process of its own, as vLLM's engine core has: the replica
(`Verifier`) starts it, sends it requests and cancellations over a pipe, and hears back once a
step at most; after each step this process writes every request's new outputs straight to the
routers' output streams (`output_stream`). When the replica dies, the pipe's end closes: the
process waits up to `engine_adoption_s` for the next replica on its GPU to adopt it, serving the
requests it holds meanwhile (`adoption`), and exits if none does; with `engine_adoption_s` 0 it
dies with the replica (PR_SET_PDEATHSIG), which frees its GPU and closes its routers' streams at once.

The pipe carries pickled lists of messages, one list a send:
  replica -> engine: ("config", dict, record_metrics, intake_host) first, then ("drafter", address) |
                     ("add", request_id, prompt_ids, params, reply_to) | ("cancel", request_id) |
                     ("stats", token) | ("stop",)
  engine -> replica: ("ready", info) | ("failed", text) | ("ended", request_id, stream_id, error) |
                     ("stats", token, dict) | ("metrics", events) | ("drafter_wanted",) | ("log", record) |
                     ("loop_error", text)
An `ended` error is (exception type name, message); `metrics` carries `MetricEvents`' events;
`drafter_wanted`: a split engine has no drafter attached (at its start, or after the drafter died), and
the replica answers with ("drafter", address) once its drafter actor is up.
A replica that adopts an orphan sends ("adopt", identity) first instead, and hears ("ready", info)
or ("refused", why) (`adoption`).

Routers may also skip the replica: the loop listens for their direct intakes (`output_stream`), at
the address `ready` reports, and reads their requests and cancellations between steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import logging.handlers
import os
import secrets
import selectors
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.request import RequestOutput, SpecStats
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.process_control import die_with_parent
from dflash_serve.services.verifier import adoption
from dflash_serve.services.verifier.engine_metrics import MetricEvents, RequestTimings
from dflash_serve.services.verifier.output_stream import (
    LOOP_STOPPED,
    IntakeConnection,
    RouterChannel,
    StreamAddress,
    sampling_from_proto,
)

# By name, not __name__: run as `python -m`, this module is __main__, outside the logger tree whose
# records go to the replica (`main`), and its records were lost.
log = logging.getLogger("dflash_serve.services.verifier.engine_process")
GAUGE_PERIOD_S = 1.0  # gauges are set again this often (Ray exports what was recorded lately)
METRICS_PERIOD_S = 0.1  # metric events go to the replica this often (Ray exports every few seconds)
IDLE_WAIT_S = 0.05  # how long an idle loop waits for a message before it looks at its streams again
HEALTH_PERIOD_S = 1.0  # an idle GPU is synchronized this often: a sticky CUDA error then fails the loop
CONNECTING_WAIT_S = 0.001  # the idle wait while a router's stream is being opened
INTAKE_HELLO_TIMEOUT_S = 5.0  # a connection to the intake must say who it is within this
# The start-up work left once the engine answers (`Engine.warm_up_next`: the CUDA graphs, a bucket at
# a time, then a drafter's round costs, a timed round at a time) goes on back to back while the engine
# is idle, and under load a piece every this often (a round bucket takes ~0.5 s on an H200, a prefill
# one ~0.05; a timed round ≤ 1 s on a CPU).
WARM_UP_PERIOD_S = 1.0


class Pipe:
    """This process's end of the pipe; `send` may be called from any thread (logging does)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, messages: list) -> None:
        with self._lock:
            self.conn.send(messages)


class ReplicaGone(Exception):
    """The replica's end of the pipe closed: it exited or was killed."""


class NotAdopted(Exception):
    """An orphan's time to be adopted ran out, or a replica of another identity refused it."""


class EngineLoop:
    """Continuous batching over the engine: requests join and leave between steps. After every
    step, one frame to each router with all of its requests' new outputs, and one message to the
    replica with the calls that ended (and, every METRICS_PERIOD_S, the metric events)."""

    def __init__(self, engine, pipe: Pipe, config: ServeConfig, *, record_metrics: bool, intake_host: str,
                 draft_block_size: int = 0, identity: str = ""):
        """intake_host: the address routers reach this loop's direct intake at; identity: what a
        replica adopting this process must offer (`adoption.identity`)."""
        self.engine = engine
        self.pipe = pipe
        self.config = config
        self.identity = identity
        self._orphan: adoption.OrphanListener | None = None  # listening for a replica to adopt it
        self._orphaned_at = 0.0
        self.draft_block_size = draft_block_size
        self.metrics = MetricEvents() if record_metrics else None
        self._shared = []  # shared buffers the drafter maps; alive as long as this process
        self._remote_proposer = None
        self._drafter_asked = False  # ("drafter_wanted",) sent, no address back yet
        self._replies: list = []  # messages for the replica, sent once a step
        self._channels: dict[StreamAddress, RouterChannel] = {}  # by router, reused
        # Routers' streams being opened, with the adds waiting for them.
        self._connecting: dict[StreamAddress, tuple[concurrent.futures.Future, list[tuple]]] = {}
        self._connector = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="router-connect")
        self._open_channels: set[RouterChannel] = set()  # flushed after every step
        self._requests: dict[str, RouterChannel] = {}  # requests not yet finished, and their router's channel
        self._arrivals: dict[str, float] = {}
        self._last_emit: dict[str, float] = {}
        self._stopping = False
        # What the loop waits on between steps: the replica's pipe, the intake's listener, the intakes.
        self._selector = selectors.DefaultSelector()
        self._selector.register(pipe.conn, selectors.EVENT_READ)
        self._intake_server = socket.create_server((intake_host, 0))
        self._intake_server.setblocking(False)
        self._selector.register(self._intake_server, selectors.EVENT_READ)
        self.intake_address = StreamAddress(intake_host, self._intake_server.getsockname()[1], secrets.token_bytes(16))
        self._intakes: dict[RouterChannel, IntakeConnection] = {}  # by the channel their outputs go back on

    def info(self) -> dict:
        """What the replica answers for model_info without asking this process, and where routers
        reach its direct intake."""
        return {"block_size": self.draft_block_size or self.engine.block_size,
                "max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "intake": self.intake_address}

    # -- the drafter (split topology) ------------------------------------------------------------

    def connect_drafter(self, address) -> None:
        from dflash_serve.services.verifier.remote_drafter import RemoteProposer

        cfg = self.config.engine
        capacity = cfg.max_prefill_tokens + cfg.max_num_seqs * self.draft_block_size * 2
        for buffer in self._shared:
            buffer.close()
        self._shared = []
        proposer = RemoteProposer.connect(
            address, target=self.engine.runner.target, block_size=self.draft_block_size,
            kv_block_size=cfg.kv_block_size, num_kv_blocks=self.engine.runner.pool.num_blocks,
            capacity_rows=capacity, max_num_seqs=cfg.max_num_seqs, shared=self._shared, graphs=self.engine.graphs,
            draft_groups=2 if self.config.drafter_placement == "own_gpu" else 1,
        )
        # At a first start its round costs are still to measure: the loop does, between steps.
        self.engine.attach_when_measured(proposer)
        self._remote_proposer = proposer
        self._drafter_asked = False

    def _attach_drafter(self, address) -> None:
        """The drafter actor's address, which the replica asked it for once it was up (at the start,
        after the drafter's death, after an adoption)."""
        try:
            self.connect_drafter(address)
        except Exception as err:  # noqa: BLE001 - the actor is still restarting; the replica asks again
            log.info("drafter not back yet: %s", err)
            self._drafter_asked = False

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        except ReplicaGone:
            log.info("the verifier replica is gone: the engine process exits")
        except NotAdopted as why:
            log.info("not adopted (%s): the engine process exits", why)
        except BaseException as err:  # noqa: BLE001 - nothing may leave requests waiting forever
            text = f"{type(err).__name__}: {err}"
            log.exception("the engine loop stopped; this replica fails its health check from now on")
            for request_id in list(self._requests):  # their streams end with the reason
                self._deliver(RequestOutput(request_id, [], "", True, FinishReason.ERROR, 0, 0, SpecStats(),
                                            error=f"{LOOP_STOPPED}{text}"))
            self._flush_outputs()
            self._replies.append(("loop_error", text))
            self._send_replies(metrics=True)
        finally:
            self._connector.shutdown(wait=False, cancel_futures=True)
            for buffer in self._shared:
                buffer.close()
            for channel in (*self._channels.values(), *self._intakes):
                channel.close()
            self._intake_server.close()
            if self._orphan is not None:
                self._orphan.close()

    def _loop(self) -> None:
        engine = self.engine
        losses = preemptions = queries = hits = 0
        next_gauges = next_health = next_metrics = next_warm_up = 0.0
        started = time.perf_counter()
        while not self._stopping:
            now = time.monotonic()
            if now >= next_gauges:  # also idle: a gauge set once is not exported
                if self.metrics is not None:
                    self._queue_gauges()
                self._drop_silent_intakes(now)
                if self._orphan is not None:
                    if now - self._orphaned_at > self.config.engine_adoption_s:
                        raise NotAdopted(f"no replica adopted it within {self.config.engine_adoption_s:g} s")
                    if adoption.cluster_gone():
                        raise NotAdopted("its Ray node ended")
                next_gauges = now + GAUGE_PERIOD_S
            busy = engine.has_unfinished()
            if engine.warming_up and (not busy or now >= next_warm_up):
                capturing = engine.graphs_pending
                engine.warm_up_next()
                next_warm_up = time.monotonic() + WARM_UP_PERIOD_S
                if capturing and not engine.graphs_pending:
                    log.info("CUDA graphs captured in %.1f s after the engine answered", time.perf_counter() - started)
                busy = True  # look for messages without waiting: more to do, or what came meanwhile
            self._read_messages(0 if busy else CONNECTING_WAIT_S if self._connecting else IDLE_WAIT_S)
            self._admit_connected()
            drafterless = engine.proposer is None and not engine.measuring_costs
            if drafterless and self.draft_block_size and not self._drafter_asked:
                self._replies.append(("drafter_wanted",))  # none yet, or it died: target-only meanwhile
                self._drafter_asked = True
            if not engine.has_unfinished():
                self._flush_outputs()  # bytes a router's socket did not take at the last step
                if engine.device.type == "cuda" and now >= next_health:
                    import torch

                    torch.cuda.synchronize(engine.device)
                    next_health = now + HEALTH_PERIOD_S
            else:
                outputs = engine.step()
                scheduler = engine.scheduler
                if self.metrics is not None:  # MetricEvents.count skips zeros
                    self.metrics.count("dflash_drafter_restarts", engine.proposer_losses - losses)
                    self.metrics.count("dflash_num_preemptions", scheduler.num_preemptions - preemptions)
                    self.metrics.count("dflash_prefix_cache_queries", scheduler.prefix_cache_queries - queries)
                    self.metrics.count("dflash_prefix_cache_hits", scheduler.prefix_cache_hits - hits)
                    self._queue_token_gaps(outputs)
                losses, preemptions = engine.proposer_losses, scheduler.num_preemptions
                queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
                for out in outputs:
                    self._deliver(out)
                self._flush_outputs()
                self._queue_step_metrics()
            send_metrics = time.monotonic() >= next_metrics
            if send_metrics:
                next_metrics = time.monotonic() + METRICS_PERIOD_S
            self._send_replies(metrics=send_metrics)

    def _read_messages(self, timeout: float) -> None:
        """Whatever the replica and the direct intakes sent, waiting up to `timeout` for the first."""
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self.pipe.conn:
                self._read_pipe()
            elif key.fileobj is self._orphan:
                self._offered()
            elif key.fileobj is self._intake_server:
                self._accept_intakes()
            else:
                self._read_intake(key.fileobj)

    def _read_pipe(self) -> None:
        conn = self.pipe.conn
        try:
            while True:
                for message in conn.recv():
                    self._handle(message)
                if not conn.poll(0):
                    return
        except (EOFError, OSError) as err:
            self._replica_gone(err)

    # -- adoption (`adoption`) -------------------------------------------------------------------

    def _replica_gone(self, err: Exception) -> None:
        """The pipe closed: wait for a new replica to adopt this process, or (engine_adoption_s 0) end."""
        if self.config.engine_adoption_s <= 0:
            raise ReplicaGone() from err
        self._selector.unregister(self.pipe.conn)
        self.pipe.conn.close()
        self._replies.clear()
        # The requests that came through the replica: their Serve calls died with it, and the
        # router retries or fails them; only the routers' direct requests go on.
        for request_id, channel in list(self._requests.items()):
            if not channel.direct:
                self._cancel(request_id)
        for _, adds in self._connecting.values():
            adds.clear()
        try:
            self._orphan = adoption.OrphanListener()
        except OSError as listen_err:
            log.warning("the verifier replica is gone, and no replica can adopt this engine: %s", listen_err)
            raise ReplicaGone() from err
        self._orphaned_at = time.monotonic()
        self._selector.register(self._orphan, selectors.EVENT_READ)
        log.warning("the verifier replica is gone: serving %d request(s) in flight and waiting up to %g s for a new "
                    "replica to adopt this engine (pid %d)", len(self._requests), self.config.engine_adoption_s,
                    os.getpid())

    def _offered(self) -> None:
        """A replica offers to adopt this orphan: it does if their identities match."""
        try:
            conn = self._orphan.accept()
        except OSError:
            return
        if conn is None:
            log.warning("refused a connection to the adoption socket from another user's process")
            return
        try:
            if not conn.poll(adoption.OFFER_TIMEOUT_S):
                raise TimeoutError("no offer")
            kind, identity = conn.recv()
        except (OSError, EOFError, TimeoutError, ValueError) as err:
            log.info("a connection to the adoption socket made no offer: %s", err)
            conn.close()
            return
        if kind != "adopt" or identity != self.identity:
            with contextlib.suppress(OSError):
                conn.send(("refused", "another identity (code, configuration, metrics or intake host)"))
            raise NotAdopted("a new replica with another code or configuration refused it")
        try:
            conn.send(("ready", self.info()))
        except OSError as err:
            log.info("the adopting replica went away: %s", err)
            return
        self._selector.unregister(self._orphan)
        self._orphan.close()
        self._orphan = None
        self.pipe.conn = conn
        self._selector.register(conn, selectors.EVENT_READ)
        self._drafter_asked = False  # the new replica's drafter actor attaches on hearing it
        log.info("adopted by a new verifier replica after %.1f s; serving %d request(s)",
                 time.monotonic() - self._orphaned_at, len(self._requests))

    def _accept_intakes(self) -> None:
        while True:
            try:
                sock, peer = self._intake_server.accept()
            except BlockingIOError:
                return
            intake = IntakeConnection(sock, f"{peer[0]}:{peer[1]}", self.intake_address.token)
            self._intakes[intake.channel] = intake
            self._selector.register(intake, selectors.EVENT_READ)

    def _drop_silent_intakes(self, now: float) -> None:
        """A connection that has not proven itself (its hello) within INTAKE_HELLO_TIMEOUT_S is
        not a router of this application: it holds nothing here for long."""
        silent = [i for i in self._intakes.values() if not i.greeted and now - i.accepted > INTAKE_HELLO_TIMEOUT_S]
        for intake in silent:
            log.warning("closed a connection to the intake from %s: no hello within %.0f s", intake.channel.peer,
                        INTAKE_HELLO_TIMEOUT_S)
            intake.channel.close("no hello")
            self._drop_channel(intake.channel)

    def _read_intake(self, intake: IntakeConnection) -> None:
        try:
            batches = intake.read()
        except ConnectionError as err:
            intake.channel.close(f"the router's intake closed: {err}")
            self._drop_channel(intake.channel)
            return
        channel = intake.channel
        for batch in batches:
            for add in batch.adds:
                self._start(add.request_id, list(add.prompt_ids), sampling_from_proto(add.sampling), channel)
            for request_id in batch.cancels:
                if self._requests.get(request_id) is channel:  # a router cancels its own requests only
                    self._cancel(request_id)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(*message[1:])
        elif kind == "cancel":
            self._cancel(message[1])
        elif kind == "stats":
            self._replies.append(("stats", message[1], self.stats()))
        elif kind == "drafter":
            self._attach_drafter(message[1])
        elif kind == "stop":
            self._stopping = True
        else:
            raise ValueError(f"unknown message from the replica: {kind!r}")

    def _send_replies(self, *, metrics: bool) -> None:
        if metrics and self.metrics is not None and self.metrics.events:
            self._replies.append(("metrics", self.metrics.take()))
        if not self._replies:
            return
        replies, self._replies = self._replies, []
        if self._orphan is not None:  # nobody to tell: a Serve call's end, metrics and stats go unsent
            return
        try:
            self.pipe.send(replies)
        except OSError as err:
            self._replica_gone(err)

    # -- requests --------------------------------------------------------------------------------

    def _add(self, request_id: str, prompt_ids: list[int], params, reply_to: StreamAddress) -> None:
        channel = self._channels.get(reply_to)
        if channel is None or channel.closed:  # once per router (and again after its channel closed),
            # off this thread: connecting can wait seconds for a router that is gone.
            if reply_to not in self._connecting:
                self._flush_outputs()  # a router that hung up is seen now, and dropped
                for gone in [key for key, known in self._channels.items() if known.closed]:
                    del self._channels[gone]
                self._connecting[reply_to] = (self._connector.submit(RouterChannel.connect, reply_to), [])
            self._connecting[reply_to][1].append((request_id, prompt_ids, params))
            return
        self._start(request_id, prompt_ids, params, channel)

    def _admit_connected(self) -> None:
        for reply_to, (future, adds) in list(self._connecting.items()):
            if not future.done():
                continue
            del self._connecting[reply_to]
            try:
                channel = self._channels[reply_to] = future.result()
            except ConnectionError as err:
                for request_id, _, _ in adds:
                    self._replies.append(("ended", request_id, None, ("ConnectionError", str(err))))
                continue
            for request_id, prompt_ids, params in adds:
                self._start(request_id, prompt_ids, params, channel)

    def _start(self, request_id: str, prompt_ids: list[int], params, channel: RouterChannel) -> None:
        if channel.closed:
            error = ("ConnectionError", f"the output stream to the router closed: {channel.closed_because}")
            self._replies.append(("ended", request_id, None, error))
            return
        try:
            self.engine.add_request(prompt_ids, params, request_id)
        except ValueError as err:
            if channel.direct:
                channel.refuse(request_id, str(err))
                self._open_channels.add(channel)
            else:
                self._replies.append(("ended", request_id, None, ("ValueError", str(err))))
            return
        self._requests[request_id] = channel
        channel.requests.add(request_id)
        self._open_channels.add(channel)
        self._arrivals[request_id] = time.monotonic()

    def _deliver(self, out: RequestOutput) -> None:
        channel = self._requests.get(out.request_id)
        if channel is not None:
            channel.add(out)
        if out.finished:
            self._requests.pop(out.request_id, None)
            self._last_emit.pop(out.request_id, None)
            self._record_request(out)
            self.engine.release(out.request_id)
            if channel is not None:
                channel.requests.discard(out.request_id)
                if not channel.direct:  # its Serve call returns
                    self._replies.append(("ended", out.request_id, channel.stream_id, None))

    def _flush_outputs(self) -> None:
        """One frame to each router with this step's outputs; a router gone has its requests cancelled."""
        for channel in list(self._open_channels):
            if not channel.flush():
                self._drop_channel(channel)

    def _drop_channel(self, channel: RouterChannel) -> None:
        """A router's channel closed: its requests are cancelled (their blocks freed at once)."""
        self._open_channels.discard(channel)
        intake = self._intakes.pop(channel, None)
        if intake is not None:
            self._selector.unregister(intake)
        if channel.requests:
            log.warning("the output stream to the router at %s closed (%s): cancelling its %d request(s)",
                        channel.peer, channel.closed_because, len(channel.requests))
        for request_id in list(channel.requests):
            self._cancel(request_id)
            if not channel.direct:
                error = ("ConnectionError", f"the output stream to the router closed: {channel.closed_because}")
                self._replies.append(("ended", request_id, None, error))

    def _cancel(self, request_id: str) -> None:
        if self.engine.cancel(request_id) and self.metrics is not None:
            self.metrics.request_finished(FinishReason.CANCELLED)
        channel = self._requests.pop(request_id, None)
        if channel is not None:
            channel.requests.discard(request_id)
        for table in (self._arrivals, self._last_emit):
            table.pop(request_id, None)
        self.engine.release(request_id)
        for _, adds in self._connecting.values():  # not started yet: it never will be
            adds[:] = [add for add in adds if add[0] != request_id]

    def stats(self) -> dict:
        engine = self.engine
        return {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "kv_free_blocks": engine.allocator.num_free,
            "kv_blocks": engine.allocator.num_blocks,
            "speculative": engine.proposer is not None,
            "graphs_pending": engine.graphs_pending,  # CUDA graphs still to capture (a replica just started)
            "drafter_losses": engine.proposer_losses,
            "router_streams": len(self._channels),  # routers' output streams known (a closed one until the next opens)
            "router_intakes": len(self._intakes),  # routers' direct intakes open
            "engine_pid": os.getpid(),  # the same after a replica adopted this process (`adoption`)
        }

    # -- metrics ---------------------------------------------------------------------------------

    def _queue_token_gaps(self, outputs: list[RequestOutput]) -> None:
        """Each request's time since its last tokens, per token (a round's arrive together)."""
        now, gaps = time.monotonic(), []
        for out in outputs:
            if not out.new_token_ids:
                continue
            last = self._last_emit.get(out.request_id)
            if last is not None:
                gaps.append(((now - last) / len(out.new_token_ids), len(out.new_token_ids)))
            self._last_emit[out.request_id] = now
        if gaps:
            self.metrics.token_gaps(gaps)

    def _queue_step_metrics(self) -> None:
        engine = self.engine
        if self.metrics is None:
            engine.round_log.clear()
            return
        if engine.round_log:
            self.metrics.rounds(list(engine.round_log), speculative=engine.proposer is not None)
            engine.round_log.clear()
        if self._remote_proposer is not None:
            seconds = self._remote_proposer.drain_transport_seconds()
            if seconds:
                self.metrics.phase_seconds("transport", seconds)

    def _queue_gauges(self) -> None:
        engine = self.engine
        self.metrics.gauges({"dflash_num_requests_running": engine.num_running,
                             "dflash_num_requests_waiting": engine.num_waiting,
                             "dflash_kv_cache_usage_perc": engine.kv_usage,
                             "dflash_speculative_enabled": int(engine.proposer is not None)})

    def _record_request(self, out: RequestOutput) -> None:
        arrival = self._arrivals.pop(out.request_id, None)
        seq = self.engine.sequences.get(out.request_id)
        if self.metrics is None or arrival is None or seq is None:
            return
        now, first = time.monotonic(), seq.first_token_time
        self.metrics.request_finished(out.finish_reason or FinishReason.ERROR, RequestTimings(
            prompt_tokens=out.num_prompt_tokens, output_tokens=out.num_output_tokens, e2e=now - arrival,
            queue=None if seq.scheduled_time is None else seq.scheduled_time - arrival,
            ttft=None if first is None else first - arrival,
            tpot=(now - first) / (out.num_output_tokens - 1) if first is not None and out.num_output_tokens > 1
            else None))


# -- building the engine -----------------------------------------------------------------------------


def build_loop(config: ServeConfig, pipe: Pipe, *, record_metrics: bool, intake_host: str,
               identity: str = "") -> EngineLoop:
    """The engine of `config`, its CUDA graphs deferred (`EngineLoop` captures them after the
    engine answers). With topology split it does not wait for the drafter actor, which
    loads meanwhile: its weights' bytes are kept free on a shared GPU, and the replica sends its
    address once it is up (`connect_drafter`); the engine decodes target-only until then."""
    from dflash_serve.services.engine.loader import assemble_engine, build_engine, resolve_dtype

    engine_cfg = config.engine
    if config.topology == "colocated":
        return EngineLoop(build_engine(engine_cfg, defer_warm_up=True), pipe, config, record_metrics=record_metrics,
                          intake_host=intake_host, identity=identity)
    import torch

    from dflash_serve.services.engine.loader import load_tokenizer, log_models
    from dflash_serve.services.models import TargetModel
    from dflash_serve.services.models.checkpoint import count_weights, read_draft_config, resolve_checkpoint

    log_models(engine_cfg)
    draft_folder = resolve_checkpoint(engine_cfg.drafter, engine_cfg.drafter_revision)
    draft_cfg = read_draft_config(draft_folder)
    device = torch.device(engine_cfg.device)
    dtype = resolve_dtype(engine_cfg.dtype, device)
    target = TargetModel.from_pretrained(engine_cfg.target, draft_cfg.target_layer_ids, dtype=dtype,
                                         device=device, revision=engine_cfg.target_revision)
    tokenizer, eos = load_tokenizer(engine_cfg)
    log.info("target loaded")
    shared = config.drafter_placement == "shared"
    drafter_bytes = count_weights(draft_folder) * dtype.itemsize if shared and device.type == "cuda" else 0
    engine = assemble_engine(engine_cfg, target, None, tokenizer=tokenizer, eos_token_ids=eos, remote_drafter=draft_cfg,
                             remote_drafter_kv_here=shared, remote_drafter_bytes=drafter_bytes, defer_warm_up=True)
    return EngineLoop(engine, pipe, config, record_metrics=record_metrics, intake_host=intake_host,
                      draft_block_size=draft_cfg.block_size, identity=identity)


def _receive(conn: Connection) -> list:
    try:
        return conn.recv()
    except (EOFError, OSError) as err:
        raise ReplicaGone() from err


class _PipeLogHandler(logging.StreamHandler):
    """This process's log records, sent to the replica, whose log handlers write them (Serve's
    replica log, where operators look); while no replica has it (an orphan, `adoption`), to
    stderr, which is the dead replica's log file."""

    def __init__(self, pipe: Pipe):
        super().__init__(sys.stderr)
        self.setLevel(logging.INFO)
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s -- %(message)s"))
        self.pipe = pipe
        self._prepare = logging.handlers.QueueHandler(None).prepare  # formats it so that it pickles

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.pipe.send([("log", self._prepare(record))])
        except (OSError, ValueError):  # no replica (ValueError: the pipe was closed here)
            super().emit(record)


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_serve.services.verifier.engine_process FD`: FD is this process's end of
    the replica's socket pair."""
    from dflash_serve.services.gc_freeze import freeze_startup_objects

    argv = sys.argv[1:] if argv is None else argv
    fingerprint = adoption.code_fingerprint()  # of the code this process runs, before anything changes it
    pipe = Pipe(Connection(int(argv[0])))
    ours = logging.getLogger("dflash_serve.services")
    ours.setLevel(logging.INFO)
    ours.handlers = [_PipeLogHandler(pipe)]
    ours.propagate = False
    ours.info("engine process up (pid %d); importing the engine", os.getpid())
    try:
        (message,) = _receive(pipe.conn)
        _, config, record_metrics, intake_host = message
        serve_config = ServeConfig.from_dict(config)
        if serve_config.engine_adoption_s <= 0:
            die_with_parent()
        loop = build_loop(serve_config, pipe, record_metrics=record_metrics, intake_host=intake_host,
                          identity=adoption.identity(config, record_metrics, intake_host, fingerprint))
    except ReplicaGone:
        return 0
    except BaseException:  # noqa: BLE001 - the replica reports it and fails to start
        pipe.send([("failed", traceback.format_exc())])
        return 1
    ours.info("engine ready")
    pipe.send([("ready", loop.info())])
    freeze_startup_objects()
    loop.run()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)  # not the interpreter's teardown: nothing is left to flush, and it takes seconds
