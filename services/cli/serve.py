"""`dflash serve`: the router, verifier and drafter deployments on a local Ray, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time

from dflash_serve.services.cli.flags import (
    add_config_flags,
    add_engine_flags,
    auto_device,
    cuda_device_count,
    given_config_flags,
    model_pair,
)
from dflash_serve.services.config import EngineConfig, ServeConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="run the gRPC service (router, verifier, drafter) on a local Ray")
    parser.add_argument("--config", help="the YAML the Helm chart renders (services/config.py:ServeConfig: engine, "
                                         "topology, ports, ...); the flags below override it, and DFLASH_* variables "
                                         "override it under them")
    parser.add_argument("--cuda-mps", action="store_true",
                        help="run the server's processes as clients of a CUDA MPS daemon of its own, so that a verifier "
                             "and a drafter sharing its GPU share its SMs instead of time-slicing it (+4-5%% at batch 1, "
                             "BENCHMARKS.md); needs nvidia-cuda-mps-control. On Kubernetes, the device plugin runs MPS")
    serve_defaults = {"device": "cuda when there is a GPU, else cpu; with --config, 'cpu'",
                      "topology": "split with a drafter, else colocated; with --config, 'split'"}
    add_config_flags(parser, ServeConfig, "application (ServeConfig; flags > DFLASH_* > --config file > defaults)",
                     defaults=serve_defaults)
    add_engine_flags(parser, "engine (ServeConfig.engine; flags > DFLASH_ENGINE__* > --config file > defaults)",
                     defaults=serve_defaults)
    parser.set_defaults(run=run)


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    """Flags > DFLASH_* environment > the --config file > defaults. Without a file, the command's
    own defaults: the default pair, the GPU when there is one, split with a drafter."""
    flags = {**given_config_flags(args, ServeConfig), "engine": given_config_flags(args, EngineConfig)}
    if args.config:
        return ServeConfig.from_yaml(args.config, flags)
    pair = model_pair(flags["engine"])
    defaults = {"engine": {"device": auto_device(), **pair}, "topology": "split" if pair["drafter"] else "colocated"}
    return ServeConfig.load(flags=flags, defaults=defaults)


def _local_gpus(config: ServeConfig) -> int:
    """The GPUs `dflash serve` lends Ray on this machine: one verifier replica's, with its
    drafter's own (drafter_placement own_gpu)."""
    wanted = math.ceil(config.gpus_per_verifier + config.gpus_per_drafter)
    have = cuda_device_count() if wanted else 0
    if wanted > have:
        own = " plus 1 for its drafter (drafter_placement=own_gpu)" if config.gpus_per_drafter else ""
        ranks = config.engine.tensor_parallel_size
        each = f" for each of engine.tensor_parallel_size={ranks} ranks" if ranks > 1 else ""
        raise ValueError(f"a verifier replica takes {wanted} GPUs (verifier_num_gpus={config.verifier_num_gpus}"
                         f"{each}{own}), but this machine has {have}")
    return wanted


def run(args: argparse.Namespace) -> int:
    from dflash_serve.services.models.default_pair import DefaultPairError

    try:
        config = _serve_config(args)
        num_gpus = _local_gpus(config)
    except (ValueError, TypeError, DefaultPairError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.cuda_mps and not config.engine.device.startswith("cuda"):
        print(f"error: --cuda-mps is for a GPU server; engine.device is {config.engine.device}", file=sys.stderr)
        return 2
    from dflash_serve.services.cuda_mps import CudaMpsError, cuda_mps

    try:
        with cuda_mps() if args.cuda_mps else contextlib.nullcontext():
            return _serve_on_ray(config, num_gpus)
    except CudaMpsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _serve_on_ray(config: ServeConfig, num_gpus: int) -> int:
    forkserver = None
    if config.engine_adoption_s > 0:  # engine processes are detached: forked ones may be (`engine_forkserver`)
        from dflash_serve.services.verifier.engine_forkserver import EngineForkServer

        try:
            forkserver = EngineForkServer()  # it imports the engine while Ray and Serve start
        except OSError as err:
            print(f"dflash-serve: engine processes start without the fork server ({err})", file=sys.stderr, flush=True)
    try:
        return _start_ray_and_serve(config, num_gpus)
    finally:
        if forkserver is not None:
            forkserver.stop()


def _start_ray_and_serve(config: ServeConfig, num_gpus: int) -> int:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, ProxyLocation, gRPCOptions

    from dflash_serve.services.app import GRPC_SERVICER_FUNCTIONS, SERVE_ENV, build_app

    started = time.time()
    for name, value in SERVE_ENV.items():  # the Ray it starts inherits them; one set explicitly wins
        os.environ.setdefault(name, value)
    ray.init(include_dashboard=False, num_gpus=num_gpus or None, _metrics_export_port=config.metrics_port)
    _milestone("Ray is up")
    if config.ingress == "router":  # the routers listen on the ports themselves
        serve.start(proxy_location=ProxyLocation.Disabled)
    else:
        serve.start(http_options=HTTPOptions(host=config.http_host, port=config.http_port),
                    grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    _milestone("Serve is up; starting the verifier replica (its engine loads the models) and the router")
    # No HTTP route with the routers serving the ports themselves (Serve would announce its proxy's address).
    serve.run(build_app(config), name="dflash", route_prefix="/" if config.ingress == "serve" else None)
    # It answers now; at full speed once its CUDA graphs are captured and its drafter attached (its round costs known).
    _milestone("answering (at full speed once warm: CUDA graphs captured, the drafter attached)")
    _wait_until_warm(serve.get_deployment_handle("Verifier", app_name="dflash"),
                     drafter=bool(config.engine.drafter))
    print(f"dflash-serve is up ({time.time() - process_started():.1f} s after start): the OpenAI API on "
          f"http://{config.http_host}:{config.http_port}/v1 (model {config.model_name!r}), gRPC on port "
          f"{config.grpc_port} of every interface (dflash.v1.Generation), "
          f"metrics on port {config.metrics_port} (/metrics)"
          + (", API keys required" if config.api_keys_file else "") + ". Try: dflash client --prompt 'Hello'",
          flush=True)
    run_until_stopped()
    print("dflash-serve: stopping (Ctrl-C again to force)", flush=True)
    try:
        serve.shutdown()  # replicas finish their requests (Serve's graceful shutdown), then go
    finally:
        ray.shutdown()
        _remove_leftovers(started)
    return 0


WARM_WAIT_S = 300.0  # a drafter actor's start, its weights' download from the hub included, takes less


def _wait_until_warm(verifier, *, drafter: bool, timeout_s: float = WARM_WAIT_S) -> None:
    """Until the Verifier replica has captured its CUDA graphs and, with `drafter`, speculates;
    the server answers meanwhile, so this only delays the line that says it is up, never longer
    than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = verifier.stats.remote().result()
            if not stats["graphs_pending"] and (stats["speculative"] or not drafter):
                return
        except Exception as err:  # noqa: BLE001 - a replica being replaced: ask again
            print(f"dflash-serve: the Verifier replica did not answer for its stats ({err}); asking again",
                  file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            print(f"dflash-serve: not warm after {timeout_s:.0f} s (CUDA graphs captured, the drafter attached); "
                  "serving meanwhile (the Verifier replica's log says why)", file=sys.stderr, flush=True)
            return
        time.sleep(0.2)


def process_started() -> float:
    """When this process started (time.time()): from /proc on Linux, to count the interpreter's
    start and the imports too; else when this module was imported."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after boot
            up = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))


_IMPORTED = time.time()


def _milestone(text: str) -> None:
    """A start's progress, with the seconds since the process started (bench.restart's timeline)."""
    print(f"dflash-serve: {text} ({time.time() - process_started():.1f} s after start)", flush=True)


def _remove_leftovers(started: float) -> None:
    """What CUDA IPC left in /dev/shm for this server's exited processes (`transport.leftovers`)."""
    from dflash_serve.services.transport.leftovers import remove_cuda_ipc_leftovers

    removed, running = remove_cuda_ipc_leftovers(started)
    if removed:
        print(f"dflash-serve: removed {len(removed)} files CUDA IPC left in /dev/shm", flush=True)
    if running:
        print(f"dflash-serve: {len(running)} files in /dev/shm belong to processes still running, left in place: "
              f"{', '.join(running)}", file=sys.stderr, flush=True)


def run_until_stopped() -> None:
    """Block until SIGINT (Ctrl-C) or SIGTERM (Kubernetes, systemd, `kill`), then restore the
    handlers, so that a second signal during shutdown forces it."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):  # a timeout, so the main thread runs the handlers promptly
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
