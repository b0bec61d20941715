"""The chart's deploy path, exercised: the rendered RayService's serveConfigV2 is submitted to a
real Ray head through the dashboard's REST API exactly as KubeRay submits it, then served over
gRPC and over the OpenAI HTTP API on Serve's HTTP port, with API keys required on both and Ray's
token authentication on as the chart's rayAuth turns it on; a config-only change (a `helm upgrade`
of router settings) is applied to the running application in place, on both protocols, without
restarting a replica or loading a model again, while an engine change rebuilds it."""

from __future__ import annotations

import secrets
import time

import grpc
import httpx
import pytest

from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.helm.chart import render
from tests.integration.conftest import DEVICE, free_port
from tests.integration.ray_head import RayHead, ray_head

pytestmark = pytest.mark.integration

APP = "dflash"
API_KEY = "sk-deploy-rest-0123456789"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPT = "def main():\n    return"
MODEL = "target"  # the served model name: the target's folder name (tests/served_pair.py)


def chart_values(target: str, drafter: str, ports: dict, **dflash) -> dict:
    engine = {"target": target, "drafter": drafter, "device": DEVICE, "num_kv_blocks": 256, "max_num_seqs": 4,
              "speculation": "fixed"}  # every round drafts: the test asserts drafts were counted
    engine.update(dflash.pop("engine", {}))
    return {"dflash": {"engine": engine, **dflash}, "ports": ports}


def serve_config(values: dict) -> dict:
    return render(values).serve_config


def replica_actors(details: dict) -> dict[str, list[str]]:
    """Deployment -> the actor ids of its RUNNING replicas."""
    return {name: sorted(r["actor_id"] for r in deployment["replicas"] if r["state"] == "RUNNING")
            for name, deployment in details["deployments"].items()}


@pytest.fixture(scope="module")
def deployed(model_pair, tmp_path_factory):
    target, drafter = model_pair
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    # The file the chart's apiKeys Secret would be mounted as; named directly, since no pod mounts it here.
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(API_KEY + "\n")
    with ray_head(auth_token=secrets.token_hex(16)) as head:
        values = chart_values(target, drafter, ports, max_pending=8, default_max_tokens=32, api_keys_file=str(keys))
        head.deploy(serve_config(values))
        details = head.wait_running(APP)
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}")
        grpc.channel_ready_future(channel).result(timeout=60)
        _wait_speculating(generation_pb2_grpc.GenerationStub(channel))
        with httpx.Client(base_url=f"http://127.0.0.1:{ports['http']}", timeout=120) as http:
            yield {"head": head, "values": values, "details": details, "model_pair": model_pair, "ports": ports,
                   "stub": generation_pb2_grpc.GenerationStub(channel), "http": http}
        channel.close()


def _wait_speculating(stub, timeout_s: float = 120) -> None:
    """Until requests are drafted for: a split replica serves target-only until its drafter attaches."""
    deadline = time.monotonic() + timeout_s
    while _generate(stub, max_tokens=8)[1].spec_stats.num_drafts == 0:
        assert time.monotonic() < deadline, f"no drafts within {timeout_s:.0f} s: the drafter did not attach"
        time.sleep(0.5)


def _generate(stub, **sampling):
    request = generation_pb2.GenerateRequest(prompt=PROMPT, sampling=generation_pb2.SamplingParams(**sampling))
    responses = list(stub.Generate(request, timeout=120, metadata=AUTH))
    return [t for r in responses for t in r.token_ids], responses[-1]


def _complete(http: httpx.Client, **body) -> dict:
    """One non-streamed /v1/completions of PROMPT with the key; fails with the server's answer."""
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0.0, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _check_the_http_api(deployed, default_max_tokens: int) -> None:
    """/v1/models and a completion with the key; both refused without it, or with another key;
    a completion without max_tokens takes the router's default_max_tokens (what the change moves)."""
    http = deployed["http"]
    models = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.status_code == 200, models.text
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    completion = _complete(http, ignore_eos=True)
    assert completion["usage"]["completion_tokens"] == default_max_tokens
    assert completion["choices"][0]["finish_reason"] == "length"
    for headers in ({}, {"Authorization": "Bearer sk-not-the-key"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
            refused = http.request(method, path, headers=headers, json=body)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/health").json() == {"status": "SERVING"}  # open, like gRPC's health service


def test_the_rendered_serve_config_deploys_through_the_rest_api_and_serves(deployed):
    target, drafter = deployed["model_pair"]
    ids, last = _generate(deployed["stub"], max_tokens=16)
    engine = build_engine(EngineConfig(target=target, drafter=drafter, device=DEVICE, num_kv_blocks=256))
    reference = engine.generate([engine.tokenizer.encode(PROMPT)], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert ids == reference.output_ids
    assert last.spec_stats.num_drafts > 0
    # The same request over HTTP: the same tokens, as text.
    completion = _complete(deployed["http"], max_tokens=16)
    assert completion["choices"][0]["text"] == engine.tokenizer.decode(reference.output_ids)
    assert completion["usage"]["completion_tokens"] == 16
    with pytest.raises(grpc.RpcError) as err:  # gRPC without the key
        list(deployed["stub"].Generate(generation_pb2.GenerateRequest(prompt=PROMPT), timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    actors = replica_actors(deployed["details"])
    assert len(actors["Router"]) == 1 and len(actors["Verifier"]) == 1


def test_the_rest_api_refuses_a_call_without_the_token(deployed):
    anonymous = RayHead(deployed["head"].dashboard)
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        anonymous.headers = headers
        with pytest.raises(AssertionError, match="HTTP 40[13]"):  # 401 without a token, 403 a wrong one
            anonymous.applications()


def test_a_router_setting_changes_in_place_without_reloading_the_models(deployed):
    head, stub = deployed["head"], deployed["stub"]
    before = replica_actors(head.wait_running(APP))
    _, last = _generate(stub, ignore_eos=True)
    assert last.usage.completion_tokens == 32  # default_max_tokens as first deployed
    _check_the_http_api(deployed, default_max_tokens=32)

    upgraded = {**deployed["values"], "dflash": {**deployed["values"]["dflash"], "default_max_tokens": 5,
                                                 "max_pending": 1}}
    submitted = time.time()
    head.deploy(serve_config(upgraded))
    details = head.wait_running(APP, since=submitted)

    def applied():
        return _generate(stub, ignore_eos=True)[1].usage.completion_tokens == 5

    deadline = time.monotonic() + 60
    while not applied():
        assert time.monotonic() < deadline, "the new default_max_tokens never reached the router"
        time.sleep(1)
    _check_the_http_api(deployed, default_max_tokens=5)  # the HTTP API of the same router, changed too
    # max_pending: 1 applies too: one stream in flight, the next request is turned away.
    held = stub.Generate(generation_pb2.GenerateRequest(
        prompt="import os", sampling=generation_pb2.SamplingParams(max_tokens=400, ignore_eos=True)), timeout=120,
        metadata=AUTH)
    next(held)
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 requests in flight" in err.value.details()
    busy = deployed["http"].post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    assert busy.status_code == 429 and "1 requests in flight" in busy.json()["error"]["message"]
    held.cancel()
    # The same replicas (same actors) serve: nothing restarted, no model was loaded again.
    assert replica_actors(details) == before
    assert replica_actors(head.wait_running(APP)) == before
    deployed["values"] = upgraded


def test_an_engine_change_rebuilds_the_application(deployed):
    """The other side of the boundary the README states: every other key reloads the models."""
    head, stub = deployed["head"], deployed["stub"]
    before = replica_actors(head.wait_running(APP))
    values = deployed["values"]
    changed = {**values, "dflash": {**values["dflash"], "engine": {**values["dflash"]["engine"], "max_num_seqs": 2}}}
    submitted = time.time()
    head.deploy(serve_config(changed))
    deadline = time.monotonic() + 240
    while True:
        details = head.wait_running(APP, since=submitted)
        after = replica_actors(details)
        if after["Verifier"] and not set(after["Verifier"]) & set(before["Verifier"]):
            break
        assert time.monotonic() < deadline, f"the verifier replica was not replaced: {before} -> {after}"
        time.sleep(1)
    assert not set(after["Router"]) & set(before["Router"])
    ids, _ = _generate(stub, max_tokens=4)
    assert len(ids) == 4
