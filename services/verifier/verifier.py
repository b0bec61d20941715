"""The verifier replica: owns the target, the engine and its scheduler loop, and its drafter.

The engine runs in one thread (continuous batching; requests join and leave between steps).
Requests arrive as async calls from the router, each naming its router's output stream; after
every step the loop thread writes one frame to each router with all of its requests' new outputs
(`output_stream`), and a call returns once its request has ended. Cancelling a call cancels the
request in the engine, which frees its KV blocks; the drafter is told to forget it. A router
that goes away has its requests cancelled the same way. With topology=split the drafter is a separate actor in
this replica's placement group, reached over a direct channel; if it dies, the engine continues
target-only (still lossless) and a watcher reattaches the restarted actor.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid

import torch

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.loader import assemble_engine, build_engine, resolve_dtype
from dflash_serve.services.engine.request import RequestOutput, SpecStats
from dflash_serve.services.engine.sampling import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.models import TargetModel
from dflash_serve.services.models.checkpoint import read_draft_config, resolve_checkpoint
from dflash_serve.services.verifier.engine_metrics import EngineMetrics, RequestTimings
from dflash_serve.services.verifier.output_stream import ReplyTo, RouterChannel

log = logging.getLogger(__name__)
GAUGE_PERIOD_S = 1.0  # gauges are set again this often (Ray exports what was recorded lately)


def spawn_drafter_actor(config: ServeConfig) -> tuple:
    """The drafter actor, in bundle 1 of this replica's placement group (same node), on this
    replica's GPU or (drafter_placement own_gpu) on one of its own; Ray restarts it if it dies."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from dflash_serve.services.drafter.actor import RAY_NOSET_CUDA_VISIBLE_DEVICES, DrafterActor

    pg = get_current_placement_group()
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1) if pg is not None else None
    name = f"dflash-drafter-{uuid.uuid4().hex[:8]}"
    cfg = config.engine
    options = dict(name=name, max_restarts=-1, num_cpus=DRAFTER_CPUS, scheduling_strategy=strategy)
    verifier_gpu_ids = None
    if cfg.device.startswith("cuda"):
        # The drafter sees this replica's GPUs first, as this replica does (CUDA IPC handles then
        # open there under the same index), then its own GPU if it has one; it sets that itself,
        # knowing its own GPU only once placed, so Ray must not set CUDA_VISIBLE_DEVICES for it.
        options["num_gpus"] = config.gpus_per_drafter
        options["runtime_env"] = {"env_vars": {RAY_NOSET_CUDA_VISIBLE_DEVICES: "1"}}
        verifier_gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
    actor = ray.remote(DrafterActor).options(**options).remote(cfg.drafter, cfg.device, cfg.dtype, cfg.drafter_revision,
                                                               verifier_gpu_ids=verifier_gpu_ids)
    return actor, name


def check_same_node(drafter_actor) -> None:
    """Refuses a drafter on another node than this verifier: the buffers they share (CUDA IPC,
    POSIX shared memory) exist on one host only."""
    import ray

    here, there = ray.get_runtime_context().get_node_id(), ray.get(drafter_actor.node_id.remote(), timeout=600)
    if there != here:
        raise RuntimeError(f"the drafter actor runs on node {there} and its verifier on node {here}: a verifier and "
                           "its drafter must share a node (they share GPU and host memory); place them with one "
                           "STRICT_PACK placement group, as build_app does")


DRAFTER_CPUS = 0.5


class Verifier:
    def __init__(self, config: dict, *, drafter_actor=None, metrics=None):
        self.config = ServeConfig.from_dict(config)
        engine_cfg = self.config.engine
        self.drafter_actor = drafter_actor
        self._shared = []  # shared buffers the drafter maps; alive as long as this replica
        self._remote_proposer = None
        if self.config.topology == "colocated":
            self.engine = build_engine(engine_cfg)
        else:
            import ray

            from dflash_serve.services.engine.loader import load_tokenizer, log_models

            log_models(engine_cfg)
            draft_cfg = read_draft_config(resolve_checkpoint(engine_cfg.drafter, engine_cfg.drafter_revision))
            self.drafter_actor_name = None
            if self.drafter_actor is None:  # first: it loads its weights while the target loads
                self.drafter_actor, self.drafter_actor_name = spawn_drafter_actor(self.config)
            address = self.drafter_actor.address.remote()
            device = torch.device(engine_cfg.device)
            dtype = resolve_dtype(engine_cfg.dtype, device)
            target = TargetModel.from_pretrained(engine_cfg.target, draft_cfg.target_layer_ids, dtype=dtype,
                                                 device=device, revision=engine_cfg.target_revision)
            tokenizer, eos = load_tokenizer(engine_cfg)
            address = ray.get(address, timeout=600)  # the drafter's weights are on the GPU: size KV after
            check_same_node(self.drafter_actor)
            self.engine = assemble_engine(engine_cfg, target, None, tokenizer=tokenizer, eos_token_ids=eos,
                                          remote_drafter=draft_cfg,
                                          remote_drafter_kv_here=self.config.drafter_placement == "shared")
            self.draft_block_size = draft_cfg.block_size
            self._pending_address = None  # a restarted drafter's address, while it is asked for
            self._connect_drafter(address)
        if metrics is not None and engine_cfg.drafter:
            for position in range(getattr(self, "draft_block_size", self.engine.block_size) - 1):
                metrics.start_at_zero("dflash_spec_decode_num_accepted_tokens_per_pos", position=str(position))
        self.metrics = EngineMetrics(metrics) if metrics is not None else None  # recorded off the engine's thread
        self._commands: queue.Queue = queue.Queue()
        self._channels: dict[ReplyTo, RouterChannel] = {}  # by router, reused (the event loop's)
        self._open_channels: set[RouterChannel] = set()  # flushed after every step (the engine thread's)
        self._requests: dict[str, _Call] = {}  # the calls of requests not yet finished
        self._arrivals: dict[str, float] = {}
        self._last_emit: dict[str, float] = {}
        self._stop = threading.Event()
        self._loop_error = ""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- drafter ---------------------------------------------------------------------------------

    def _connect_drafter(self, address) -> None:
        from dflash_serve.services.verifier.remote_drafter import RemoteProposer

        cfg = self.config.engine
        capacity = cfg.max_prefill_tokens + cfg.max_num_seqs * self.draft_block_size * 2
        for buffer in self._shared:
            buffer.close()
        self._shared = []
        proposer = RemoteProposer.connect(
            address, target=self.engine.runner.target, block_size=self.draft_block_size,
            kv_block_size=cfg.kv_block_size, num_kv_blocks=self.engine.runner.pool.k.shape[1],
            capacity_rows=capacity, max_num_seqs=cfg.max_num_seqs, shared=self._shared, graphs=self.engine.graphs,
            draft_groups=2 if self.config.drafter_placement == "own_gpu" else 1,
        )
        self.engine.attach_proposer(proposer)
        self._remote_proposer = proposer

    def _reattach_if_lost(self) -> None:
        """Called between steps: after a drafter loss, reconnect once the restarted actor answers.
        Never blocks the loop (requests keep decoding target-only meanwhile)."""
        import ray

        if self.drafter_actor is None or self.engine.proposer is not None:
            return
        if self._pending_address is None:
            if time.monotonic() >= getattr(self, "_next_reattach", 0.0):
                self._pending_address = self.drafter_actor.address.remote()
            return
        if not ray.wait([self._pending_address], timeout=0)[0]:
            return
        ref, self._pending_address = self._pending_address, None
        self._next_reattach = time.monotonic() + 1.0
        try:
            self._connect_drafter(ray.get(ref))
            log.info("drafter reattached; speculative decoding resumed")
        except Exception as err:  # noqa: BLE001 - the actor is still restarting; try again later
            log.info("drafter not back yet: %s", err)

    # -- the engine loop -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - nothing may leave requests waiting forever
            self._loop_error = f"{type(err).__name__}: {err}"
            log.exception("the engine loop stopped; this replica fails its health check from now on")
            for request_id in list(self._requests):  # their streams end with the reason
                self._deliver(RequestOutput(request_id, [], "", True, FinishReason.ERROR, 0, 0, SpecStats(),
                                            error=f"the engine loop stopped: {self._loop_error}"))
            self._flush_outputs()

    def _loop(self) -> None:
        losses = preemptions = queries = hits = 0
        next_gauges = 0.0
        while not self._stop.is_set():
            if self.metrics is not None and time.monotonic() >= next_gauges:  # also idle: a gauge set once is not exported
                self._queue_gauges()
                next_gauges = time.monotonic() + GAUGE_PERIOD_S
            try:
                while True:
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            if self.config.topology == "split":
                self._reattach_if_lost()
            if not self.engine.has_unfinished():
                self._flush_outputs()  # bytes a router's socket did not take at the last step
                try:
                    self._commands.get(timeout=0.05)()
                except queue.Empty:
                    pass
                continue
            outputs = self.engine.step()
            scheduler = self.engine.scheduler
            if self.metrics is not None:  # EngineMetrics.count skips zeros
                self.metrics.count("dflash_drafter_restarts", self.engine.proposer_losses - losses)
                self.metrics.count("dflash_num_preemptions", scheduler.num_preemptions - preemptions)
                self.metrics.count("dflash_prefix_cache_queries", scheduler.prefix_cache_queries - queries)
                self.metrics.count("dflash_prefix_cache_hits", scheduler.prefix_cache_hits - hits)
                self._queue_token_gaps(outputs)
            losses, preemptions = self.engine.proposer_losses, scheduler.num_preemptions
            queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
            for out in outputs:
                self._deliver(out)
            self._flush_outputs()
            self._queue_step_metrics()

    def _deliver(self, out: RequestOutput) -> None:
        call = self._requests.get(out.request_id)
        if call is not None:
            call.channel.add(out)
        if out.finished:
            self._requests.pop(out.request_id, None)
            self._last_emit.pop(out.request_id, None)
            self._record_request(out)
            self.engine.release(out.request_id)
            if call is not None:
                call.channel.requests.discard(out.request_id)
                call.settle(call.channel.stream_id)

    def _flush_outputs(self) -> None:
        """One frame to each router with this step's outputs; a router gone has its requests cancelled."""
        for channel in list(self._open_channels):
            if channel.flush():
                continue
            self._open_channels.discard(channel)
            if channel.requests:
                log.warning("the output stream to the router at %s:%d closed (%s): cancelling its %d request(s)",
                            channel.reply_to.host, channel.reply_to.port, channel.closed_because, len(channel.requests))
            for request_id in list(channel.requests):
                call = self._requests.get(request_id)
                self._cancel(request_id)
                if call is not None:
                    call.settle(ConnectionError(f"the output stream to the router closed: {channel.closed_because}"))

    # -- the router's calls ----------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                       reply_to: ReplyTo) -> str:
        """Runs a request whose outputs go to the router at `reply_to`; returns, once the request's
        last output is in that router's channel, the channel's stream id. Cancelling it cancels
        the request; ValueError if the engine refuses it."""
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        channel = self._channels.get(reply_to)
        if channel is None or channel.closed:  # once per router (and again after its channel closed)
            for gone in [key for key, known in self._channels.items() if known.closed]:
                del self._channels[gone]
            # Connecting can wait seconds for a router that is gone: not on the loop every call shares.
            channel = await loop.run_in_executor(None, RouterChannel, reply_to)
            self._channels[reply_to] = channel
        added: asyncio.Future = loop.create_future()
        call = _Call(channel, loop, loop.create_future())

        def add() -> None:
            try:
                if channel.closed:
                    raise ConnectionError(f"the output stream to the router closed: {channel.closed_because}")
                self.engine.add_request(prompt_ids, params, request_id)
            except (ValueError, ConnectionError) as err:
                _settle_from_engine(loop, added, err)
                return
            self._requests[request_id] = call
            channel.requests.add(request_id)
            self._open_channels.add(channel)
            self._arrivals[request_id] = time.monotonic()
            _settle_from_engine(loop, added, None)

        self._commands.put(add)
        try:
            await added
            return await call.done
        except asyncio.CancelledError:
            self._commands.put(lambda: self._cancel(request_id))
            raise

    def _cancel(self, request_id: str) -> None:
        if self.engine.cancel(request_id) and self.metrics is not None:
            self.metrics.request_finished(FinishReason.CANCELLED)
        call = self._requests.pop(request_id, None)
        if call is not None:
            call.channel.requests.discard(request_id)
        for table in (self._arrivals, self._last_emit):
            table.pop(request_id, None)
        self.engine.release(request_id)

    def model_info(self) -> dict:
        cfg = self.config.engine
        return {
            "target": cfg.target,
            "drafter": cfg.drafter or "",
            "target_revision": cfg.target_revision or "",
            "drafter_revision": cfg.drafter_revision or "",
            "block_size": getattr(self, "draft_block_size", self.engine.block_size),
            "max_model_len": self.engine.max_model_len,
            "max_tokens_limit": cfg.max_tokens_limit,
            "vocab_size": self.engine.vocab_size,
            "topology": self.config.topology,
        }

    def check_health(self) -> None:
        """Raises when this replica can no longer serve (Serve then replaces it, and the router
        reports NOT_SERVING meanwhile): its engine loop stopped, or its GPU holds a sticky error
        (after one, every CUDA call of the process fails)."""
        # The error is set before the loop's thread ends the requests it held, and so before it exits.
        if self._loop_error or not self._thread.is_alive():
            raise RuntimeError(f"the engine loop stopped: {self._loop_error or 'it was shut down'}")
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def stats(self) -> dict:
        """Engine state for health checks and tests."""
        engine = self.engine
        return {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "kv_free_blocks": engine.allocator.num_free,
            "kv_blocks": engine.allocator.num_blocks,
            "speculative": engine.proposer is not None,
            "drafter_losses": engine.proposer_losses,
            "drafter_actor": getattr(self, "drafter_actor_name", None),
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

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.metrics is not None:
            self.metrics.close()
        for buffer in self._shared:
            buffer.close()
        for channel in self._channels.values():
            channel.close()


def _settle_from_engine(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result) -> None:
    """Sets a call's future from the engine's thread, through the call's event loop."""
    try:
        loop.call_soon_threadsafe(_settle, future, result)
    except RuntimeError:  # that loop has ended: nothing awaits the call any more (it must not stop the engine)
        pass


def _settle(future: asyncio.Future, result) -> None:
    """Sets a future on its loop; an exception is raised by it."""
    if future.done():  # its call was cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class _Call:
    """A request's call: the router channel its outputs go to, and the future its call awaits."""

    __slots__ = ("channel", "done", "loop")

    def __init__(self, channel: RouterChannel, loop: asyncio.AbstractEventLoop, done: asyncio.Future):
        self.channel, self.loop, self.done = channel, loop, done

    def settle(self, result) -> None:
        _settle_from_engine(self.loop, self.done, result)
