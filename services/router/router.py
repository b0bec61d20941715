"""The ingress: validation, tokenization, admission and streaming in front of the verifiers.

`Router` is a plain class; `dflash_serve.services.app` wraps it in a Ray Serve deployment whose gRPC methods
(`dflash.v1.Generation` and `grpc.health.v1.Health/Check`) call the methods of the same names, and
whose HTTP entry point serves the OpenAI API (`dflash_serve.services.router.openai_api`) on top of `outputs`,
the one path every request takes whatever its protocol: authentication is checked by each
protocol's front, then admission, validation, the verifier call and its cancellation are shared.
The verifier is reached through its handle (`generate`, `model_info`, `check_health`), or, once
the router knows the verifiers' engine processes, a request goes straight to one of them
(`direct_intake`); either way its outputs come back over an output stream
(`verifier.output_stream`), one frame per engine step for all of this router's requests, and each
yield of `outputs` merges everything that arrived since the last, so a client that reads slower
than the engine gets fewer, larger messages rather than a growing queue.

Client errors never surface as exceptions with a stack trace: `outputs` raises `RequestFailed`
with a status code and a readable message, which gRPC sets on `grpc_context`. A streaming call then
ends by raising `RpcFailed`, because Ray Serve 2.60 sends a status set on a stream only together
with a later message or exception — set and returned without one, the client sees OK (checked on a
real Serve gRPC proxy). Unary calls return an empty message instead, which carries the status as is.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from jinja2 import TemplateError
from ray.exceptions import NodeDiedError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.engine.request import RequestOutput
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.router.auth import UNAUTHENTICATED_MESSAGE, ApiKeys, grpc_authorization
from dflash_serve.services.router.direct_intake import DirectIntake
from dflash_serve.services.router.validation import (
    InvalidRequest,
    chat_messages,
    check_prompt_bytes,
    check_prompt_text,
    check_stop_token_ids,
    check_token_ids,
    fit_to_context,
    max_prompt_bytes,
    no_input,
    sampling_params,
)
from dflash_serve.services.verifier.output_stream import (
    FINISH_REASONS,
    LOOP_STOPPED,
    OutputListener,
    StreamAddress,
    StreamLost,
)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_CHECK_TIMEOUT_S = 5.0  # a verifier busy with a long prefill still answers within this
FIRST_OUTPUT_CHECK_S = 1.0  # how often a request with no output yet asks whether any verifier runs
log = logging.getLogger(__name__)

# A verifier call lost to its replica (died, restarting, unreachable): retryable, UNAVAILABLE.
_REPLICA_GONE = (RayActorError, NodeDiedError, ReplicaUnavailableError, StreamLost)
# A request whose replica was lost before it produced a token goes again, at most this many times,
# each after Serve's health-check period (app.HEALTH_CHECK_PERIOD_S): by then Serve has seen the
# lost replica fail its check and routes no more calls to it.
LOST_REPLICA_RETRIES = 2
LOST_REPLICA_RETRY_WAIT_S = 1.0
# Text up to this size is tokenized on the event loop: the hop to the tokenizer thread and back costs more than
# tokenizing it (an alpaca question with the chat template: 0.09 ms); longer text would hold the loop up.
INLINE_TOKENIZE_BYTES = 4096


class RpcFailed(Exception):
    """Ends a call whose status code and details are already set on its grpc_context."""


class RequestFailed(Exception):
    """A request refused or failed: the status gRPC sets, and the HTTP API maps to its own.
    `replica_lost`: its verifier replica failed, not the request (it may go to another)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, replica_lost: bool = False):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.replica_lost = replica_lost


class Router:
    def __init__(
        self,
        verifier_handle,
        tokenizer: str | Any,
        *,
        max_model_len: int,
        max_tokens_limit: int,
        default_max_tokens: int,
        max_pending: int,
        running_verifiers: Callable[[], Awaitable[int]] | None = None,
        api_keys: ApiKeys | None = None,
        outputs_host: str = "127.0.0.1",
        stream_messages_per_s: float = 0.0,
        registered_engines: Callable[[], Awaitable[dict[str, StreamAddress]]] | None = None,
        forget_engine: Callable[[str], Awaitable[None]] | None = None,
    ):
        """tokenizer: the target's tokenizer folder or hub id, or a loaded tokenizer.
        running_verifiers: how many verifier replicas are up (None: never asked).
        api_keys: the keys a call must present (None: no authentication).
        outputs_host: the address the verifiers reach this router's output stream at.
        stream_messages_per_s: the messages a second this router aims to stream (ServeConfig's; 0: no pacing).
        registered_engines: the verifiers' engine processes' intake addresses (None: every request
        is a Serve call); forget_engine: deletes a registration whose engine is gone."""
        if isinstance(tokenizer, str):
            from dflash_serve.services.models.target_files import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.verifier = verifier_handle
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.max_pending = max_pending
        self.stream_messages_per_s = stream_messages_per_s
        self.running_verifiers = running_verifiers
        self.api_keys = api_keys
        self.max_prompt_bytes = max_prompt_bytes(tokenizer, max_model_len)
        self._in_flight: set[str] = set()  # request ids admitted and not yet finished
        self._model_info: dict | None = None  # the verifier's, fetched once
        self.verifier_outputs = OutputListener(outputs_host)
        if (registered_engines is None) != (forget_engine is None):
            raise ValueError("registered_engines and forget_engine go together: the direct intake needs both")
        self.direct = (DirectIntake(self.verifier_outputs, registered_engines, forget_engine)
                       if registered_engines is not None else None)
        # Tokenizing a long prompt takes milliseconds: off the event loop that streams every other
        # request's tokens, on one thread because a fast tokenizer is not safe to share between threads.
        # Short text is tokenized on the loop, with a copy of its own for the same reason.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._loop_tokenizer = copy.deepcopy(tokenizer)

    # -- dflash.v1.Generation --------------------------------------------------------------------

    async def Generate(self, request, grpc_context):  # noqa: N802 - gRPC method names
        """Streams GenerateResponses: new text and token ids as they are accepted; the last one
        carries the finish reason, usage and speculation statistics."""
        if not self._grpc_authorized(grpc_context):
            raise _abort(grpc_context, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            async with aclosing(self.outputs(request, request_id)) as outputs:
                async for out in outputs:
                    yield _response(request_id, out)
        except RequestFailed as err:
            raise _abort(grpc_context, err.code, err.message) from None

    async def Complete(self, request, grpc_context):  # noqa: N802
        """The whole completion in one GenerateResponse."""
        merged = generation_pb2.GenerateResponse()
        try:
            async for response in self.Generate(request, grpc_context):
                merged.request_id = response.request_id
                merged.text += response.text
                merged.token_ids.extend(response.token_ids)
                merged.finish_reason = response.finish_reason
                if response.HasField("usage"):
                    merged.usage.CopyFrom(response.usage)
                    merged.spec_stats.CopyFrom(response.spec_stats)
        except RpcFailed:
            return generation_pb2.GenerateResponse()
        return merged

    async def GetModelInfo(self, request, grpc_context):  # noqa: N802
        if not self._grpc_authorized(grpc_context):
            _set_status(grpc_context, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            return generation_pb2.ModelInfo()
        try:
            info = await self.model_info()
        except Exception as err:  # noqa: BLE001 - the client gets the reason, not a stack trace
            _set_status(grpc_context, grpc.StatusCode.INTERNAL, f"the verifier did not answer: {_describe(err)}")
            return generation_pb2.ModelInfo()
        return generation_pb2.ModelInfo(**{f.name: info[f.name] for f in generation_pb2.ModelInfo.DESCRIPTOR.fields})

    # -- grpc.health.v1.Health -------------------------------------------------------------------

    async def Check(self, request, grpc_context):  # noqa: N802
        """SERVING while a verifier replica answers its health check in time, NOT_SERVING otherwise
        (its engine loop stopped, a sticky CUDA error, no replica up): a load balancer then sends
        requests elsewhere instead of into errors."""
        if request.service not in ("", GENERATION_SERVICE):
            _set_status(grpc_context, grpc.StatusCode.NOT_FOUND,
                        f"unknown service {request.service!r}; this server serves {GENERATION_SERVICE!r}")
            return health_pb2.HealthCheckResponse()
        serving = await self.healthy()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING if serving
                                              else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def healthy(self) -> bool:
        try:
            await asyncio.wait_for(self.verifier.check_health.remote(), timeout=HEALTH_CHECK_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure or a timeout: not serving
            return False
        return True

    # -- one request -----------------------------------------------------------------------------

    def authorized(self, authorization: str | None) -> bool:
        """authorization: the `Bearer KEY` the call presented (None: it presented none)."""
        return self.api_keys is None or self.api_keys.allows(authorization)

    def _grpc_authorized(self, grpc_context) -> bool:
        return self.api_keys is None or self.authorized(grpc_authorization(grpc_context.invocation_metadata()))

    async def outputs(self, request, request_id: str) -> AsyncIterator[RequestOutput]:
        """The verifier's outputs for a `dflash.v1.GenerateRequest`, after admission and validation;
        raises RequestFailed. Closing it early (the client went away) cancels the verifier call,
        which frees the request's KV on the verifier and its drafter. A request whose replica was
        lost before it produced a token is sent again (LOST_REPLICA_RETRIES)."""
        self._admit(request_id)
        try:
            try:
                prompt_ids, params = await self._prepare(request)
            except InvalidRequest as err:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
            for attempt in range(LOST_REPLICA_RETRIES + 1):
                produced = False
                try:
                    async with aclosing(self._call(prompt_ids, params, request_id)) as outputs:
                        async for out in outputs:  # closed at once when the client goes: its call is cancelled
                            produced = True
                            yield out
                    return
                except RequestFailed as err:
                    if produced or not err.replica_lost or attempt == LOST_REPLICA_RETRIES:
                        raise
                    log.warning("request %s: %s; sending it again", request_id, err.message)
                await asyncio.sleep(LOST_REPLICA_RETRY_WAIT_S)
        finally:
            self._in_flight.discard(request_id)

    async def _call(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                    ) -> AsyncIterator[RequestOutput]:
        """One verifier call's outputs (direct, or a Serve call); raises RequestFailed. A stopped engine loop's end of the
        request is passed on only with tokens that came with it: the status says why it ended, and
        a request that produced nothing may go again."""
        queue = self.verifier_outputs.open(request_id)
        try:
            engine = self.direct.pick() if self.direct is not None else None
            if engine is not None:
                engine.add(request_id, prompt_ids, params)
                cancel = functools.partial(engine.cancel, request_id)
            else:
                reply_to = await self.verifier_outputs.reply_to()
                call = self.verifier.generate.remote(prompt_ids, params, request_id, reply_to)
                ended = asyncio.ensure_future(call)
                ended.add_done_callback(lambda task: self.verifier_outputs.put_end(request_id, _CallEnded(task)))
                cancel = call.cancel
            last: RequestOutput | None = None
            try:
                async for last in self._merged_outputs(request_id, queue):
                    if not _loop_stopped(last) or last.new_token_ids:
                        yield last
            finally:
                if last is None or not last.finished:
                    cancel()  # the client cancelled, its deadline passed, or the call failed
        finally:
            self.verifier_outputs.close(request_id)
        if last is None or not last.finished:
            raise RequestFailed(grpc.StatusCode.INTERNAL, "the verifier's stream ended before the request finished")
        if _loop_stopped(last):
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"the verifier replica serving this request failed "
                                f"({last.error}): retry", replica_lost=True)
        if _finish_reason(last) == generation_pb2.FINISH_REASON_ERROR:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"generation failed: {last.error or 'no reason given'}")

    async def _merged_outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs up to its last, each one merging every output that arrived since
        the one before; raises RequestFailed when its call fails or its output stream is lost."""
        produced = False
        item = await self._first_item(queue)
        while True:
            arrived = []
            while True:  # everything already here
                if isinstance(item, RequestOutput):
                    arrived.append(item)
                    if item.finished:  # whatever follows (the call's end, a stream closing) is moot
                        break
                elif isinstance(item, StreamLost):
                    raise _verifier_failed(item, produced=produced or bool(arrived))
                elif item.error is not None:
                    raise _verifier_failed(item.error, produced=produced or bool(arrived))
                else:  # the call ended; what it produced and has not arrived is in this stream
                    self.verifier_outputs.attach(request_id, item.stream_id)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if arrived:
                produced = True
                out = _merge(arrived)
                yield out
                if out.finished:
                    return
                if self.stream_messages_per_s > 0:  # the next steps' outputs gather meanwhile: one message
                    await self.verifier_outputs.wait_unless_ended(request_id,
                                                                  len(self._in_flight) / self.stream_messages_per_s)
            item = await queue.get()

    async def _first_item(self, queue: asyncio.Queue):
        """The request's first output or call result. While none has come, ask every
        FIRST_OUTPUT_CHECK_S whether a verifier replica is running at all: during a replica's
        restart Serve would hold the call until one is back (~20 s), so fail fast instead."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), FIRST_OUTPUT_CHECK_S)
            except TimeoutError:
                if self.running_verifiers is not None and await self._none_running():
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                        "no verifier replica is running (one is starting or restarting): retry shortly")

    def _admit(self, request_id: str) -> None:
        if request_id in self._in_flight:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already in flight: "
                                "use a unique id per request, or leave it empty")
        if len(self._in_flight) >= self.max_pending:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server is at its limit of "
                                f"{self.max_pending} requests in flight: retry later, with backoff")
        self._in_flight.add(request_id)

    async def _prepare(self, request) -> tuple[list[int], SamplingParams]:
        """Validated prompt token ids and sampling parameters, server defaults applied."""
        params = sampling_params(request.sampling, default_max_tokens=self.default_max_tokens,
                                 max_tokens_limit=self.max_tokens_limit)
        if params.stop_token_ids:
            check_stop_token_ids(params.stop_token_ids, (await self.model_info())["vocab_size"])
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            vocab_size = (await self.model_info())["vocab_size"]
            check_token_ids(request.token_ids.ids, vocab_size)
            prompt_ids = list(request.token_ids.ids)
        elif kind in ("prompt", "chat"):
            text_bytes = (len(request.prompt.encode()) if kind == "prompt"
                          else sum(len(m.content.encode()) for m in request.chat.messages))
            check_prompt_bytes(text_bytes, self.max_prompt_bytes, self.max_model_len)
            if text_bytes <= INLINE_TOKENIZE_BYTES:
                prompt_ids = self._tokenize(request, self._loop_tokenizer)
            else:
                loop = asyncio.get_running_loop()
                prompt_ids = await loop.run_in_executor(self._tokenizer_thread, self._tokenize, request, self.tokenizer)
        else:
            raise no_input()
        return prompt_ids, fit_to_context(params, len(prompt_ids), self.max_model_len)

    @staticmethod
    def _tokenize(request, tokenizer) -> list[int]:
        if request.WhichOneof("input") == "prompt":
            check_prompt_text(request.prompt)
            return tokenizer.encode(request.prompt)
        messages = chat_messages(request.chat.messages)
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidRequest(
                "this model's tokenizer has no chat template: send prompt (raw text) or token_ids instead")
        try:
            return list(tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        except TemplateError as err:  # the template's own checks, e.g. roles that must alternate
            raise InvalidRequest(f"the chat template refused these messages: {err}") from None

    async def _none_running(self) -> bool:
        try:
            return await self.running_verifiers() == 0
        except Exception:  # noqa: BLE001 - no answer from the controller proves nothing: keep waiting
            log.warning("could not read the verifier replicas' state", exc_info=True)
            return False

    async def model_info(self) -> dict:
        if self._model_info is None:
            self._model_info = await self.verifier.model_info.remote()
        return self._model_info


def _response(request_id: str, out: RequestOutput) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=request_id, text=out.new_text, token_ids=out.new_token_ids)
    if not out.finished:
        return response
    response.finish_reason = _finish_reason(out)
    response.usage.CopyFrom(generation_pb2.Usage(
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        total_tokens=out.num_prompt_tokens + out.num_output_tokens,
    ))
    stats = out.stats
    response.spec_stats.CopyFrom(generation_pb2.SpecStats(
        num_drafts=stats.rounds,
        num_draft_tokens=stats.draft_tokens,
        num_accepted_tokens=stats.accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
    ))
    return response


def _finish_reason(out: RequestOutput) -> int:
    """A finished output without a reason is a verifier bug: reported as an error, not a success."""
    return FINISH_REASONS.get(out.finish_reason, generation_pb2.FINISH_REASON_ERROR)


class _CallEnded:
    """A request's verifier call ended: the stream id it returned, or the exception it raised."""

    __slots__ = ("error", "stream_id")

    def __init__(self, task: asyncio.Future):
        self.stream_id, self.error = None, None
        if task.cancelled():
            self.error = asyncio.CancelledError()
        elif task.exception() is not None:
            self.error = task.exception()
        else:
            self.stream_id = task.result()


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their new tokens and text, the last one's state."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(last, new_token_ids=[t for out in outputs for t in out.new_token_ids],
                               new_text="".join(out.new_text for out in outputs))


def _set_status(context, code: grpc.StatusCode, details: str) -> None:
    context.set_code(code)
    context.set_details(details)


def _abort(context, code: grpc.StatusCode, details: str) -> RpcFailed:
    """Sets the call's status; returns the exception that ends a streaming call with it."""
    _set_status(context, code, details)
    return RpcFailed(f"{code.name}: {details}")


def _verifier_failed(err: Exception, *, produced: bool) -> RequestFailed:
    cause = _cause(err)
    if not produced and isinstance(cause, ValueError):  # the engine refused the request: a client error
        return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(cause))
    if isinstance(err, _REPLICA_GONE) or isinstance(cause, _REPLICA_GONE):
        # The replica died or is restarting: nothing wrong with the request, and Serve brings a
        # replica back — a retryable loss, as gRPC's UNAVAILABLE says.
        return RequestFailed(grpc.StatusCode.UNAVAILABLE,
                             f"the verifier replica serving this request is gone ({_describe(err)}): retry",
                             replica_lost=True)
    return RequestFailed(grpc.StatusCode.INTERNAL, f"the verifier failed: {_describe(err)}")


def _loop_stopped(out: RequestOutput) -> bool:
    """An output ended by its replica's engine loop stopping (`engine_process.EngineLoop.run`)."""
    return out.finish_reason is FinishReason.ERROR and (out.error or "").startswith(LOOP_STOPPED)


def _cause(err: BaseException) -> BaseException:
    """The replica's own exception: Ray re-raises it wrapped, keeping the original as `cause`."""
    return getattr(err, "cause", None) or err


def _describe(err: BaseException) -> str:
    cause = _cause(err)
    return f"{type(cause).__name__}: {cause}"
