"""The OpenAI HTTP API of the real application on a real local Ray, called with the `openai`
package (sync, async, streaming) over Serve's HTTP proxy, with API keys on: outputs equal the gRPC
API's for the same request, errors arrive as the SDK's exceptions, keys are enforced on both
protocols (health stays open), and a client that disconnects mid-stream frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import time
import urllib.request
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from dflash_serve.services.api.dflash.v1 import generation_pb2
from tests.integration.conftest import DEVICE, deployed_app
from tests.served_pair import save_gemma4_pair

pytestmark = pytest.mark.integration

KEY = "sk-dflash-integration-0123456789"
MODEL = "tiny-pair"


@pytest.fixture(scope="module")
def app(ray_serve, model_pair, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY}\nsk-second-key\n")
    with deployed_app(ray_serve, model_pair, http_port=ray_serve["http"], served_model_name=MODEL,
                      api_keys_file=str(keys)) as deployed:
        yield {**deployed, "base_url": f"http://127.0.0.1:{ray_serve['http']}/v1"}


@pytest.fixture(scope="module")
def sdk(app):
    return openai.OpenAI(base_url=app["base_url"], api_key=KEY, max_retries=0, timeout=60)


def _grpc(app, **request):
    responses = list(app["stub"].Generate(generation_pb2.GenerateRequest(**request), timeout=60,
                                          metadata=[("authorization", f"Bearer {KEY}")]))
    return "".join(r.text for r in responses), responses[-1]


def _idle(app, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = app["verifier"].stats.remote().result()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.2)
    raise AssertionError("the verifier did not go idle")


SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=5)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_chat_streams_the_grpc_apis_output(app, sdk, sampling):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def main():"}]
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                              stream_options={"include_usage": True}, **sampling))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reference, last = _grpc(app, chat=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(**m) for m in messages]),
        sampling=generation_pb2.SamplingParams(max_tokens=24, **sampling))
    assert text == reference
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (last.usage.prompt_tokens, last.usage.completion_tokens)
    spec = chunks[-1].model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 5 and spec["num_spec_steps"] > 0
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_draft_tokens"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert finish == {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length"}[
        last.finish_reason]


def test_the_readmes_quickstart_sdk_example_streams(app):
    """The README's OpenAI SDK example, run as a user would, pointed at this server (its URL, key
    and model name): it prints the completion the gRPC API gives for the same chat."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    example = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
    for shown, here in (("http://127.0.0.1:8000/v1", app["base_url"]), ('api_key="none"', f'api_key="{KEY}"'),
                        ('"SmolLM2-135M-Instruct"', f'"{MODEL}"')):
        assert shown in example
        example = example.replace(shown, here)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example, "README.md", "exec"), {})  # noqa: S102 - the documented example itself
    content = re.search(r'"content": "(.*?)"', example).group(1)
    max_tokens = int(re.search(r"max_tokens=(\d+)", example).group(1))
    reference, last = _grpc(app, chat=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="user", content=content)]),
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))
    text, summary = printed.getvalue().rsplit("\n-- ", 1)
    assert text == reference
    assert summary.startswith(f"{last.usage.completion_tokens} tokens;") and "speculative_decoding" in summary


def test_completions_sync_and_async_equal_the_grpc_api(app, sdk):
    prompt = "class A:\n    def f(self):"
    reference, last = _grpc(app, prompt=prompt, sampling=generation_pb2.SamplingParams(max_tokens=20))
    completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert completion.choices[0].text == reference
    assert completion.usage.completion_tokens == last.usage.completion_tokens

    async def stream():
        client = openai.AsyncOpenAI(base_url=app["base_url"], api_key=KEY, max_retries=0, timeout=60)
        async with client:
            events = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True)
            return "".join([c.choices[0].text async for c in events])

    assert asyncio.run(stream()) == reference
    assert [m.id for m in sdk.models.list().data] == [MODEL]


def test_errors_arrive_as_the_sdks_exceptions(app, sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=MODEL, prompt="x", top_p=1.5)
    assert "top_p must be in (0, 1]" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=MODEL, prompt=[5] * 1000)
    assert "context" in err.value.message
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-4o", prompt="x")


def test_keys_are_enforced_on_both_protocols_and_health_stays_open(app):
    for key in ("wrong", KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=app["base_url"], api_key=key, max_retries=0).completions.create(
                model=MODEL, prompt="x", max_tokens=2)
    request = generation_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=2))
    for metadata in ([], [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as err:
            list(app["stub"].Generate(request, timeout=30, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            app["stub"].GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    second = [("authorization", "Bearer sk-second-key")]
    assert list(app["stub"].Generate(request, timeout=30, metadata=second))[-1].usage.completion_tokens == 2
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(app["channel"]).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with urllib.request.urlopen(app["base_url"].removesuffix("/v1") + "/health", timeout=10) as reply:
        assert reply.status == 200


def _finished(app) -> float:
    """Requests the verifiers finished by stop or length (a cancelled one counts as vLLM's
    `abort`), from the exported counter."""
    with urllib.request.urlopen(f"http://127.0.0.1:{app['ports']['metrics']}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("ray_dflash_request_success_total{")
               and ('finished_reason="stop"' in line or 'finished_reason="length"' in line))


def test_a_client_disconnecting_mid_stream_cancels_the_request_and_frees_every_block(app):
    # A request run to its end shows in the counter (exported every second): it is live. Earlier
    # tests' requests reach it first.
    start, previous = _finished(app), -1.0
    while start != previous:
        time.sleep(2)
        start, previous = _finished(app), start
    _grpc(app, prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=2))
    deadline = time.monotonic() + 30
    while (before := _finished(app)) == start and time.monotonic() < deadline:
        time.sleep(0.5)
    assert before == start + 1
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", app["base_url"] + "/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    stats = _idle(app)
    assert stats["kv_free_blocks"] == stats["kv_blocks"]
    time.sleep(3)
    assert _finished(app) == before, "the request ran to its end instead of being cancelled"


def test_a_gemma4_31b_twin_with_its_drafter_answers_a_chat_request(ray_serve, tmp_path_factory):
    """Issue 61, served: Gemma-4's 31B structure (two KV geometries, global keys derived from their
    values, sliding-window layers) and a drafter of the z-lab Gemma-4 layout, split
    topology. An OpenAI chat request is answered with the gRPC API's text, drafts were verified,
    and the tokens are the target's alone (an embedded target-only engine on the same prompt).
    Last in this file: it deploys its own application in the module app's place."""
    from transformers import AutoTokenizer

    from dflash_serve.services.config import EngineConfig
    from dflash_serve.services.engine.loader import build_engine
    from dflash_serve.services.engine.sampling_params import SamplingParams

    target, drafter = save_gemma4_pair(tmp_path_factory.mktemp("gemma4"), block_size=4)
    messages = [{"role": "user", "content": "def main():"}]
    with deployed_app(ray_serve, (target, drafter), http_port=ray_serve["http"], served_model_name="gemma4-twin",
                      max_pending=8) as deployed:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ray_serve['http']}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        reply = client.chat.completions.create(model="gemma4-twin", messages=messages, max_tokens=16, temperature=0.0)
        responses = list(deployed["stub"].Generate(generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in messages]),
            sampling=generation_pb2.SamplingParams(max_tokens=16, temperature=0.0)), timeout=120))
    served_ids = [t for r in responses for t in r.token_ids]
    assert reply.choices[0].message.content == "".join(r.text for r in responses)
    assert reply.usage.completion_tokens == len(served_ids) > 0
    assert responses[-1].spec_stats.num_draft_tokens > 0  # the drafter served
    prompt_ids = AutoTokenizer.from_pretrained(target).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert len(prompt_ids) == responses[-1].usage.prompt_tokens
    alone = build_engine(EngineConfig(target=target, drafter=None, device=DEVICE, num_kv_blocks=64, max_num_seqs=1))
    (seq,) = alone.generate([list(prompt_ids)], SamplingParams(temperature=0.0, max_tokens=16))
    assert served_ids == seq.output_ids
