"""The direct intake: a router sends its requests straight to a verifier's engine process and gets
their outputs back on the same connection, with the Serve call's semantics (the same outputs, a
refusal as a client error, cancellation and a router going away free the request's blocks, only a
router holding the engine's secret is heard), and goes through Serve while it knows no engine."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import grpc
import pytest

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.router.direct_intake import DirectIntake
from dflash_serve.services.router.router import RequestFailed, Router
from dflash_serve.services.verifier.output_stream import OutputListener, StreamAddress, StreamLost
from dflash_serve.services.verifier.verifier import Verifier
from tests.served_pair import save_tiny_pair
from tests.unit.test_output_stream import _free_blocks_return

GREEDY = generation_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, drafter = save_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=6)
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 4, "max_tokens_limit": 512},
                         "topology": "colocated"})
    yield target, verifier
    verifier.shutdown()


class ServeHandle:
    """The verifier's Serve handle, calling the Verifier in this process; counts the calls."""

    def __init__(self, verifier: Verifier, vocab_size: int):
        self.calls = 0
        self.generate = SimpleNamespace(remote=self._generate)
        info = {**verifier.model_info(), "vocab_size": vocab_size}

        async def model_info():
            return info

        self.model_info = SimpleNamespace(remote=model_info)
        self._verifier = verifier

    def _generate(self, *args):
        self.calls += 1
        return asyncio.ensure_future(self._verifier.generate(*args))


def make_router(pair, *, vocab_size: int = 600, forgotten: list | None = None) -> tuple[Router, ServeHandle]:
    target, verifier = pair
    handle = ServeHandle(verifier, vocab_size)

    async def registered():
        return {"replica-1": verifier.intake_address}

    async def forget(name):
        (forgotten if forgotten is not None else []).append(name)

    router = Router(handle, target, max_model_len=256, max_tokens_limit=512, default_max_tokens=16, max_pending=8,
                    registered_engines=registered, forget_engine=forget)
    return router, handle


async def _token_ids(router: Router, request: generation_pb2.GenerateRequest, request_id: str) -> list[int]:
    return [t async for out in router.outputs(request, request_id) for t in out.new_token_ids]


def test_requests_go_through_serve_until_the_engine_is_known_then_straight_to_it_with_the_same_outputs(pair):
    router, handle = make_router(pair)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]), sampling=GREEDY)

    async def scenario():
        first = await _token_ids(router, request, "first")  # no engine known yet: a Serve call
        await router.direct._refreshing  # the look for engines the first request started
        second = await _token_ids(router, request, "second")
        stats = await pair[1].stats()
        await router.verifier_outputs.aclose()
        return first, second, stats

    first, second, stats = asyncio.run(scenario())
    (reference,) = build_engine(pair[1].config.engine).generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert first == second == reference.output_ids
    assert handle.calls == 1 and stats["router_intakes"] == 1
    assert _free_blocks_return(pair[1])


def test_a_request_the_engine_refuses_is_invalid_argument_with_its_reason(pair):
    router, handle = make_router(pair, vocab_size=10**6)  # the router lets token 700 through; the engine does not

    async def scenario():
        router.direct.pick()
        await router.direct._refreshing
        request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 700]), sampling=GREEDY)
        with pytest.raises(RequestFailed) as failed:
            await _token_ids(router, request, "refused")
        await router.verifier_outputs.aclose()
        return failed.value

    failed = asyncio.run(scenario())
    assert failed.code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in failed.message
    assert handle.calls == 0


def test_a_client_going_away_cancels_its_direct_request_and_frees_its_blocks(pair):
    router, _ = make_router(pair)
    long = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]),
                                          sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=400,
                                                                                 ignore_eos=True))

    async def scenario():
        router.direct.pick()
        await router.direct._refreshing
        outputs = router.outputs(long, "long")
        await asyncio.wait_for(anext(outputs), 30)  # it runs
        await outputs.aclose()  # the client went away
        await asyncio.sleep(0.5)
        stats = await pair[1].stats()
        await router.verifier_outputs.aclose()
        return stats

    stats = asyncio.run(scenario())
    assert stats["running"] == stats["waiting"] == 0
    assert _free_blocks_return(pair[1])


def test_a_router_going_away_cancels_its_direct_requests_and_frees_their_blocks(pair):
    verifier = pair[1]

    async def scenario():
        listener = OutputListener()
        queue = listener.open("gone")
        channel = await listener.connect(verifier.intake_address)
        channel.add("gone", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        await asyncio.wait_for(queue.get(), 30)  # it runs
        await listener.aclose()  # the router's process ends: its connections close

    asyncio.run(scenario())
    assert _free_blocks_return(verifier)


def test_a_router_without_the_engines_secret_is_not_heard(pair):
    verifier = pair[1]
    real = verifier.intake_address

    async def scenario():
        listener = OutputListener()
        queue = listener.open("forged")
        channel = await listener.connect(StreamAddress(real.host, real.port, b"not the secret"))
        channel.add("forged", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        item = await asyncio.wait_for(queue.get(), 30)  # the engine hangs up
        stats = await verifier.stats()
        await listener.aclose()
        return item, stats

    item, stats = asyncio.run(scenario())
    assert isinstance(item, StreamLost)
    assert stats["running"] == stats["waiting"] == 0


def test_an_engine_refusing_connections_is_forgotten_and_requests_go_through_serve():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there any more: the replica was killed
    forgotten = []

    async def registered():
        return {"dead": StreamAddress("127.0.0.1", port, b"t")}

    async def forget(name):
        forgotten.append(name)

    async def scenario():
        intake = DirectIntake(OutputListener(), registered, forget)
        assert intake.pick() is None
        await intake._refreshing
        return intake.pick()

    assert asyncio.run(scenario()) is None and forgotten == ["dead"]


def test_a_connection_to_the_intake_that_never_says_hello_is_closed(tmp_path, monkeypatch):
    """The engine process's loop, here in a thread: a connection without the hello holds nothing
    for long (a port scan, a stuck client), while a router's stays open."""
    import threading
    from multiprocessing.connection import Connection

    from dflash_serve.services.config import ServeConfig
    from dflash_serve.services.verifier import engine_process
    from dflash_serve.services.verifier.engine_process import EngineLoop, Pipe

    monkeypatch.setattr(engine_process, "INTAKE_HELLO_TIMEOUT_S", 0.3)
    monkeypatch.setattr(engine_process, "GAUGE_PERIOD_S", 0.1)
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    config = ServeConfig.from_dict({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2},
                                    "topology": "colocated"})
    ours, theirs = socket.socketpair()
    replica = Connection(ours.detach())
    loop = EngineLoop(build_engine(config.engine), Pipe(Connection(theirs.detach())), config, record_metrics=False,
                      intake_host="127.0.0.1")
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    address = loop.intake_address
    silent = socket.create_connection((address.host, address.port), timeout=10)

    async def a_router_request():
        listener = OutputListener()
        queue = listener.open("r")
        channel = await listener.connect(address)
        await asyncio.sleep(1.0)  # well past the hello timeout: the router said hello, it stays
        channel.add("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        outputs = [await asyncio.wait_for(queue.get(), 30)]
        while not outputs[-1].finished:
            outputs.append(await asyncio.wait_for(queue.get(), 30))
        await listener.aclose()
        return outputs

    outputs = asyncio.run(a_router_request())
    assert silent.recv(1) == b""  # closed by the engine
    assert outputs[-1].num_output_tokens == 4
    replica.send([("stop",)])
    thread.join(timeout=30)
    silent.close()
    replica.close()
