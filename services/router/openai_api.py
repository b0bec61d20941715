"""The OpenAI-compatible HTTP API on Serve's HTTP port, in front of the same `Router`.

`POST /v1/chat/completions`, `POST /v1/completions` (streaming as server-sent events ending in
`data: [DONE]`, or one JSON body), `GET /v1/models`, and `GET /health` (open, like gRPC's health
service). A request body becomes the `dflash.v1.GenerateRequest` the gRPC API takes, so both
protocols share one validation, admission and cancellation path (`Router.outputs`); what this
module checks itself is only OpenAI's side: JSON types, parameter names, and parameters this
server does not implement, each refused with a 400 that names it — never silently ignored.

Responses follow OpenAI's shapes (`id`, `object`, `created`, `model`, `choices`, `usage`; finish
reasons `stop` and `length`; errors as `{"error": {"message", "type", "param", "code"}}`), and carry
the request's speculation statistics as vLLM's `--per-request-spec-decode-metrics` does, under
`metrics.speculative_decoding` (when streaming: on the usage chunk, so with
`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.engine.request import RequestOutput
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.router.auth import UNAUTHENTICATED_MESSAGE
from dflash_serve.services.router.router import RequestFailed, Router

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}

# Parameters that change what a completion is and that this server does not implement. A value
# equal to OpenAI's default is accepted (clients and frameworks often send it explicitly).
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v == 1,
    "echo": lambda v: v is False,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "function_call": lambda v: v == "none",
    "parallel_tool_calls": lambda v: False,
    "response_format": lambda v: v == {"type": "text"},
    "suffix": lambda v: v == "",
    "min_tokens": lambda v: v == 0,
    "reasoning_effort": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
}
# Parameters that only label a request (OpenAI's `user`, `metadata`, `store`, `service_tier`):
# they change nothing about the completion, and no tool expects an error for them.
_LABELS = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "stop_token_ids", "ignore_eos", "num_speculative_tokens"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETION = _COMMON | {"prompt"}


class OpenAIError(Exception):
    """An error in OpenAI's shape: HTTP status, message, type and the parameter at fault."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> OpenAIError:
        status, kind = _HTTP_STATUS.get(failure.code, (500, "internal_server_error"))
        return cls(status, failure.message, type=kind, code=failure.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


# -- request translation ------------------------------------------------------------------------


def generate_request(body: Any, *, chat: bool, model_name: str) -> tuple[generation_pb2.GenerateRequest, bool, bool]:
    """An OpenAI request body -> (the GenerateRequest the gRPC API takes, stream?, include_usage?)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not given", as in OpenAI's API
    known = _CHAT if chat else _COMPLETION
    for name, value in body.items():
        if name in known or name in _LABELS:
            continue
        if name in _NEUTRAL:
            if not _NEUTRAL[name](value):
                raise invalid(name, f"`{name}` is not supported by this server (it serves one completion per "
                                    f"request, as plain text): remove `{name}` from the request")
            continue
        raise invalid(name, f"unrecognized request argument `{name}`; this endpoint takes: "
                            f"{', '.join(sorted(known))}")
    model = body.get("model")
    if model is None:
        raise invalid("model", f"`model` is required: this server serves `{model_name}`")
    if model != model_name:
        raise OpenAIError(404, f"the model `{model}` does not exist: this server serves `{model_name}` "
                               "(GET /v1/models lists it)", type="not_found_error", param="model",
                          code="model_not_found")
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise invalid("stream_options", "`stream_options` takes {\"include_usage\": true|false}")
    if options and not stream:
        raise invalid("stream_options", "`stream_options` goes with `stream: true`")
    include_usage = _typed(options, "include_usage", bool, False, name="stream_options.include_usage")
    if options.get("continuous_usage_stats"):
        raise invalid("stream_options", "`stream_options.continuous_usage_stats` is not supported: "
                                        "usage comes on the last chunk with include_usage")

    request = generation_pb2.GenerateRequest(sampling=_sampling(body, chat=chat))
    if chat:
        request.chat.SetInParent()
        request.chat.messages.extend(_chat_messages(body.get("messages")))
    else:
        _set_prompt(request, body.get("prompt"))
    return request, stream, include_usage


def _sampling(body: dict, *, chat: bool) -> generation_pb2.SamplingParams:
    sampling = generation_pb2.SamplingParams()
    max_tokens = _typed(body, "max_tokens", int, None)
    if chat:
        newer = _typed(body, "max_completion_tokens", int, None)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise invalid("max_completion_tokens", "`max_tokens` and `max_completion_tokens` disagree: send one")
        max_tokens = newer if newer is not None else max_tokens
    if max_tokens is not None:
        sampling.max_tokens = _int32(max_tokens, "max_completion_tokens" if "max_completion_tokens" in body
                                     else "max_tokens")
    for name in ("temperature", "top_p"):
        value = _typed(body, name, float, None)
        if value is not None:
            if not math.isfinite(value):
                raise invalid(name, f"`{name}` must be a finite number")
            setattr(sampling, name, value)
    top_k = _typed(body, "top_k", int, None)
    if top_k is not None:
        sampling.top_k = 0 if top_k == -1 else _int32(top_k, "top_k")  # -1: off, as vLLM spells it
    seed = _typed(body, "seed", int, None)
    if seed is not None:
        if seed < 0:
            raise invalid("seed", f"`seed` must be >= 0, got {seed}")
        if seed >= 2**64:
            raise invalid("seed", f"`seed` must fit in 64 bits, got {seed}")
        sampling.seed = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop", "`stop` must be a string or a list of strings")
        sampling.stop.extend(stops)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
            raise invalid("stop_token_ids", "`stop_token_ids` must be a list of token ids (integers)")
        sampling.stop_token_ids.extend(_int32(t, "stop_token_ids") for t in stop_ids)
    sampling.ignore_eos = _typed(body, "ignore_eos", bool, False)
    speculative = _typed(body, "num_speculative_tokens", int, None)  # our extension: 0 opts out
    if speculative is not None:
        sampling.num_speculative_tokens = _int32(speculative, "num_speculative_tokens")
    return sampling


def _chat_messages(messages: Any) -> list[generation_pb2.ChatMessage]:
    if not isinstance(messages, list):
        raise invalid("messages", "`messages` is required: a list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(where, f"`{where}` must be an object with a string `role` and `content`")
        for name in message:
            if name not in ("role", "content", "name") and message[name] is not None:
                raise invalid(f"{where}.{name}", f"`{where}.{name}` is not supported: messages carry role and "
                                                 "text content only")
        out.append(generation_pb2.ChatMessage(role=message["role"], content=_text_content(message.get("content"),
                                                                                          where)))
    return out


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]", f"`{where}.content[{j}]` is not a text part: this model "
                                                       "takes text only ({\"type\": \"text\", \"text\": ...})")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content", f"`{where}.content` must be a string or a list of text parts")


def _set_prompt(request: generation_pb2.GenerateRequest, prompt: Any) -> None:
    """A string, one string in a list, or token ids (a list of integers, or one such list)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(_int32(t, "prompt") for t in prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", f"`prompt` holds {len(prompt)} prompts: send one per request")
    elif prompt is None:
        raise invalid("prompt", "`prompt` is required: a string, or a list of token ids")
    else:
        raise invalid("prompt", "`prompt` must be a string, or a list of token ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _typed(body: dict, key: str, kind: type, default, *, name: str | None = None):
    """body[key] checked against JSON's type for `kind` (an int is a float; a bool is neither)."""
    if key not in body:
        return default
    value = body[key]
    ok = (isinstance(value, bool) if kind is bool else _is_int(value) if kind is int
          else (isinstance(value, (int, float)) and not isinstance(value, bool)))
    if not ok:
        expected = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise invalid(name or key, f"`{name or key}` must be {expected}, got {json.dumps(value)}")
    return float(value) if kind is float else value


def _int32(value: int, name: str) -> int:
    if not -(2**31) <= value < 2**31:
        raise invalid(name, f"`{name}` is out of range: {value}")
    return value


# -- responses ----------------------------------------------------------------------------------


def spec_decoding(out: RequestOutput, num_spec_tokens: int) -> dict:
    """The request's speculation statistics in the shape of vLLM's per-request spec-decode metrics,
    with the acceptance count per draft position. The bonus token is not a draft."""
    stats = out.stats
    return {
        "num_spec_tokens": num_spec_tokens,
        "num_spec_steps": stats.rounds,
        "num_draft_tokens": stats.draft_tokens,
        "num_accepted_draft_tokens": stats.accepted_tokens,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "draft_acceptance_rate": stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0,
        "accepted_per_position": list(stats.accepted_per_position),
    }


def _finish_reason(out: RequestOutput) -> str:
    """OpenAI's finish reason; the router has already failed a request that ended in an error."""
    if out.finish_reason not in _FINISH_REASONS:
        raise OpenAIError(503, f"the request ended without completing ({out.finish_reason.value}): retry",
                          type="service_unavailable_error")
    return _FINISH_REASONS[out.finish_reason]


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}


class OpenAIServer:
    """The HTTP entry point: `await server(request)` answers one starlette Request."""

    def __init__(self, router: Router, model_name: str):
        self.router = router
        self.model_name = model_name
        self.created = int(time.time())

    async def __call__(self, request: Request) -> Response:
        route = (request.method, request.url.path.rstrip("/"))
        try:
            if route == ("GET", "/health"):
                return await self._health()
            if not self.router.authorized(request.headers.get("authorization")):
                raise OpenAIError(401, UNAUTHENTICATED_MESSAGE, type="authentication_error", code="invalid_api_key")
            if route == ("GET", "/v1/models"):
                return JSONResponse({"object": "list", "data": [
                    {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dflash-serve"}]})
            if route in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
                return await self._completion(request, chat=route[1] == "/v1/chat/completions")
            paths = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET", "/health": "GET"}
            if route[1] in paths:
                raise OpenAIError(405, f"{route[1]} takes {paths[route[1]]}, not {route[0]}")
            raise OpenAIError(404, f"no route {route[0]} {route[1]}; this server serves POST /v1/chat/completions, "
                                   "POST /v1/completions and GET /v1/models", type="not_found_error")
        except OpenAIError as err:
            return err.response()

    async def _health(self) -> Response:
        serving = await self.router.healthy()
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503)

    async def _completion(self, request: Request, *, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise OpenAIError(400, f"the request body is not JSON: {err}") from None
        generate, stream, include_usage = generate_request(body, chat=chat, model_name=self.model_name)
        request_id = uuid.uuid4().hex
        completion_id = ("chatcmpl-" if chat else "cmpl-") + request_id
        num_spec_tokens = await self._num_spec_tokens()
        shape = _Shape(completion_id, self.model_name, chat=chat, num_spec_tokens=num_spec_tokens)
        outputs = self.router.outputs(generate, request_id)
        try:
            # The first output (or the refusal) comes before the response starts, so a refused
            # request gets its own HTTP status, streamed or not.
            first = await anext(outputs)
        except RequestFailed as err:
            await outputs.aclose()
            raise OpenAIError.from_failure(err) from None
        except BaseException:  # the client went away: close the stream, which cancels the request
            await outputs.aclose()
            raise
        if stream:
            return StreamingResponse(shape.events(first, outputs, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async with aclosing(outputs):
            last, text = first, [first.new_text]
            try:
                async for last in outputs:
                    text.append(last.new_text)
            except RequestFailed as err:
                raise OpenAIError.from_failure(err) from None
        return JSONResponse(shape.whole("".join(text), _finish_reason(last), last))

    async def _num_spec_tokens(self) -> int:
        """Draft tokens per round (0: target-only). Fetching it may fail like any verifier call."""
        try:
            info = await self.router.model_info()
        except Exception as err:  # noqa: BLE001 - the client gets the reason, not a stack trace
            raise OpenAIError(503, f"the verifier did not answer: {type(err).__name__}: {err}",
                              type="service_unavailable_error") from None
        return max(0, info["block_size"] - 1) if info["drafter"] else 0


class _Shape:
    """One request's OpenAI response objects."""

    def __init__(self, completion_id: str, model: str, *, chat: bool, num_spec_tokens: int):
        self.id = completion_id
        self.model = model
        self.chat = chat
        self.num_spec_tokens = num_spec_tokens
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _with_metrics(self, body: dict, out: RequestOutput) -> dict:
        if self.num_spec_tokens:
            body["metrics"] = {"speculative_decoding": spec_decoding(out, self.num_spec_tokens)}
        return body

    def whole(self, text: str, finish_reason: str, last: RequestOutput) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=[choice], usage=_usage(last))
        return self._with_metrics(body, last)

    def _chunk(self, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}

    async def events(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                     include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per output, the finish reason on the last choice chunk, then
        usage and statistics on a chunk without choices (include_usage), then `[DONE]`. A failure
        after the response has started is an `error` event (the OpenAI SDK raises it)."""
        async with aclosing(outputs):
            out, role = first, self.chat
            try:
                while True:
                    finish = None
                    if out.finished:
                        async for _ in outputs:  # the router's end: it raises if the request failed
                            pass
                        finish = _finish_reason(out)
                    if out.new_text or role or finish:
                        chunk = self._chunk(out.new_text, finish, role=role)
                        yield _event(chunk | {"usage": None} if include_usage else chunk)
                        role = False
                    if finish:
                        break
                    out = await anext(outputs)
            except (RequestFailed, OpenAIError) as err:
                failure = OpenAIError.from_failure(err) if isinstance(err, RequestFailed) else err
                yield _event(failure.body())
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                usage = self._head("chat.completion.chunk" if self.chat else "text_completion")
                usage.update(choices=[], usage=_usage(out))
                yield _event(self._with_metrics(usage, out))
            yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

