"""`dflash serve` stopped with SIGINT lets the requests in flight finish, then exits. Ray Serve
counts none of the requests that the routers' own servers take and that go to the engines
directly, so it would stop the replicas under them: the routers and the verifiers drain them
themselves (services/app.py, services/router/ingress.py). The default pair on the CPU streams
~20 tokens a second, so the request is still running when the signal comes."""

from __future__ import annotations

import signal

import grpc
import pytest

from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc
from dflash_serve.services.bench.serving_path import Server
from dflash_serve.services.models.default_pair import SOURCE_FILE, target_dir
from tests.integration.conftest import free_port

TOKENS = 120


def test_sigint_lets_a_request_in_flight_finish_then_the_server_exits(tmp_path):
    if not (target_dir() / SOURCE_FILE).is_file():
        pytest.skip(f"the default target is not in the model cache ({target_dir()}): run `dflash fetch-default`")
    grpc_port = free_port()
    server = Server(["--topology", "colocated", "--grpc-port", str(grpc_port), "--http-port", str(free_port()),
                     "--metrics-port", str(free_port())], tmp_path / "serve.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
                prompt="Tell me a story.",
                sampling=generation_pb2.SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)),
                timeout=120)
            received = [next(call)]  # it runs
            server.process.send_signal(signal.SIGINT)
            received += list(call)
        assert server.process.wait(timeout=120) == 0
    finally:
        server.stop()
    assert received[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in received) == TOKENS
