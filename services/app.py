"""The Ray Serve application: a router (gRPC and the OpenAI HTTP API) in front of verifier
replicas (each with its drafter).

`build_app(config)` is what `dflash serve` runs; the Helm chart's serveConfigV2 imports
`dflash_serve.services.app:app_from_config` with the config as the application's `args`. Ray Serve is the control plane — placement, replicas, health,
restarts, request routing; the per-step traffic between a verifier and its drafter never goes
through it (see services/verifier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.gc_freeze import freeze_startup_objects

log = logging.getLogger(__name__)
GRPC_SERVICER_FUNCTIONS = [
    "dflash_serve.services.api.dflash.v1.generation_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
    "dflash_serve.services.app.lost_replicas_are_unavailable",
]
# Ray Serve's settings for every Ray process of a dflash-serve cluster (Serve reads them at import,
# so they are environment variables: `dflash serve` sets them before it starts Ray, the chart in
# every pod). User code and a handle's routing on the replica's own event loop, not on threads of
# their own: a request crossed three threads in each replica, each waiting for the GIL that the
# verifier's engine thread holds; calls between replicas (proxy -> router -> verifier) over gRPC
# rather than Ray object references. It is Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED without its
# direct ingress, which measured slower here, and without its log buffer, which holds a replica's
# log lines back until a thousand have gathered (an operator reads the start-up log as it comes).
# On an H200 it took the served default pair at c 32 from 0.52-0.54x to 0.69-0.79x of the engine,
# and the TTFT serving adds at c 1 from ~15 to ~9 ms (BENCHMARKS, the serving path).
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}
ROUTER_CPUS = 0.25
# Serve finds a replica whose process died only by its next health check (default every 10 s: a
# killed verifier sat dead 7-8 s before Serve started another, a third of its restart on a CPU).
# A check is cheap (the verifier's: its loop alive, a CUDA sync).
HEALTH_CHECK_PERIOD_S = 1.0
# A stopping verifier's requests get this long to finish; within Serve's graceful_shutdown_timeout_s (20 s).
DRAIN_TIMEOUT_S = 15.0
VERIFIER_CPUS = 0.5
CONTROL_HEADROOM = 32


def lost_replicas_are_unavailable(servicer, server) -> None:
    """Listed with the gRPC servicer functions so that every Serve proxy runs it (it adds no
    service). Ray 2.60's proxy answers a call whose Router replica died with INTERNAL and the
    actor's internals (class, namespace, node IP); a client must see UNAVAILABLE, which is
    retryable and says nothing of the cluster. The proxy's status mapping is wrapped for exactly
    that case (ray is pinned; tests/integration kills a Router replica mid-stream to hold it)."""
    import grpc
    from ray.exceptions import RayActorError
    from ray.serve._private import proxy
    from ray.serve._private.proxy_request_response import ResponseStatus

    serve_status = proxy.get_grpc_response_status
    if getattr(serve_status, "lost_replicas_are_unavailable", False):
        return

    def status(exc, request_timeout_s, request_id):
        if isinstance(exc, RayActorError):
            return ResponseStatus(code=grpc.StatusCode.UNAVAILABLE, is_error=True,
                                  message=f"request {request_id}: the server replica handling it was lost; retry")
        return serve_status(exc, request_timeout_s, request_id)

    status.lost_replicas_are_unavailable = True
    proxy.get_grpc_response_status = status


def _log_through_serve() -> None:
    """Serve writes a replica's log (logs/serve/replica_*.log, and stderr) from its `ray.serve`
    logger alone, and Python drops other loggers' INFO records: the `dflash_serve.services`
    loggers (the startup log: the models and their revisions, the KV cache, the target's forward)
    write through the same handlers, so that the replica's log says what it serves."""
    ours = logging.getLogger("dflash_serve.services")
    ours.setLevel(logging.INFO)
    ours.handlers = list(logging.getLogger("ray.serve").handlers)


def _replica_metrics(deployment: str, model: str):
    from ray import serve

    from dflash_serve.services.metrics import ReplicaMetrics

    return ReplicaMetrics(model=model, deployment=deployment, replica=serve.get_replica_context().replica_tag)


class VerifierDeployment:
    def __init__(self, config: dict):
        import ray
        from ray import serve

        from dflash_serve.services.verifier import intake_registry
        from dflash_serve.services.verifier.verifier import Verifier

        _log_through_serve()
        # model_name: the name the API serves, as vLLM's label is (not the target's path in the model cache).
        self.verifier = Verifier(config, metrics=_replica_metrics("verifier", ServeConfig.from_dict(config).model_name),
                                 intake_host=ray.util.get_node_ip_address())
        context = serve.get_replica_context()
        self._registration = (context.app_name, context.replica_tag)
        intake_registry.register(*self._registration, self.verifier.intake_address)  # routers now find its engine
        freeze_startup_objects()

    async def generate(self, prompt_ids, params, request_id, reply_to) -> str:
        """Outputs go over the router's output stream (`reply_to`); returns the stream's id at the end."""
        return await self.verifier.generate(prompt_ids, params, request_id, reply_to)

    def model_info(self) -> dict:
        return self.verifier.model_info()

    async def stats(self) -> dict:
        return await self.verifier.stats()

    def check_health(self) -> None:
        """Serve calls it every health_check_period_s and replaces the replica when it raises;
        the router calls it for grpc.health.v1."""
        self.verifier.check_health()

    async def __del__(self):
        """Serve's graceful shutdown. Serve sees none of the direct intake's requests, so it would
        stop this replica with them in flight: the routers stop sending here first (the
        registration goes), then the requests the engine holds finish (up to DRAIN_TIMEOUT_S)."""
        from dflash_serve.services.verifier import intake_registry

        registration = getattr(self, "_registration", None)
        if registration is not None:
            try:
                intake_registry.forget(*registration)
            except Exception:  # noqa: BLE001 - Ray is shutting down: the routers find the address dead instead
                pass
        verifier = getattr(self, "verifier", None)
        if verifier is None:
            return
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                stats = await verifier.stats()
                if stats["running"] == stats["waiting"] == 0:
                    break
                await asyncio.sleep(0.1)
        except Exception:  # noqa: BLE001 - the engine's process is gone: nothing left to drain
            pass
        verifier.shutdown()


class RouterDeployment:
    """Both ingresses of one replica: the gRPC methods below (Serve's gRPC proxy calls them by
    name) and `__call__`, which Serve's HTTP proxy calls with each HTTP request. The routers' own
    settings (config.ROUTER_SETTINGS) arrive as Serve's user_config, so a changed value reaches
    running replicas through `reconfigure` and no model is loaded again."""

    def __init__(self, verifier, config: dict):
        import ray

        from dflash_serve.services.models.target_files import context_length, load_tokenizer
        from dflash_serve.services.router.auth import ApiKeys
        from dflash_serve.services.router.openai_api import OpenAIServer
        from dflash_serve.services.router.router import Router

        _log_through_serve()
        log.info("router starting (pid %d)", os.getpid())  # bench.restart's timeline
        self.config = ServeConfig.from_dict(config)
        cfg = self.config
        target, revision = cfg.engine.target, cfg.engine.target_revision
        max_len = cfg.engine.max_model_len or context_length(target, revision)
        api_keys = ApiKeys.from_file(cfg.api_keys_file) if cfg.api_keys_file else None
        # The direct intake hides requests from Serve's autoscaler, which counts its calls: only a
        # fixed verifier count takes it.
        direct = cfg.max_replicas <= cfg.num_replicas
        self.router = Router(verifier, load_tokenizer(target, revision), max_model_len=max_len,
                             max_tokens_limit=cfg.engine.max_tokens_limit,
                             default_max_tokens=cfg.default_max_tokens, max_pending=cfg.max_pending,
                             running_verifiers=_running_verifiers, api_keys=api_keys,
                             outputs_host=ray.util.get_node_ip_address(),
                             stream_messages_per_s=cfg.stream_messages_per_s,
                             registered_engines=_registered_engines if direct else None,
                             forget_engine=_forget_engine if direct else None)
        self.openai = OpenAIServer(self.router, cfg.model_name)
        self.ingress = None
        if cfg.ingress == "router":  # this replica serves the ports itself (Serve runs no proxy)
            from dflash_serve.services.router.ingress import RouterIngress

            self.ingress = RouterIngress(self.router, self.openai)
            self.ingress.bind(cfg.http_host, cfg.grpc_port, cfg.http_port)
            self.ingress.start()
        log.info("router ready (tokenizer loaded%s)", ", ports bound" if self.ingress is not None else "")
        freeze_startup_objects()

    def check_health(self) -> None:
        """Serve replaces a router replica whose own servers stopped."""
        failure = self.ingress.failure() if self.ingress is not None else None
        if failure:
            raise RuntimeError(failure)

    async def __del__(self):
        if self.ingress is not None:
            await self.ingress.stop()

    async def __call__(self, request):
        """An HTTP request (a starlette Request): the OpenAI API."""
        return await self.openai(request)

    def reconfigure(self, user_config: dict) -> None:
        """Keys left out of user_config keep the application config's values; a bad value fails
        the update (Serve reports it and keeps the replica as it was)."""
        settings = self.config.with_router_settings(user_config)
        self.router.max_pending = settings.max_pending
        self.router.default_max_tokens = settings.default_max_tokens
        self.router.stream_messages_per_s = settings.stream_messages_per_s

    async def Generate(self, request, grpc_context):  # noqa: N802 - gRPC method names
        # aclosing: a cancelled client closes the router's stream at once, which frees the request.
        async with contextlib.aclosing(self.router.Generate(request, grpc_context)) as responses:
            async for response in responses:
                yield response

    async def Complete(self, request, grpc_context):  # noqa: N802
        return await self.router.Complete(request, grpc_context)

    async def GetModelInfo(self, request, grpc_context):  # noqa: N802
        return await self.router.GetModelInfo(request, grpc_context)

    async def Check(self, request, grpc_context):  # noqa: N802 - grpc.health.v1
        return await self.router.Check(request, grpc_context)


async def _registered_engines() -> dict:
    """The intake addresses of this application's verifier replicas' engine processes."""
    from ray import serve

    from dflash_serve.services.verifier import intake_registry

    app = serve.get_replica_context().app_name
    return await asyncio.get_running_loop().run_in_executor(None, intake_registry.registered, app)


async def _forget_engine(replica: str) -> None:
    from ray import serve

    from dflash_serve.services.verifier import intake_registry

    app = serve.get_replica_context().app_name
    await asyncio.get_running_loop().run_in_executor(None, intake_registry.forget, app, replica)


async def _running_verifiers() -> int:
    """Verifier replicas RUNNING in this application, as the Serve controller sees them."""
    from ray import serve

    app = serve.get_replica_context().app_name
    status = await asyncio.get_running_loop().run_in_executor(None, serve.status)
    return status.applications[app].deployments["Verifier"].replica_states.get("RUNNING", 0)


def _replicas(low: int, high: int, *, target: int) -> dict:
    """A fixed replica count, or Serve autoscaling between `low` and `high` aiming at `target`
    ongoing requests per replica."""
    if high <= low:
        return {"num_replicas": low}
    return {"autoscaling_config": {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                                   "target_ongoing_requests": target}}


def _bundle(cpus: float, gpus: float) -> dict:
    return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}


def build_app(config: ServeConfig):
    from ray import serve

    # Here, not at the top: every Serve proxy imports this module for `lost_replicas_are_unavailable`,
    # and the verifier's module brings torch, transformers and the engine, which a proxy never uses.
    from dflash_serve.services.verifier.verifier import DRAFTER_CPUS

    split = config.topology == "split"
    verifier_options = dict(
        name="Verifier",
        **_replicas(config.num_replicas, config.max_replicas, target=config.engine.max_num_seqs),
        # Headroom over max_pending for control calls (stats, model info), which must not queue behind streams.
        max_ongoing_requests=config.max_pending + CONTROL_HEADROOM,
        ray_actor_options={"num_cpus": VERIFIER_CPUS, "num_gpus": config.gpus_per_verifier},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    if split:
        # Bundle 0: the verifier replica; bundle 1: its drafter actor, with a GPU of its own or
        # none (it computes on the verifier's). STRICT_PACK: one node, which CUDA IPC needs.
        verifier_options["placement_group_bundles"] = [
            _bundle(VERIFIER_CPUS, config.gpus_per_verifier), _bundle(DRAFTER_CPUS, config.gpus_per_drafter),
        ]
        verifier_options["placement_group_strategy"] = "STRICT_PACK"
    verifier = serve.deployment(VerifierDeployment, **verifier_options).bind(config.to_dict())
    # Headroom over max_pending: the router itself answers RESOURCE_EXHAUSTED rather than Serve queueing.
    router = serve.deployment(RouterDeployment, name="Router", max_ongoing_requests=config.max_pending + CONTROL_HEADROOM,
                              ray_actor_options={"num_cpus": ROUTER_CPUS}, user_config=config.router_settings(),
                              health_check_period_s=HEALTH_CHECK_PERIOD_S,
                              **_replicas(config.router_replicas, config.router_max_replicas,
                                          target=max(1, config.max_pending // 2)))
    return router.bind(verifier, config.to_dict())


def app_from_config(args: dict):
    """Entry point for serveConfigV2 `import_path: dflash_serve.services.app:app_from_config`: the application's
    `args` are the ServeConfig, under the DFLASH_* environment's overrides (the pods' env). Serve
    rebuilds the application, restarting every replica, when they change; the chart therefore puts
    ROUTER_SETTINGS in the Router's user_config instead. The replicas get the config as resolved
    here, and do not read the environment again."""
    return build_app(ServeConfig.load(args))
