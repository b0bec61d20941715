"""One real local Ray cluster (2 CPUs) with Serve and its gRPC proxy for the whole session, and a
tiny real model pair (target with a trained tokenizer and chat template, DFlash drafter) on disk.

DFLASH_TEST_DEVICE=cuda runs the same tests with the models on the GPU (the verifier takes it, its
drafter actor shares it through CUDA IPC): the GPU machine's run."""

from __future__ import annotations

import os
import socket

import pytest

from tests.served_pair import save_tiny_pair

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), block_size=6)


@pytest.fixture(scope="session")
def ray_serve():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    # Serve kills a proxy not ready in 5 s; a loaded 2-core machine can take longer to start one.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    from services.app import GRPC_SERVICER_FUNCTIONS

    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    ray.init(num_cpus=2, num_gpus=1 if DEVICE.startswith("cuda") else 0, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False,
             _metrics_export_port=ports["metrics"])
    serve.start(http_options=HTTPOptions(port=ports["http"]),
                grpc_options=gRPCOptions(port=ports["grpc"], grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    yield ports
    serve.shutdown()
    ray.shutdown()
