"""One real local Ray cluster (2 CPUs) with Serve and its gRPC proxy for the whole session, and a
tiny real model pair (target with a trained tokenizer and chat template, DFlash drafter) on disk.

DFLASH_TEST_DEVICE=cuda runs the same tests with the models on the GPU (the verifier takes it, its
drafter actor shares it through CUDA IPC): the GPU machine's run."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dflash_serve.services.app import SERVE_ENV
from tests.served_pair import save_tiny_pair

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")


# Ports for the servers the tests start (Serve's gRPC and HTTP proxies, metrics, the dashboard):
# below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by default). A port
# the kernel picked as free (bind to port 0) is one it also hands out to outgoing connections, and
# Ray's processes open many: once one took it between the check and Serve's bind, and the gRPC
# proxy failed ("Failed to bind to address [::]:42827").
LOWEST_PORT = 20000
_ports_given: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    """Free on every address, as the proxies bind it ([::] and 0.0.0.0; a host without IPv6 has no [::])."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE or family == socket.AF_INET:
                return False
    return True


def free_port() -> int:
    """A port free now, outside the ranges others take ports from, not handed out before. Under
    pytest-xdist each worker takes its own residue class (port % workers), so that two workers
    never pick the same port before either has bound it."""
    highest = max(_ephemeral_start(), LOWEST_PORT + 1000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    for _ in range(1000):
        port = random.randrange(LOWEST_PORT + worker, highest, workers)
        if port not in _ports_given and _bindable(port):
            _ports_given.add(port)
            return port
    raise RuntimeError(f"no free port in {LOWEST_PORT}-{highest - 1}")


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), block_size=6)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """These variables set (where not set already) for the block only."""
    added = {name: value for name, value in variables.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            del os.environ[name]


@pytest.fixture(scope="session")
def ray_serve():
    _ray_serve["ports"] = ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    _start_ray_serve()
    yield ports
    if _ray_serve["running"]:  # not stopped already, after the last test using it
        _stop_ray_serve()


# The session's ray_serve cluster: its ports once it was started, and whether it runs now.
_ray_serve: dict = {"ports": None, "running": False}


def _start_ray_serve() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    # Serve kills a proxy not ready in 5 s; a loaded 2-core machine can take longer to start one.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    from dflash_serve.services.app import GRPC_SERVICER_FUNCTIONS

    ports = _ray_serve["ports"]
    # Ray's processes run Serve as `dflash serve` and the chart do (they inherit the environment
    # ray.init starts them with); this process keeps Serve's defaults, imported above, because
    # the tests call handles from plain functions, which a handle routing on the caller's event
    # loop refuses.
    with _environment(SERVE_ENV):
        ray.init(num_cpus=2, num_gpus=1 if DEVICE.startswith("cuda") else 0, include_dashboard=False,
                 object_store_memory=200 * 2**20, log_to_driver=False, _metrics_export_port=ports["metrics"])
    serve.start(http_options=HTTPOptions(port=ports["http"]),
                grpc_options=gRPCOptions(port=ports["grpc"], grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    _ray_serve["running"] = True


def _stop_ray_serve() -> None:
    import ray
    from ray import serve

    _ray_serve["running"] = False
    # serve.shutdown() waits without a limit for each cached handle's router to stop (Ray 2.60's
    # DeploymentHandle.shutdown). On CI (2026-11-27) this teardown hung after every test had passed,
    # most likely there, until CI's deadline. ray.shutdown() ends every process of this local
    # cluster anyway, so Serve's graceful part gets a bound.
    graceful = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
    graceful.start()
    graceful.join(timeout=60)
    ray.shutdown()


def _uses_ray_serve(item) -> bool:
    return item is not None and "ray_serve" in item.fixturenames


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The ray_serve cluster stops after the last of a run of tests that use it, once that
    test's module fixtures are torn down, instead of at the end of the session: the files using
    it run one after the other (under pytest -n too: tests/conftest.py), and an idle cluster
    still takes a tenth of a core from the tests that run after them."""
    yield
    if _ray_serve["running"] and _uses_ray_serve(item) and not _uses_ray_serve(nextitem):
        _stop_ray_serve()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test using ray_serve after it was stopped (files given in an order that puts others
    between them) starts it again, on its ports; the first one's fixture starts it."""
    if _uses_ray_serve(item) and _ray_serve["ports"] is not None and not _ray_serve["running"]:
        _start_ray_serve()


@contextlib.contextmanager
def deployed_app(ports: dict, model_pair: tuple[str, str], **serve_config) -> Iterator[dict]:
    """The real application (split topology, the tiny pair) deployed as `dflash` on the session's
    Ray, ready on its gRPC port (Serve's proxy's, or with ingress router the routers' own);
    `serve_config`: ServeConfig fields over the tests' defaults.
    Yields the config, a gRPC channel and stub, the Verifier's handle and the ports; deletes it afterwards."""
    from ray import serve

    from dflash_serve.services.api.dflash.v1 import generation_pb2_grpc
    from dflash_serve.services.app import build_app
    from dflash_serve.services.config import EngineConfig, ServeConfig

    target, drafter = model_pair
    # fixed: every round drafts, so the speculative stats and counters the tests read always have rounds
    config = ServeConfig(**{"engine": EngineConfig(target=target, drafter=drafter, device=DEVICE, num_kv_blocks=256,
                                                   max_num_seqs=4, speculation="fixed"),
                            "topology": "split", "max_pending": 8, "default_max_tokens": 32,
                            "grpc_port": ports["grpc"], "ingress": "serve", **serve_config})
    serve.run(build_app(config), name="dflash", route_prefix="/")
    channel = grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}")
    verifier = serve.get_deployment_handle("Verifier", app_name="dflash")
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        if config.topology == "split":  # it serves target-only until its drafter attaches; the tests read rounds
            deadline = time.monotonic() + 120
            while not verifier.stats.remote().result()["speculative"]:
                assert time.monotonic() < deadline, "the drafter did not attach within 120 s"
                time.sleep(0.2)
        yield {"config": config, "channel": channel, "stub": generation_pb2_grpc.GenerationStub(channel),
               "verifier": verifier, "ports": ports}
    finally:
        channel.close()
        serve.delete("dflash")
