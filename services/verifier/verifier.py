"""The verifier replica: its engine's process, and its drafter actor.

The engine, its loop and the target run in a process of their own (`engine_process`), which this
replica starts and which dies with it. Requests arrive as async calls from the router, each
naming its router's output stream; they go to the engine's process over a pipe, whose loop
writes every step's outputs to the routers itself, and a call returns once its request has ended.
Cancelling a call cancels the request in the engine, which frees its KV blocks; the drafter is
told to forget it. A router that goes away has its requests cancelled the same way. With
topology=split the drafter is a separate actor in this replica's placement group, reached by the
engine's process over a direct channel; if it dies, the engine continues target-only (still
lossless), and this replica hands it the restarted actor's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.verifier import adoption, engine_forkserver
from dflash_serve.services.verifier.engine_metrics import EngineMetrics

if TYPE_CHECKING:  # this module imports no torch: the replica's process starts its engine's process first
    from dflash_serve.services.verifier.output_stream import StreamAddress

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 30.0  # the engine's process answers between steps
ERRORS = {"ValueError": ValueError, "ConnectionError": ConnectionError}  # what an ended call may raise


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
    def __init__(self, config: dict, *, drafter_actor=None, metrics=None, intake_host: str = "127.0.0.1"):
        """intake_host: the address routers reach the engine process's direct intake at (`intake_address`)."""
        log.info("replica starting (pid %d)", os.getpid())  # a restart's first milestone (bench.restart)
        self.config = ServeConfig.from_dict(config)
        engine_cfg = self.config.engine
        self.drafter_actor = drafter_actor
        self.drafter_actor_name = None
        if self.config.topology == "split" and self.drafter_actor is None:  # first: it loads while the target does
            self.drafter_actor, self.drafter_actor_name = spawn_drafter_actor(self.config)
        config_dict = self.config.to_dict()
        adopted = self.config.engine_adoption_s > 0 and EngineProcess.adopt(
            adoption.identity(config_dict, metrics is not None, intake_host, adoption.code_fingerprint()))
        if adopted:
            # Its drafter died with the last replica: the engine says so (drafter_wanted) and this
            # replica's actor attaches once up (`_attach_drafter`), target-only until then.
            self._process, self.info = adopted
            log.info("adopted the engine process (pid %d) of a replica that died: its models, KV cache and "
                     "requests in flight", self._process.pid)
        else:
            self._start_engine(config_dict, metrics is not None, intake_host)
        if metrics is not None and engine_cfg.drafter:
            for position in range(self.info["block_size"] - 1):
                metrics.start_at_zero("dflash_spec_decode_num_accepted_tokens_per_pos", position=str(position))
        self.metrics = EngineMetrics(metrics) if metrics is not None else None  # recorded off the reading thread
        self._calls: dict[str, _Call] = {}  # the calls of requests not yet ended
        self._stats: dict[int, _Call] = {}
        self._tokens = itertools.count()
        self._loop_error = ""
        self._attaching = threading.Lock()
        self._drafter_sent = False  # an address sent to the engine: a later one is a restarted actor's
        self._reader = threading.Thread(target=self._read, name="engine-replies", daemon=True)
        self._reader.start()

    def _start_engine(self, config_dict: dict, record_metrics: bool, intake_host: str) -> None:
        """With topology split the engine does not wait for the drafter actor: it asks for it
        (drafter_wanted) once built, and decodes target-only until it attaches."""
        self._process = EngineProcess.spawn(detached=self.config.engine_adoption_s > 0)
        try:
            self._process.send([("config", config_dict, record_metrics, intake_host)])
            self.info = self._process.wait_ready()
        except BaseException:
            self._process.stop()
            raise

    # -- the router's calls ----------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params, request_id: str | None, reply_to: StreamAddress) -> str:
        """Runs a request whose outputs go to the router at `reply_to`; returns, once the request's
        last output is in that router's channel, the channel's stream id. Cancelling it cancels
        the request; ValueError if the engine refuses it."""
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        call = self._calls[request_id] = _Call(loop, loop.create_future())
        try:
            self._send([("add", request_id, prompt_ids, params, reply_to)])
            return await call.done
        except asyncio.CancelledError:
            self._send([("cancel", request_id)])
            raise
        finally:
            self._calls.pop(request_id, None)

    async def stats(self) -> dict:
        """Engine state for health checks and tests."""
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        call = self._stats[token] = _Call(loop, loop.create_future())
        try:
            self._send([("stats", token)])
            stats = await asyncio.wait_for(call.done, STATS_TIMEOUT_S)
        finally:
            self._stats.pop(token, None)
        return {**stats, "drafter_actor": self.drafter_actor_name}

    @property
    def intake_address(self) -> StreamAddress:
        """Where a router reaches the engine process directly: its requests then skip this replica."""
        return self.info["intake"]

    def model_info(self) -> dict:
        cfg = self.config.engine
        return {
            "target": cfg.target,
            "drafter": cfg.drafter or "",
            "target_revision": cfg.target_revision or "",
            "drafter_revision": cfg.drafter_revision or "",
            "block_size": self.info["block_size"],
            "max_model_len": self.info["max_model_len"],
            "max_tokens_limit": cfg.max_tokens_limit,
            "vocab_size": self.info["vocab_size"],
            "topology": self.config.topology,
        }

    def check_health(self) -> None:
        """Raises when this replica can no longer serve (Serve then replaces it, and the router
        reports NOT_SERVING meanwhile): its engine loop stopped (a sticky CUDA error, after which
        every CUDA call of the process fails, stops it too), or its process exited."""
        if self._loop_error:
            raise RuntimeError(f"the engine loop stopped: {self._loop_error}")
        if not self._process.alive:
            raise RuntimeError(f"the engine process exited: {self._process.describe_exit()}")

    def _send(self, messages: list) -> None:
        try:
            self._process.send(messages)
        except OSError as err:
            raise _stream_lost(f"the engine process of this verifier replica is gone ({err}): retry") from err

    # -- the engine process's replies (this replica's reading thread) ----------------------------

    def _read(self) -> None:
        handlers = {"ended": self._ended, "stats": self._stats_reply, "metrics": self._metrics,
                    "drafter_wanted": self._drafter_wanted, "log": _log_record, "loop_error": self._loop_stopped}
        while True:
            try:
                messages = self._process.conn.recv()
            except (EOFError, OSError):
                break
            for message in messages:
                handlers[message[0]](*message[1:])
        # The process is gone: its routers' streams closed with it; no call may wait forever.
        self._process.wait_exited()
        lost = _stream_lost(f"the engine process of this verifier replica exited ({self._process.describe_exit()}): "
                          "retry")
        for calls in (self._calls, self._stats):
            for call in list(calls.values()):
                call.settle(lost)

    def _ended(self, request_id: str, stream_id: str | None, error: tuple[str, str] | None) -> None:
        call = self._calls.pop(request_id, None)
        if call is not None:
            call.settle(stream_id if error is None else ERRORS[error[0]](error[1]))

    def _stats_reply(self, token: int, stats: dict) -> None:
        call = self._stats.pop(token, None)
        if call is not None:
            call.settle(stats)

    def _metrics(self, events: list) -> None:
        if self.metrics is not None:
            self.metrics.add(events)

    def _loop_stopped(self, text: str) -> None:
        self._loop_error = text

    def _drafter_wanted(self) -> None:
        """The engine has no drafter (it just started, or its drafter died): ask the actor (which Ray
        restarts) for its address, off this thread, and hand it over; the engine decodes
        target-only meanwhile and asks again if that address does not work yet."""
        if self.drafter_actor is not None and self._attaching.acquire(blocking=False):
            threading.Thread(target=self._attach_drafter, name="drafter-attach", daemon=True).start()

    def _attach_drafter(self) -> None:
        import ray

        try:
            if self._drafter_sent:
                time.sleep(1.0)  # a restarting actor is not back sooner
            while self._process.alive:
                try:
                    address = ray.get(self.drafter_actor.address.remote(), timeout=600)
                    check_same_node(self.drafter_actor)
                except RuntimeError:  # on another node: it can never attach
                    log.exception("the drafter actor cannot attach; decoding target-only")
                    return
                except Exception as err:  # noqa: BLE001 - still starting or restarting: ask again
                    log.info("drafter not up yet: %s", err)
                    time.sleep(1.0)  # an actor whose start fails fails at once: no busy loop
                    continue
                log.info("drafter actor's address received")
                self._send([("drafter", address)])
                self._drafter_sent = True
                return
        except ConnectionError:  # _send's: the engine's process is gone
            pass
        finally:
            self._attaching.release()

    def shutdown(self) -> None:
        self._process.stop()
        self._reader.join(timeout=5)
        if self.metrics is not None:
            self.metrics.close()


class EngineProcess:
    """The engine's process and this replica's end of its pipe: one it started
    (`python -m ...engine_process FD`, `spawn`), or the orphan of a replica that died (`adopt`)."""

    def __init__(self, conn: Connection, pid: int, popen: subprocess.Popen | None = None):
        self.conn = conn
        self.pid = pid
        self.popen = popen  # None: not a child of this process (detached, or adopted)
        self._send_lock = threading.Lock()

    @classmethod
    def spawn(cls, *, detached: bool) -> EngineProcess:
        """Start one. detached (engine_adoption_s > 0): not a child of this process but of init
        (started through a shell that exits), in a session of its own, so that Ray, which kills a
        worker's children and process group when it ends it (ray.kill, a failed health check),
        leaves it to be adopted; forked by `dflash serve`'s `engine_forkserver` where there is one,
        which has imported the engine already. Otherwise a thread of this replica starts it and waits
        for it, for as long as it lives: the process asks to be killed when that thread ends
        (PR_SET_PDEATHSIG names the thread, not the process), which happens when this replica's
        process dies, however it dies."""
        ours, theirs = socket.socketpair()
        # The child finds dflash_serve and its dependencies where this process does (a Ray
        # runtime_env or a test may have put them on sys.path only).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        command = [sys.executable, "-m", "dflash_serve.services.verifier.engine_process", str(theirs.fileno())]
        if detached:
            try:
                forked = engine_forkserver.fork_engine(theirs.fileno(), env)  # imported already: seconds sooner
                if forked is not None:
                    return cls(Connection(ours.detach()), forked)
                # Its pid comes back on the pipe (fd 3); its own output goes where this process's errors go.
                shell = subprocess.run(["/bin/sh", "-c", 'exec 3>&1 1>&2; "$@" </dev/null 3>&- & echo $! >&3', "sh",
                                        *command], pass_fds=(theirs.fileno(),), env=env, stdout=subprocess.PIPE,
                                       start_new_session=True, check=True)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            return cls(Connection(ours.detach()), int(shell.stdout))
        started: list = []
        ready = threading.Event()

        def start_and_wait() -> None:
            try:
                started.append(subprocess.Popen(command, pass_fds=(theirs.fileno(),), env=env))
            except BaseException as err:  # noqa: BLE001 - the constructor raises it
                started.append(err)
            ready.set()
            if isinstance(started[0], subprocess.Popen):
                started[0].wait()

        watcher = threading.Thread(target=start_and_wait, name="engine-process", daemon=True)
        watcher.start()
        ready.wait()
        theirs.close()
        if isinstance(started[0], BaseException):
            ours.close()
            raise started[0]
        popen: subprocess.Popen = started[0]
        return cls(Connection(ours.detach()), popen.pid, popen)

    @classmethod
    def adopt(cls, identity: str) -> tuple[EngineProcess, dict] | None:
        """An orphan of this identity on this node and GPU, and its `ready` info (`adoption.offer`)."""
        found = adoption.offer(identity)
        if found is None:
            return None
        conn, pid, info = found
        return cls(conn, pid), info

    @property
    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return not adoption.wait_exit(self.pid, 0)

    def describe_exit(self) -> str:
        if self.popen is None:
            return "it still runs" if self.alive else "it exited (not a child of this process: its status is unknown here)"
        code = self.popen.poll()
        if code is None:
            return "it still runs"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def send(self, messages: list) -> None:
        """Any thread may send; raises OSError once the process is gone."""
        with self._send_lock:
            self.conn.send(messages)

    def wait_ready(self) -> dict:
        """Waits for the engine to be built; returns what it reports (block size, lengths)."""
        while True:
            try:
                messages = self.conn.recv()
            except (EOFError, OSError):
                self.wait_exited()
                raise RuntimeError(f"the engine process exited while starting ({self.describe_exit()}); "
                                   "its log above says why") from None
            for message in messages:
                if message[0] == "log":
                    _log_record(message[1])
                elif message[0] == "ready":
                    return message[1]
                elif message[0] == "failed":
                    self.stop()
                    raise RuntimeError(f"the engine failed to start:\n{message[1]}")

    def wait_exited(self, timeout: float = 10.0) -> bool:
        if self.popen is None:
            return adoption.wait_exit(self.pid, timeout)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the loop to end, then kills the process if it has not within `timeout`."""
        try:
            self.send([("stop",)])
        except OSError:
            pass
        if not self.wait_exited(timeout):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait_exited(timeout)
        self.conn.close()


def _stream_lost(text: str) -> ConnectionError:
    """A StreamLost (the router answers UNAVAILABLE: retry), imported here and not at the top: the
    output stream's module imports torch, which this process need not load before its engine's
    process has started (they would import it one after the other, seconds of every restart)."""
    from dflash_serve.services.verifier.output_stream import StreamLost

    return StreamLost(text)


def _log_record(record: logging.LogRecord) -> None:
    """A record of the engine's process, through this process's handlers for its logger."""
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)


class _Call:
    """A call waiting for the engine's process: its event loop and the future it awaits."""

    __slots__ = ("done", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future):
        self.loop, self.done = loop, done

    def settle(self, result) -> None:
        """From the reading thread: sets the future through its event loop (an exception is raised)."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.done, result)
        except RuntimeError:  # that loop has ended: nothing awaits the call any more
            pass


def _settle(future: asyncio.Future, result) -> None:
    if future.done():  # its call was cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
