"""The OpenAI HTTP API against a fake verifier, called with the real `openai` package (sync and
async, streaming and not) through an in-process transport: response shapes, the translation into
the gRPC path's request (same prompt ids and sampling), unsupported parameters refused by name,
errors as the SDK's exceptions, API keys on both protocols, and cancellation freeing the request."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.router.auth import ApiKeys
from dflash_serve.services.router.openai_api import OpenAIServer, generate_request
from tests.unit.test_router import (
    MODEL_INFO, FakeContext, FakeVerifier, fails_after_first_round, generate, hangs_after_first_round, make_router,
)
from tests.unit.test_router import tokenizer  # noqa: F401 - the fixture

MODEL = "tiny-model"
KEY = "sk-test-0123456789"


def asgi(server: OpenAIServer):
    """Serve's replica hands `__call__` a starlette Request per HTTP request; no lifespan events."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        response = await server(Request(scope, receive))
        await response(scope, receive, send)

    return app


@pytest.fixture
def verifier():
    return FakeVerifier()


@pytest.fixture
def router(tokenizer, verifier):  # noqa: F811
    return make_router(tokenizer, verifier, max_model_len=4096)


@pytest.fixture
def sdk(router):
    server = OpenAIServer(router, MODEL)
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=TestClient(asgi(server)),
                        max_retries=0)


def grpc_params(router, verifier, request):
    """What the gRPC API sends the verifier for `request`."""
    generate(router, request)
    return verifier.calls[-1]


def test_chat_completion_has_openai_shape_usage_and_spec_metrics(sdk, router, verifier, tokenizer):  # noqa: F811
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    completion = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.5,
                                             top_p=0.9, seed=3, stop=["\n\n"])
    assert completion.object == "chat.completion" and completion.model == MODEL and completion.id.startswith("chatcmpl-")
    assert completion.created > 0
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "abcde" and choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert completion.usage.prompt_tokens == len(rendered) and completion.usage.completion_tokens == 5
    assert completion.model_extra["metrics"]["speculative_decoding"] == {
        "num_spec_tokens": MODEL_INFO["block_size"] - 1, "num_spec_steps": 2, "num_draft_tokens": 10,
        "num_accepted_draft_tokens": 3, "mean_acceptance_length": 2.5, "draft_acceptance_rate": 0.3,
        "accepted_per_position": [2, 1, 0, 0, 0]}
    http_call = verifier.calls[-1]
    same = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in messages]),
        sampling=generation_pb2.SamplingParams(max_tokens=20, temperature=0.5, top_p=0.9, seed=3, stop=["\n\n"]))
    grpc_call = grpc_params(router, verifier, same)
    assert http_call.prompt_ids == grpc_call.prompt_ids == rendered and http_call.params == grpc_call.params


def test_chat_stream_with_include_usage(sdk):
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                              stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "abcde"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.total_tokens > 5
    assert last.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_ends_with_the_finish_reason(router):
    server = OpenAIServer(router, MODEL)
    with TestClient(asgi(server)) as http:
        body = http.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert body.status_code == 200 and body.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in body.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]


def test_completions_take_text_or_token_ids_streamed_or_not(sdk, router, verifier, tokenizer):  # noqa: F811
    completion = sdk.completions.create(model=MODEL, prompt="def main():", max_tokens=8, stop="\n")
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text == "abcde" and completion.choices[0].finish_reason == "length"
    assert verifier.calls[-1].prompt_ids == tokenizer.encode("def main():")
    assert verifier.calls[-1].params.stop == ("\n",) and verifier.calls[-1].params.max_tokens == 8
    sdk.completions.create(model=MODEL, prompt=[5, 6, 599])
    assert verifier.calls[-1].prompt_ids == [5, 6, 599]
    chunks = list(sdk.completions.create(model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abcde"
    assert chunks[-1].usage.completion_tokens == 5


def test_vllm_extensions_reach_the_verifier(sdk, verifier):
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=9,
                                extra_body={"top_k": 40, "ignore_eos": True, "stop_token_ids": [7]})
    params = verifier.calls[-1].params
    assert (params.max_tokens, params.top_k, params.ignore_eos, params.stop_token_ids) == (9, 40, True, (7,))
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"top_k": -1})
    assert verifier.calls[-1].params.top_k == 0
    assert verifier.calls[-1].params.num_speculative_tokens is None
    sdk.completions.create(model=MODEL, prompt="x", extra_body={"num_speculative_tokens": 0})  # ours: opt out
    assert verifier.calls[-1].params.num_speculative_tokens == 0


def test_models_lists_the_served_model(sdk):
    models = sdk.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].object == "model"


@pytest.mark.parametrize("extra, param", [
    (dict(n=2), "n"),
    (dict(logprobs=True), "logprobs"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(logit_bias={"5": 10}), "logit_bias"),
    (dict(extra_body={"guided_json": {}}), "guided_json"),
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(seed=-1), "seed"),
])
def test_unsupported_or_bad_parameters_are_a_400_naming_them(sdk, verifier, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **extra)
    assert err.value.status_code == 400 and err.value.param == param and f"`{param}`" in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    assert verifier.calls == []


def test_default_values_of_unsupported_parameters_are_accepted(sdk):
    completion = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=1,
                                             logprobs=False, presence_penalty=0, frequency_penalty=0, user="u1")
    assert completion.choices[0].message.content == "abcde"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(stop=["\n", ""]), "stop strings must be non-empty"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "'wizard'"),
    (dict(messages=[]), "chat has no messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "not a text part"),
])
def test_the_router_validation_answers_http_requests_too(sdk, verifier, kwargs, fragment):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}]) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(**request)
    assert fragment in err.value.message and verifier.calls == []


def test_an_unknown_model_is_a_404(sdk):
    with pytest.raises(openai.NotFoundError) as err:
        sdk.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-4o" in err.value.message and MODEL in err.value.message


def test_server_failures_map_to_http_statuses(tokenizer):  # noqa: F811
    router = make_router(tokenizer, FakeVerifier(hangs_after_first_round), max_pending=1, max_model_len=4096)
    router._in_flight.add("someone-else")
    with TestClient(asgi(OpenAIServer(router, MODEL))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:
            sdk.completions.create(model=MODEL, prompt="x")
        assert "retry later" in err.value.message


def test_a_failure_mid_stream_is_an_error_event_the_sdk_raises(tokenizer):  # noqa: F811
    router = make_router(tokenizer, FakeVerifier(fails_after_first_round), max_model_len=4096)
    with TestClient(asgi(OpenAIServer(router, MODEL))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        with pytest.raises(openai.APIError) as err:
            list(sdk.completions.create(model=MODEL, prompt="x", stream=True))
        assert "an illegal memory access" in err.value.message
        with pytest.raises(openai.InternalServerError):
            sdk.completions.create(model=MODEL, prompt="x")
    assert router._in_flight == set()


def test_async_client_streams(router):
    server = OpenAIServer(router, MODEL)

    async def run():
        transport = httpx.ASGITransport(app=asgi(server))
        async with httpx.AsyncClient(transport=transport) as http:
            sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
            stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       stream=True)
            return [c.choices[0].delta.content or "" async for c in stream]

    assert "".join(asyncio.run(run())) == "abcde"


# -- cancellation ---------------------------------------------------------------------------------


def _scope(path: str, body: bytes):
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "server": ("testserver", 80), "scheme": "http", "root_path": ""}
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    return scope, receive


def test_closing_a_stream_cancels_the_verifier_call_and_frees_the_slot(tokenizer):  # noqa: F811
    verifier = FakeVerifier(hangs_after_first_round)
    router = make_router(tokenizer, verifier, max_model_len=4096)
    server = OpenAIServer(router, MODEL)

    async def run():
        body = json.dumps({"model": MODEL, "prompt": "x", "stream": True}).encode()
        response = await server(Request(*_scope("/v1/completions", body)))
        events = response.body_iterator
        first = await anext(events)
        assert json.loads(first[len("data: "):])["choices"][0]["text"] == "ab"
        await events.aclose()  # what the response does when the client disconnects

    asyncio.run(run())
    assert verifier.streams[0].cancelled and router._in_flight == set()


def test_cancelling_a_whole_completion_cancels_the_verifier_call(tokenizer):  # noqa: F811
    verifier = FakeVerifier(hangs_after_first_round)
    router = make_router(tokenizer, verifier, max_model_len=4096)
    server = OpenAIServer(router, MODEL)

    async def run():
        body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
        task = asyncio.ensure_future(server(Request(*_scope("/v1/completions", body))))
        while not verifier.streams:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()  # what Serve does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert verifier.streams[0].cancelled and router._in_flight == set()


# -- API keys -------------------------------------------------------------------------------------


def test_http_needs_a_valid_key_except_for_health(tokenizer, verifier):  # noqa: F811
    router = make_router(tokenizer, verifier, max_model_len=4096)
    router.api_keys = ApiKeys([KEY, "another-key"])
    with TestClient(asgi(OpenAIServer(router, MODEL))) as http:
        for key in ("none", KEY[:-1], KEY + "0"):
            sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert "Bearer" in err.value.message and key not in err.value.message
            with pytest.raises(openai.AuthenticationError):
                sdk.models.list()
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        assert verifier.calls == []
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
        assert sdk.completions.create(model=MODEL, prompt="x").choices[0].text == "abcde"
        assert http.get("/health").json() == {"status": "SERVING"}


class MetadataContext(FakeContext):
    def __init__(self, metadata):
        super().__init__()
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def test_grpc_needs_a_valid_key_except_for_health(tokenizer, verifier):  # noqa: F811
    from grpc_health.v1 import health_pb2

    router = make_router(tokenizer, verifier)
    router.api_keys = ApiKeys([KEY])
    request = generation_pb2.GenerateRequest(prompt="hi")
    for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", KEY)]):
        context = MetadataContext(metadata)

        async def consume():
            return [r async for r in router.Generate(request, context)]

        with pytest.raises(Exception) as err:
            asyncio.run(consume())
        assert context.code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in context.details
        assert KEY not in str(err.value)
        context = MetadataContext(metadata)
        assert asyncio.run(router.GetModelInfo(generation_pb2.GetModelInfoRequest(), context)) == generation_pb2.ModelInfo()
        assert context.code == grpc.StatusCode.UNAUTHENTICATED
    assert verifier.calls == []
    context = MetadataContext([("authorization", f"Bearer {KEY}")])

    async def consume_ok():
        return [r async for r in router.Generate(request, context)]

    assert "".join(r.text for r in asyncio.run(consume_ok())) == "abcde" and context.code is None
    health = asyncio.run(router.Check(health_pb2.HealthCheckRequest(), MetadataContext([])))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"\n  {KEY}  \nsecond\n")
    keys = ApiKeys.from_file(str(path))
    assert keys.allows(f"Bearer {KEY}") and keys.allows("bearer second") and not keys.allows("Bearer sec")
    assert not keys.allows(None) and not keys.allows(KEY)
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.from_file(str(path))
    with pytest.raises(ValueError, match="cannot be read") as err:
        ApiKeys.from_file(str(tmp_path / "missing"))
    assert "api_keys_file" in str(err.value)


def test_translation_needs_a_model_and_one_prompt():
    with pytest.raises(Exception, match="`model` is required"):
        generate_request({"prompt": "x"}, chat=False, model_name=MODEL)
    with pytest.raises(Exception, match="2 prompts"):
        generate_request({"model": MODEL, "prompt": ["a", "b"]}, chat=False, model_name=MODEL)
    request, stream, usage = generate_request({"model": MODEL, "prompt": ["a"], "stream": True,
                                               "stream_options": {"include_usage": True}}, chat=False, model_name=MODEL)
    assert request.prompt == "a" and stream and usage
