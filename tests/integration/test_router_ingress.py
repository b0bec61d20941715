"""The routers' own servers (ingress router, what `dflash serve` runs): gRPC and the OpenAI API
served by the router replica itself on the application's ports, with no Serve proxy in between;
the same outputs as the engine, statuses that say what to fix, health, and a cancel that frees
every block."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.integration.conftest import DEVICE, deployed_app, free_port


@pytest.fixture(scope="module")
def app(ray_serve, model_pair):
    """Two router replicas: both listen on the same two ports (SO_REUSEPORT)."""
    ports = {**ray_serve, "grpc": free_port(), "http": free_port()}  # not the proxies' ports
    with deployed_app(ports, model_pair, ingress="router", router_replicas=2, http_port=ports["http"],
                      served_model_name="tiny") as app:
        yield app


def test_both_router_replicas_run_on_the_same_ports(app):
    from ray import serve

    routers = serve.status().applications["dflash"].deployments["Router"]
    assert routers.replica_states.get("RUNNING", 0) == 2


@pytest.fixture(scope="module")
def embedded(model_pair):
    target, drafter = model_pair
    return build_engine(EngineConfig(target=target, drafter=drafter, device=DEVICE, num_kv_blocks=256))


def test_grpc_streams_the_engines_tokens(app, embedded):
    prompt = "def main():\n    return"
    responses = list(app["stub"].Generate(generation_pb2.GenerateRequest(
        prompt=prompt, sampling=generation_pb2.SamplingParams(max_tokens=24, temperature=0.0)), timeout=60))
    reference = embedded.generate([embedded.tokenizer.encode(prompt)], SamplingParams(max_tokens=24,
                                                                                      temperature=0.0))[0]
    assert [t for r in responses for t in r.token_ids] == reference.output_ids
    assert responses[-1].usage.completion_tokens == len(reference.output_ids)


def test_a_bad_request_ends_the_stream_with_invalid_argument_and_the_reason(app):
    with pytest.raises(grpc.RpcError) as err:
        list(app["stub"].Generate(generation_pb2.GenerateRequest(
            prompt="x", sampling=generation_pb2.SamplingParams(top_p=1.5)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()


def test_a_bad_unary_call_gets_invalid_argument_and_the_reason(app):
    with pytest.raises(grpc.RpcError) as err:
        app["stub"].Complete(generation_pb2.GenerateRequest(
            prompt="x", sampling=generation_pb2.SamplingParams(temperature=-1)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()


def test_the_health_service_answers_serving_and_watches(app):
    health = health_pb2_grpc.HealthStub(app["channel"])
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_openai_api_streams_on_the_routers_http_port(app, embedded):
    prompt = "def main():\n    return"
    reference = embedded.generate([embedded.tokenizer.encode(prompt)], SamplingParams(max_tokens=16,
                                                                                      temperature=0.0))[0]
    with httpx.Client(base_url=f"http://127.0.0.1:{app['ports']['http']}", timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        body = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0}).json()
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                          "temperature": 0, "stream": True}) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert body["choices"][0]["text"] == embedded.tokenizer.decode(reference.output_ids)
    assert body["usage"]["completion_tokens"] == len(reference.output_ids)
    assert events[-1] == "data: [DONE]" and len(events) > 2


def test_a_client_cancelling_mid_stream_frees_every_block(app):
    call = app["stub"].Generate(generation_pb2.GenerateRequest(
        prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)),
        timeout=60)
    next(call)  # it runs
    call.cancel()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = app["verifier"].stats.remote().result()
        if stats["running"] == stats["waiting"] == 0 and stats["kv_free_blocks"] == stats["kv_blocks"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks not freed after the cancel: {stats}")


def test_the_grpc_services_are_listed_by_reflection(app):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(app["channel"])
    (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=30)
    names = {service.name for service in answer.list_services_response.service}
    assert {"dflash.v1.Generation", "grpc.health.v1.Health"} <= names

