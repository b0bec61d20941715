"""The gRPC router against a fake verifier: validation with readable INVALID_ARGUMENT messages,
server defaults, prompt/chat/token_ids tokenization, the response mapping, verifier failures,
cancellation and deadlines (the verifier call is cancelled, the admission slot freed), admission
limits, duplicate request ids, health; and the blocking client over a real in-process gRPC server."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import ReplicaUnavailableError
from transformers import PreTrainedTokenizerFast

from dflash_serve.services import client
from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc
from dflash_serve.services.engine.request import RequestOutput, SpecStats
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.router import router as router_module
from dflash_serve.services.router.router import Router, RpcFailed
from dflash_serve.services.verifier.output_stream import StreamAddress, RouterChannel
from tests.tokenizer import train_tiny_tokenizer

VOCAB = 600
MODEL_INFO = dict(target="tiny-target", drafter="tiny-drafter", block_size=6, max_model_len=64,
                  max_tokens_limit=100, vocab_size=VOCAB, topology="split", target_revision="t-commit",
                  drafter_revision="")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STATS = SpecStats(rounds=2, draft_tokens=10, accepted_tokens=3, accepted_per_position=[2, 1, 0, 0, 0])
S = generation_pb2.SamplingParams
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def tokenizer():
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(VOCAB), eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


# -- fakes ----------------------------------------------------------------------------------------


@dataclass
class Call:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str


class FakeCall:
    """What `verifier.generate.remote(...)` returns: awaitable and cancellable. Like the verifier,
    it sends each output of its script over a real output stream to the router's `reply_to` (one
    frame each) and ends with the stream's id, or raises what the script raises."""

    def __init__(self, outputs, reply_to: StreamAddress, *, one_frame: bool):
        self.cancelled = False
        self._task = asyncio.ensure_future(self._run(outputs, reply_to, one_frame))

    async def _run(self, outputs, reply_to: StreamAddress, one_frame: bool) -> str:
        channel = RouterChannel.connect(reply_to)
        try:
            async for out in outputs:
                channel.add(out)
                if not one_frame:  # a frame per output, as one engine step each
                    assert channel.flush()
                    await asyncio.sleep(0)
            assert channel.flush()
            return channel.stream_id
        except Exception:
            # A call's failure reaches a router through Ray, well after the outputs its replica
            # sent before failing have come over the socket.
            await asyncio.sleep(0.05)
            raise
        finally:
            while channel.flush() and channel._unsent:  # what the socket did not take yet
                await asyncio.sleep(0.001)
            channel.close()

    def __await__(self):
        return self._task.__await__()

    def cancel(self):
        self.cancelled = True
        self._task.cancel()


class FakeVerifier:
    """The verifier handle's shape. `script(prompt_ids, params, request_id)` is an async generator
    of RequestOutputs; replace it to change what the next call streams."""

    def __init__(self, script=None, *, one_frame: bool = False):
        self.script = script or three_rounds
        self.one_frame = one_frame  # every output of a call in one frame, as if of one engine step
        self.calls: list[Call] = []
        self.streams: list[FakeCall] = []
        self.model_info_calls = 0
        self.generate = SimpleNamespace(remote=self._remote)
        self.model_info = SimpleNamespace(remote=self._model_info)
        self.health = None  # None: healthy; an exception: raised; "hang": never answers
        self.check_health = SimpleNamespace(remote=self._check_health)

    def _remote(self, prompt_ids, params, request_id, reply_to):
        self.calls.append(Call(prompt_ids, params, request_id))
        self.streams.append(FakeCall(self.script(prompt_ids, params, request_id), reply_to,
                                     one_frame=self.one_frame))
        return self.streams[-1]

    async def _check_health(self):
        if self.health == "hang":
            await asyncio.Event().wait()
        if self.health is not None:
            raise self.health

    async def _model_info(self):
        self.model_info_calls += 1
        return dict(MODEL_INFO)


def output(request_id, prompt_ids, ids, text, produced, reason=None, error=None) -> RequestOutput:
    return RequestOutput(request_id, ids, text, finished=reason is not None, finish_reason=reason,
                         num_prompt_tokens=len(prompt_ids), num_output_tokens=produced, stats=STATS, error=error)


async def three_rounds(prompt_ids, params, request_id, reason=FinishReason.LENGTH):
    yield output(request_id, prompt_ids, [10, 11], "ab", 2)
    yield output(request_id, prompt_ids, [12, 13], "cd", 4)
    yield output(request_id, prompt_ids, [14], "e", 5, reason)


async def hangs_after_first_round(prompt_ids, params, request_id):
    yield output(request_id, prompt_ids, [10, 11], "ab", 2)
    await asyncio.Event().wait()


async def fails_after_first_round(prompt_ids, params, request_id):
    yield output(request_id, prompt_ids, [10, 11], "ab", 2)
    yield output(request_id, prompt_ids, [12], "c", 3, FinishReason.ERROR, error="CUDA error: an illegal memory access")


def raising(err: Exception, *, after_first_round: bool = False):
    async def script(prompt_ids, params, request_id):
        if after_first_round:
            yield output(request_id, prompt_ids, [10, 11], "ab", 2)
        raise err
        yield  # an async generator

    return script


class FakeContext:
    """Records what the router sets on Ray Serve's grpc_context."""

    def __init__(self):
        self.code = None
        self.details = None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def make_router(tokenizer, verifier=None, **overrides) -> Router:
    limits = dict(max_model_len=64, max_tokens_limit=100, default_max_tokens=16, max_pending=4) | overrides
    return Router(verifier or FakeVerifier(), tokenizer, **limits)


def generate(router: Router, request) -> tuple[list, FakeContext]:
    """All responses of Generate, and its context (with the status, if the call failed)."""
    context = FakeContext()

    async def consume():
        responses = []
        try:
            async for response in router.Generate(request, context):
                responses.append(response)
        except RpcFailed:
            assert context.code not in (None, Code.OK), "a failed call must carry its status"
        return responses

    return asyncio.run(consume()), context


def complete(router: Router, request) -> tuple:
    context = FakeContext()
    return asyncio.run(router.Complete(request, context)), context


def chat(*messages) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages])


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_kwargs, fragments",
    [
        (dict(), ["no input", "prompt, chat or token_ids"]),
        (dict(prompt=""), ["prompt is empty"]),
        (dict(prompt="x", sampling=S(max_tokens=0)), ["max_tokens must be >= 1", "got 0"]),
        (dict(prompt="x", sampling=S(max_tokens=-3)), ["max_tokens must be >= 1", "got -3"]),
        (dict(prompt="x", sampling=S(max_tokens=101)), ["max_tokens must be <= 100", "got 101"]),
        (dict(prompt="x", sampling=S(temperature=-0.5)), ["temperature", ">= 0", "-0.5"]),
        (dict(prompt="x", sampling=S(temperature=math.nan)), ["temperature", "finite", "nan"]),
        (dict(prompt="x", sampling=S(top_p=0.0)), ["top_p must be in (0, 1]", "got 0"]),
        (dict(prompt="x", sampling=S(top_p=1.5)), ["top_p must be in (0, 1]", "got 1.5"]),
        (dict(prompt="x", sampling=S(top_k=-1)), ["top_k must be >= 0", "got -1"]),
        (dict(prompt="x", sampling=S(stop=["\n", ""])), ["stop strings must be non-empty", "stop[1]"]),
        (dict(prompt="x", sampling=S(seed=2**64 - 1)), ["seed", "64-bit"]),
        (dict(chat=generation_pb2.ChatMessages()), ["chat has no messages"]),
        (dict(chat=chat(("user", "hi"), ("wizard", "x"))),
         ["message 1", "'wizard'", "allowed roles: system, user, assistant, tool"]),
        (dict(token_ids=generation_pb2.TokenIds()), ["token_ids is empty"]),
        (dict(token_ids=generation_pb2.TokenIds(ids=[5, 600, -1])), ["[600, -1]", "vocabulary [0, 600)"]),
        (dict(prompt="x", sampling=S(stop_token_ids=[5, 600, 7])), ["stop_token_ids [600]", "vocabulary [0, 600)"]),
    ],
    ids=["no-input", "empty-prompt", "max-tokens-0", "max-tokens-negative", "max-tokens-over-limit",
         "temperature-negative", "temperature-nan", "top-p-0", "top-p-over-1", "top-k-negative", "empty-stop",
         "seed-over-int64", "empty-chat", "unknown-role", "empty-token-ids", "token-ids-out-of-range",
         "stop-token-ids-out-of-range"],
)
def test_invalid_input_gets_invalid_argument_saying_what_to_fix(tokenizer, request_kwargs, fragments):
    verifier = FakeVerifier()
    responses, context = generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(**request_kwargs))
    assert responses == [] and verifier.calls == []
    assert context.code == Code.INVALID_ARGUMENT
    for fragment in fragments:
        assert fragment in context.details


def test_a_prompt_that_fills_the_context_is_refused_naming_both_lengths(tokenizer):
    prompt = "the quick brown fox jumps over the lazy dog " * 20
    prompt_len = len(tokenizer.encode(prompt))
    verifier = FakeVerifier()
    _, context = generate(make_router(tokenizer, verifier, max_model_len=prompt_len),
                          generation_pb2.GenerateRequest(prompt=prompt))
    assert context.code == Code.INVALID_ARGUMENT
    assert f"{prompt_len} tokens" in context.details and f"context is {prompt_len} tokens" in context.details
    assert verifier.calls == []
    # One token of room is enough.
    responses, context = generate(make_router(tokenizer, verifier, max_model_len=prompt_len + 1),
                                  generation_pb2.GenerateRequest(prompt=prompt))
    assert context.code is None and verifier.calls[0].params.max_tokens == 1


def test_text_too_long_for_the_context_is_refused_before_it_is_tokenized(tokenizer):
    router = make_router(tokenizer, max_model_len=64)
    longest = max(len(token.encode()) for token in tokenizer.get_vocab())
    limit = router.max_prompt_bytes
    assert limit == 64 * longest
    text = "the quick brown fox jumps over the lazy dog, naïvely " * 9
    assert len(text.encode()) <= len(tokenizer.encode(text)) * longest  # the bound holds for real text
    tokenized = []
    router._tokenize = lambda request, tokenizer: tokenized.append(request) or [1, 2]
    for request in (generation_pb2.GenerateRequest(prompt="a" * (limit + 1)),
                    generation_pb2.GenerateRequest(chat=chat(("system", "a" * limit), ("user", "b")))):
        responses, context = generate(router, request)
        assert responses == [] and context.code == Code.INVALID_ARGUMENT
        assert f"{limit + 1} bytes" in context.details and "shorten the prompt" in context.details
    assert tokenized == []
    generate(router, generation_pb2.GenerateRequest(prompt="a" * limit))  # at the bound: tokenized
    assert len(tokenized) == 1


def test_short_text_is_tokenized_on_the_loop_and_long_text_on_the_thread_each_with_its_own_tokenizer(tokenizer):
    """A fast tokenizer must not be used by two threads at once: the loop's is a copy, and both give the
    ids the tokenizer gives. Requests at once, a long one among short ones, all come through."""
    import threading

    from dflash_serve.services.router import router as router_module

    verifier = FakeVerifier()
    router = make_router(tokenizer, verifier, max_model_len=4096, max_pending=16)
    assert router._loop_tokenizer is not router.tokenizer
    used = []
    tokenize = router._tokenize
    router._tokenize = lambda request, tok: (used.append((threading.current_thread().name, tok))
                                             or tokenize(request, tok))
    short = "the quick brown fox"
    long = "jumps over the lazy dog " * (router_module.INLINE_TOKENIZE_BYTES // 24 + 1)
    assert len(long.encode()) > router_module.INLINE_TOKENIZE_BYTES >= len(short.encode())

    async def all_at_once():
        async def one(text):
            return [r async for r in router.Generate(generation_pb2.GenerateRequest(prompt=text), FakeContext())]

        return await asyncio.gather(*(one(text) for text in [short, long, short, short]))

    assert all(asyncio.run(all_at_once()))
    ids = {tuple(call.prompt_ids) for call in verifier.calls}
    assert ids == {tuple(tokenizer.encode(short)), tuple(tokenizer.encode(long))}
    loop_thread = threading.main_thread().name
    assert sorted((name == loop_thread, tok is router.tokenizer) for name, tok in used) == [
        (False, True), (True, False), (True, False), (True, False)]


def test_chat_without_a_chat_template_is_refused_saying_what_to_send(tokenizer):
    plain = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(VOCAB), eos_token="<eos>")
    _, context = generate(make_router(plain), generation_pb2.GenerateRequest(chat=chat(("user", "hi"))))
    assert context.code == Code.INVALID_ARGUMENT
    assert "no chat template" in context.details and "prompt" in context.details


def test_a_chat_template_refusing_the_messages_is_a_client_error():
    strict = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(VOCAB), eos_token="<eos>")
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('the first message must be from the user') }}{% endif %}x")
    _, context = generate(make_router(strict), generation_pb2.GenerateRequest(chat=chat(("assistant", "hi"))))
    assert context.code == Code.INVALID_ARGUMENT and "the first message must be from the user" in context.details


def test_the_engine_refusing_a_request_is_a_client_error(tokenizer):
    refusal = ValueError("prompt (3 tokens) + max_tokens (16) needs 25 KV slots; the cache holds 16: lower max_tokens")
    wrapped = RuntimeError("ray::ServeReplica:Verifier.generate() ... traceback")  # how Ray re-raises it
    wrapped.cause = refusal
    for err in (refusal, wrapped):
        responses, context = generate(make_router(tokenizer, FakeVerifier(raising(err))),
                                      generation_pb2.GenerateRequest(prompt="hi"))
        assert responses == [] and context.code == Code.INVALID_ARGUMENT and context.details == str(refusal)


# -- defaults and inputs --------------------------------------------------------------------------


def test_unset_sampling_fields_take_the_server_defaults(tokenizer):
    verifier = FakeVerifier()
    generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hello world"))
    assert verifier.calls[0].params == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_tokens=16)
    assert verifier.calls[0].params.greedy


def test_max_tokens_is_capped_by_the_room_left_in_the_context_and_by_the_limit(tokenizer):
    verifier = FakeVerifier()
    prompt_len = len(tokenizer.encode("hello world"))
    router = make_router(tokenizer, verifier, max_model_len=prompt_len + 5)
    generate(router, generation_pb2.GenerateRequest(prompt="hello world"))
    generate(router, generation_pb2.GenerateRequest(prompt="hello world", sampling=S(max_tokens=50)))
    generate(make_router(tokenizer, verifier, default_max_tokens=500, max_model_len=4096),
             generation_pb2.GenerateRequest(prompt="hello world"))
    assert [c.params.max_tokens for c in verifier.calls] == [5, 5, 100]


def test_set_sampling_fields_reach_the_verifier_as_the_client_typed_them(tokenizer):
    verifier = FakeVerifier()
    sampling = S(temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=20, stop=["\n\n"], stop_token_ids=[1],
                 ignore_eos=True)
    generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hi", sampling=sampling))
    # 0.9 travels as the float32 0.8999999762; seeded sampling must see the 0.9 other entry points get.
    assert verifier.calls[0].params == SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=20,
                                                      stop=("\n\n",), stop_token_ids=(1,), ignore_eos=True)


def test_a_request_can_limit_or_opt_out_of_speculation(tokenizer):
    verifier = FakeVerifier()
    router = make_router(tokenizer, verifier)
    for sampling in (S(num_speculative_tokens=0), S(num_speculative_tokens=3), S()):
        generate(router, generation_pb2.GenerateRequest(prompt="hi", sampling=sampling))
    assert [c.params.num_speculative_tokens for c in verifier.calls] == [0, 3, None]
    responses, context = generate(router, generation_pb2.GenerateRequest(prompt="hi",
                                                                         sampling=S(num_speculative_tokens=-1)))
    assert responses == [] and context.code == Code.INVALID_ARGUMENT
    assert "num_speculative_tokens must be >= 0" in context.details


def test_prompt_chat_and_token_ids_become_the_right_prompt_ids(tokenizer):
    verifier = FakeVerifier()
    router = make_router(tokenizer, verifier, max_model_len=4096)
    messages = [("system", "be brief"), ("user", "hello"), ("assistant", "hi"), ("tool", "42"), ("user", "and?")]
    for request in (generation_pb2.GenerateRequest(prompt="def main():"),
                    generation_pb2.GenerateRequest(chat=chat(*messages)),
                    generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 599]))):
        assert generate(router, request)[1].code is None
    rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [c.prompt_ids for c in verifier.calls] == [tokenizer.encode("def main():"), rendered, [5, 6, 599]]
    assert tokenizer.decode(rendered).endswith("<|assistant|>")
    assert verifier.model_info_calls == 1  # the vocabulary size, fetched once


# -- streaming ------------------------------------------------------------------------------------


def test_outputs_stream_as_responses_and_the_last_carries_usage_and_stats(tokenizer):
    request = generation_pb2.GenerateRequest(prompt="hello world", request_id="client-1")
    verifier = FakeVerifier()
    responses, context = generate(make_router(tokenizer, verifier), request)
    assert context.code is None
    # Outputs that arrive while the client has not read the last are merged into one response.
    assert "".join(r.text for r in responses) == "abcde"
    assert [t for r in responses for t in r.token_ids] == [10, 11, 12, 13, 14]
    assert {r.request_id for r in responses} == {"client-1"} and verifier.calls[0].request_id == "client-1"
    assert [r.finish_reason for r in responses] == [generation_pb2.FINISH_REASON_UNSPECIFIED] * (len(responses) - 1) + [
        generation_pb2.FINISH_REASON_LENGTH]
    assert not any(r.HasField("usage") or r.HasField("spec_stats") for r in responses[:-1])
    prompt_len = len(tokenizer.encode("hello world"))
    last = responses[-1]
    assert last.usage == generation_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=5,
                                              total_tokens=prompt_len + 5)
    assert last.spec_stats == generation_pb2.SpecStats(num_drafts=2, num_draft_tokens=10, num_accepted_tokens=3,
                                                       mean_acceptance_length=2.5,
                                                       accepted_per_position=[2, 1, 0, 0, 0])
    assert not verifier.streams[0].cancelled


@pytest.mark.parametrize("reason, expected", [
    (FinishReason.STOP, generation_pb2.FINISH_REASON_STOP),
    (FinishReason.LENGTH, generation_pb2.FINISH_REASON_LENGTH),
    (FinishReason.CANCELLED, generation_pb2.FINISH_REASON_CANCELLED),
])
def test_finish_reasons_map_to_the_proto_enum(tokenizer, reason, expected):
    async def script(prompt_ids, params, request_id):
        async for out in three_rounds(prompt_ids, params, request_id, reason):
            yield out

    responses, context = generate(make_router(tokenizer, FakeVerifier(script)),
                                  generation_pb2.GenerateRequest(prompt="hi"))
    assert context.code is None and responses[-1].finish_reason == expected


def test_without_a_client_id_each_request_gets_a_fresh_one(tokenizer):
    verifier = FakeVerifier()
    router = make_router(tokenizer, verifier)
    first, _ = generate(router, generation_pb2.GenerateRequest(prompt="hi"))
    second, _ = generate(router, generation_pb2.GenerateRequest(prompt="hi"))
    ids = [c.request_id for c in verifier.calls]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    assert first[0].request_id == ids[0] and second[0].request_id == ids[1]


def test_complete_concatenates_the_stream(tokenizer):
    response, context = complete(make_router(tokenizer), generation_pb2.GenerateRequest(prompt="hi", request_id="c-2"))
    assert context.code is None
    assert response.request_id == "c-2" and response.text == "abcde"
    assert list(response.token_ids) == [10, 11, 12, 13, 14]
    assert response.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert response.usage.completion_tokens == 5 and response.spec_stats.num_accepted_tokens == 3


def test_complete_reports_invalid_input_through_the_status(tokenizer):
    response, context = complete(make_router(tokenizer),
                                 generation_pb2.GenerateRequest(prompt="x", sampling=S(top_k=-1)))
    assert response == generation_pb2.GenerateResponse()
    assert context.code == Code.INVALID_ARGUMENT and "top_k" in context.details


# -- verifier failures ----------------------------------------------------------------------------


def test_a_verifier_error_ends_the_stream_with_internal_after_the_partial_output(tokenizer):
    responses, context = generate(make_router(tokenizer, FakeVerifier(fails_after_first_round)),
                                  generation_pb2.GenerateRequest(prompt="hi"))
    assert "".join(r.text for r in responses) == "abc"
    assert responses[-1].finish_reason == generation_pb2.FINISH_REASON_ERROR
    assert responses[-1].usage.completion_tokens == 3
    assert context.code == Code.INTERNAL and "an illegal memory access" in context.details
    response, context = complete(make_router(tokenizer, FakeVerifier(fails_after_first_round)),
                                 generation_pb2.GenerateRequest(prompt="hi"))
    assert context.code == Code.INTERNAL and "an illegal memory access" in context.details


@pytest.mark.parametrize("after_first_round", [False, True], ids=["at-once", "mid-stream"])
def test_a_failing_verifier_call_is_internal_with_the_reason_and_is_cancelled(tokenizer, after_first_round):
    verifier = FakeVerifier(raising(RuntimeError("the verifier replica died"), after_first_round=after_first_round))
    responses, context = generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hi"))
    assert len(responses) == int(after_first_round)
    assert context.code == Code.INTERNAL and "RuntimeError: the verifier replica died" in context.details
    assert verifier.streams[0].cancelled


@pytest.mark.parametrize("after_first_round", [False, True], ids=["at-once", "mid-stream"])
@pytest.mark.parametrize("error", [ActorDiedError(), ActorUnavailableError("restarting", None),
                                   ReplicaUnavailableError("Verifier#abc")],
                         ids=["died", "unavailable", "replica-gone"])
def test_losing_the_verifier_replica_is_unavailable_so_clients_retry(tokenizer, error, after_first_round, monkeypatch):
    """Before any output the router sends the request again first (LOST_REPLICA_RETRIES), here to
    a replica lost as well."""
    monkeypatch.setattr(router_module, "LOST_REPLICA_RETRY_WAIT_S", 0.0)
    verifier = FakeVerifier(raising(error, after_first_round=after_first_round))
    responses, context = generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hi"))
    assert len(responses) == int(after_first_round)
    assert context.code == Code.UNAVAILABLE and "retry" in context.details
    assert type(error).__name__ in context.details
    assert verifier.streams[0].cancelled
    assert len(verifier.calls) == (1 if after_first_round else 1 + router_module.LOST_REPLICA_RETRIES)


async def loop_stopped(prompt_ids, params, request_id):
    """What a replica whose engine loop stopped (a tensor-parallel rank lost) sends a request it held."""
    yield output(request_id, prompt_ids, [], "", 0, FinishReason.ERROR, error="the engine loop stopped: "
                 "TensorParallelError: tensor-parallel rank 1 (pid 7) exited with signal SIGKILL")


def first_call_then(first, then):
    """A verifier script: `first` for the first call, `then` for every later one."""
    calls = []

    def script(*args):
        calls.append(args)
        return (first if len(calls) == 1 else then)(*args)

    return script


@pytest.mark.parametrize("lost", [raising(ActorDiedError()), loop_stopped], ids=["replica-died", "loop-stopped"])
def test_a_request_whose_replica_failed_before_it_produced_a_token_goes_to_another(tokenizer, lost, monkeypatch):
    monkeypatch.setattr(router_module, "LOST_REPLICA_RETRY_WAIT_S", 0.0)
    verifier = FakeVerifier(first_call_then(lost, three_rounds))
    responses, context = generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hi"))
    assert context.code is None and "".join(r.text for r in responses) == "abcde"
    assert responses[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert [call.request_id for call in verifier.calls] == [verifier.calls[0].request_id] * 2


def test_a_request_whose_engine_loop_stopped_after_it_produced_tokens_is_unavailable_with_the_reason(tokenizer):
    async def tokens_then_loop_stopped(prompt_ids, params, request_id):
        yield output(request_id, prompt_ids, [10, 11], "ab", 2)
        yield output(request_id, [], [], "", 0, FinishReason.ERROR,  # as EngineLoop.run sends it: no counts
                     error="the engine loop stopped: TensorParallelError: tensor-parallel rank 1 (pid 7) exited")

    verifier = FakeVerifier(tokens_then_loop_stopped)
    responses, context = generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hi"))
    assert "".join(r.text for r in responses) == "ab" and len(verifier.calls) == 1
    assert context.code == Code.UNAVAILABLE and "retry" in context.details
    assert "TensorParallelError: tensor-parallel rank 1 (pid 7) exited" in context.details


def test_with_no_verifier_replica_running_a_request_fails_fast_as_unavailable(tokenizer, monkeypatch):
    """During a replica's restart Serve holds calls until one is back (~20 s): the router asks."""
    monkeypatch.setattr(router_module, "FIRST_OUTPUT_CHECK_S", 0.05)
    running = [0]

    async def running_verifiers():
        return running[0]

    verifier = FakeVerifier(hangs_after_first_round)
    verifier.script = lambda *args: _after(hangs_after_first_round(*args), 10.0)
    router = make_router(tokenizer, verifier, running_verifiers=running_verifiers)
    start = time.monotonic()
    responses, context = generate(router, generation_pb2.GenerateRequest(prompt="hi"))
    assert responses == [] and context.code == Code.UNAVAILABLE and "retry" in context.details
    assert time.monotonic() - start < 1.0 and verifier.streams[0].cancelled
    # With a replica running, a slow first output is waited for (a long prefill, a busy batch).
    running[0] = 1
    verifier.script = lambda *args: _after(three_rounds(*args), 0.3)
    responses, context = generate(router, generation_pb2.GenerateRequest(prompt="hi"))
    assert context.code is None and "".join(r.text for r in responses) == "abcde"


async def _after(outputs, seconds: float):
    await asyncio.sleep(seconds)
    async for out in outputs:
        yield out


def test_an_output_stream_closing_before_the_request_finished_is_unavailable(tokenizer):
    async def truncated(prompt_ids, params, request_id):
        yield output(request_id, prompt_ids, [10], "a", 1)

    responses, context = generate(make_router(tokenizer, FakeVerifier(truncated)),
                                  generation_pb2.GenerateRequest(prompt="hi"))
    assert len(responses) == 1 and context.code == Code.UNAVAILABLE
    assert "output stream closed" in context.details and "retry" in context.details


def test_outputs_that_arrive_together_are_one_response(tokenizer):
    """A client that reads slower than the engine steps gets fewer, larger responses."""

    verifier = FakeVerifier(one_frame=True)
    responses, context = generate(make_router(tokenizer, verifier), generation_pb2.GenerateRequest(prompt="hi"))
    assert context.code is None
    assert [(r.text, list(r.token_ids)) for r in responses] == [("abcde", [10, 11, 12, 13, 14])]
    assert responses[0].finish_reason == generation_pb2.FINISH_REASON_LENGTH and responses[0].usage.completion_tokens == 5


# -- cancellation, deadlines, admission -----------------------------------------------------------


def test_a_client_cancel_mid_stream_cancels_the_verifier_call_and_frees_the_slot(tokenizer):
    verifier = FakeVerifier(hangs_after_first_round)
    router = make_router(tokenizer, verifier, max_pending=1)
    context = FakeContext()

    async def cancel_after_first_response():
        stream = router.Generate(generation_pb2.GenerateRequest(prompt="hi", request_id="r"), context)
        first = await anext(stream)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)  # the router now waits on the verifier
        waiting.cancel()  # what Ray Serve does when the client cancels
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return first

    assert asyncio.run(cancel_after_first_response()).token_ids == [10, 11]
    assert verifier.streams[0].cancelled and context.code is None  # Ray Serve reports CANCELLED itself
    verifier.script = three_rounds
    responses, context = generate(router, generation_pb2.GenerateRequest(prompt="hi", request_id="r"))
    assert context.code is None and responses[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("method", ["Generate", "Complete"])
def test_a_passed_deadline_cancels_the_verifier_call_and_frees_the_slot(tokenizer, method):
    verifier = FakeVerifier(hangs_after_first_round)
    router = make_router(tokenizer, verifier, max_pending=1)
    request = generation_pb2.GenerateRequest(prompt="hi")

    async def call():
        if method == "Complete":
            return await router.Complete(request, FakeContext())
        return [r async for r in router.Generate(request, FakeContext())]

    async def with_deadline():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call(), timeout=0.05)

    asyncio.run(with_deadline())
    assert verifier.streams[0].cancelled
    verifier.script = three_rounds
    responses, context = generate(router, request)
    assert context.code is None and "".join(r.text for r in responses) == "abcde"


def test_past_max_pending_requests_get_resource_exhausted_until_a_slot_frees(tokenizer):
    verifier = FakeVerifier(hangs_after_first_round)
    router = make_router(tokenizer, verifier, max_pending=2)

    async def scenario():
        streams = [router.Generate(generation_pb2.GenerateRequest(prompt="hi"), FakeContext()) for _ in range(2)]
        for stream in streams:
            await anext(stream)
        context = FakeContext()
        with pytest.raises(RpcFailed):
            await anext(router.Generate(generation_pb2.GenerateRequest(prompt="hi"), context))
        assert context.code == Code.RESOURCE_EXHAUSTED
        assert "limit of 2 requests in flight" in context.details and "retry later" in context.details
        await streams[0].aclose()  # the first client goes away
        assert verifier.streams[0].cancelled
        verifier.script = three_rounds
        responses = [r async for r in router.Generate(generation_pb2.GenerateRequest(prompt="hi"), FakeContext())]
        assert "".join(r.text for r in responses) == "abcde"
        await streams[1].aclose()

    asyncio.run(scenario())
    assert len(verifier.calls) == 3


def test_failed_requests_free_their_slot(tokenizer):
    router = make_router(tokenizer, FakeVerifier(fails_after_first_round), max_pending=1)
    assert generate(router, generation_pb2.GenerateRequest(prompt=""))[1].code == Code.INVALID_ARGUMENT
    assert generate(router, generation_pb2.GenerateRequest(prompt="hi"))[1].code == Code.INTERNAL
    router.verifier.script = three_rounds
    assert generate(router, generation_pb2.GenerateRequest(prompt="hi"))[1].code is None


def test_a_request_id_already_in_flight_is_refused(tokenizer):
    verifier = FakeVerifier(hangs_after_first_round)
    router = make_router(tokenizer, verifier)

    async def scenario():
        first = router.Generate(generation_pb2.GenerateRequest(prompt="hi", request_id="dup"), FakeContext())
        await anext(first)
        context = FakeContext()
        with pytest.raises(RpcFailed):
            await anext(router.Generate(generation_pb2.GenerateRequest(prompt="hi", request_id="dup"), context))
        assert context.code == Code.ALREADY_EXISTS and "'dup' is already in flight" in context.details
        assert not verifier.streams[0].cancelled  # the refusal does not touch the first request
        await first.aclose()

    asyncio.run(scenario())
    assert len(verifier.calls) == 1


# -- model info and health ------------------------------------------------------------------------


def test_model_info_comes_from_the_verifier(tokenizer):
    verifier = FakeVerifier()
    router = make_router(tokenizer, verifier)
    context = FakeContext()
    info = asyncio.run(router.GetModelInfo(generation_pb2.GetModelInfoRequest(), context))
    assert info == generation_pb2.ModelInfo(**MODEL_INFO) and context.code is None


def test_health_check_serves_the_server_and_the_generation_service(tokenizer):
    router = make_router(tokenizer)
    for service in ("", "dflash.v1.Generation"):
        context = FakeContext()
        response = asyncio.run(router.Check(health_pb2.HealthCheckRequest(service=service), context))
        assert response.status == health_pb2.HealthCheckResponse.SERVING and context.code is None
    context = FakeContext()
    asyncio.run(router.Check(health_pb2.HealthCheckRequest(service="other.Service"), context))
    assert context.code == Code.NOT_FOUND and "other.Service" in context.details


@pytest.mark.parametrize("health", [RuntimeError("the engine loop stopped: CUDA error"), ActorDiedError(), "hang"],
                         ids=["unhealthy", "replica-gone", "no-answer"])
def test_health_check_is_not_serving_while_the_verifier_fails_its_own(tokenizer, health, monkeypatch):
    monkeypatch.setattr(router_module, "HEALTH_CHECK_TIMEOUT_S", 0.2)
    verifier = FakeVerifier()
    router = make_router(tokenizer, verifier)
    check = lambda: asyncio.run(router.Check(health_pb2.HealthCheckRequest(), FakeContext())).status  # noqa: E731
    assert check() == health_pb2.HealthCheckResponse.SERVING
    verifier.health = health
    assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
    verifier.health = None  # Serve replaced the replica
    assert check() == health_pb2.HealthCheckResponse.SERVING


# -- the client, over a real gRPC server hosting the router ---------------------------------------


class _Servicer(generation_pb2_grpc.GenerationServicer):
    """A grpc.aio host of the router: there a status set on the context is sent as is."""

    def __init__(self, router: Router):
        self.router = router
        self.metadata: list = []

    async def Generate(self, request, context):  # noqa: N802
        self.metadata.append(dict(context.invocation_metadata()))
        try:
            async for response in self.router.Generate(request, context):
                yield response
        except RpcFailed:
            return

    async def Complete(self, request, context):  # noqa: N802
        return await self.router.Complete(request, context)

    async def GetModelInfo(self, request, context):  # noqa: N802
        return await self.router.GetModelInfo(request, context)


@pytest.fixture(scope="module")
def server(tokenizer):
    verifier = FakeVerifier()
    servicer = _Servicer(make_router(tokenizer, verifier))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        grpc_server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        return grpc_server, port

    grpc_server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield SimpleNamespace(address=f"127.0.0.1:{port}", verifier=verifier, servicer=servicer)
    asyncio.run_coroutine_threadsafe(grpc_server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_client_streams_a_completion_with_its_sampling_and_metadata(server, tokenizer):
    responses = list(client.stream_completion(
        server.address, prompt="hello", sampling={"temperature": 0.5, "max_tokens": 8, "seed": 3},
        request_id="cli-1", timeout=10, metadata=(("application", "dflash"),)))
    assert "".join(r.text for r in responses) == "abcde" and responses[-1].usage.completion_tokens == 5
    call = server.verifier.calls[-1]
    assert call.request_id == "cli-1" and call.prompt_ids == tokenizer.encode("hello")
    assert (call.params.temperature, call.params.max_tokens, call.params.seed) == (0.5, 8, 3)
    assert server.servicer.metadata[-1]["application"] == "dflash"


def test_client_sends_chat_and_token_ids_and_completes(server, tokenizer):
    response = client.complete(server.address, chat=[{"role": "user", "content": "hi"}], timeout=10)
    assert response.text == "abcde"
    assert server.verifier.calls[-1].prompt_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    client.complete(server.address, token_ids=[1, 2, 3], timeout=10)
    assert server.verifier.calls[-1].prompt_ids == [1, 2, 3]
    assert client.model_info(server.address, timeout=10).vocab_size == VOCAB


def test_client_surfaces_the_status_and_details(server):
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream_completion(server.address, chat=[{"role": "wizard", "content": "x"}], timeout=10))
    assert err.value.code() == Code.INVALID_ARGUMENT and "'wizard'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.complete(server.address, prompt="x", sampling={"top_p": 2.0}, timeout=10)
    assert err.value.code() == Code.INVALID_ARGUMENT and "top_p" in err.value.details()


def test_client_needs_exactly_one_input():
    with pytest.raises(ValueError, match="exactly one of prompt, chat or token_ids"):
        client.stream_completion("127.0.0.1:1", prompt="x", token_ids=[1])
    with pytest.raises(ValueError, match="got none"):
        client.complete("127.0.0.1:1")


def test_with_a_message_budget_a_request_waits_after_each_message_and_sends_what_gathered_as_one(tokenizer):
    """stream_messages_per_s: one request in flight at 0.1 messages/s waits up to 10 s after each
    message; the first goes at once, and the four steps that follow arrive as one message, sent as
    soon as the last of them (the request's end) is in: the wait is cut short."""

    async def five_steps(prompt_ids, params, request_id):
        for i in range(5):
            yield output(request_id, prompt_ids, [10 + i], "abcde"[i], i + 1,
                         FinishReason.LENGTH if i == 4 else None)
            await asyncio.sleep(0.005)

    router = make_router(tokenizer, FakeVerifier(five_steps), stream_messages_per_s=0.1)
    start = time.monotonic()
    responses, context = generate(router, generation_pb2.GenerateRequest(prompt="hi"))
    assert context.code is None
    assert [r.text for r in responses] == ["a", "bcde"] and responses[-1].usage.completion_tokens == 5
    assert time.monotonic() - start < 5.0  # not the 10 s wait


def test_a_paced_request_whose_end_arrived_while_its_last_message_was_read_does_not_wait(tokenizer):
    """The end is already queued when the wait would start: no wait at all."""
    async def two_then_end(prompt_ids, params, request_id):
        yield output(request_id, prompt_ids, [10], "a", 1)
        await asyncio.sleep(0.05)
        yield output(request_id, prompt_ids, [11], "b", 2, FinishReason.LENGTH)

    async def scenario(router):
        stream = router.Generate(generation_pb2.GenerateRequest(prompt="hi"), FakeContext())
        first = await anext(stream)
        await asyncio.sleep(0.3)  # the end arrives while the client holds the first message
        start = time.monotonic()
        rest = [r async for r in stream]
        return first, rest, time.monotonic() - start

    router = make_router(tokenizer, FakeVerifier(two_then_end), stream_messages_per_s=0.1)
    first, rest, waited = asyncio.run(scenario(router))
    assert first.text == "a" and [r.text for r in rest] == ["b"] and waited < 5.0  # not the 10 s wait
