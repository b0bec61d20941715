"""The verifier -> router output stream: one frame per engine step for all of a router's
requests, routed to each request's queue on the router; a sender that never blocks the engine's
thread; a stream that names its router's secret; and a verifier that cancels (and frees) the
requests of a router that went away, or of a call that was cancelled."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from dflash_serve.services.api.dflash.v1 import outputs_pb2
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.request import RequestOutput, SpecStats
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.transport.channel import HEADER
from dflash_serve.services.verifier import output_stream
from dflash_serve.services.verifier.output_stream import OutputListener, StreamAddress, RouterChannel, StreamLost
from dflash_serve.services.verifier.verifier import Verifier
from tests.served_pair import run_request, save_tiny_pair

STATS = SpecStats(rounds=3, draft_tokens=15, accepted_tokens=4, accepted_per_position=[3, 1, 0])


def out(request_id: str, ids: list[int], text: str, reason=None, error=None) -> RequestOutput:
    return RequestOutput(request_id, ids, text, reason is not None, reason, 7, len(ids),
                         STATS if reason else SpecStats(), error=error)


async def _drain(queue: asyncio.Queue, count: int, timeout: float = 5.0) -> list:
    return [await asyncio.wait_for(queue.get(), timeout) for _ in range(count)]


def test_a_steps_outputs_for_several_requests_travel_in_one_frame_and_reach_their_requests():
    async def scenario():
        listener = OutputListener()
        a, b = listener.open("a"), listener.open("b")
        channel = RouterChannel.connect(await listener.reply_to())
        channel.add(out("a", [1, 2], "xy"))
        channel.add(out("b", [3], "z"))
        assert channel.flush()
        channel.add(out("a", [4], "w", FinishReason.STOP))
        channel.add(out("b", [], "", FinishReason.ERROR, error="CUDA error"))
        assert channel.flush()
        got = await _drain(a, 2), await _drain(b, 2)
        channel.close()
        await listener.aclose()
        return got

    (a1, a2), (b1, b2) = asyncio.run(scenario())
    assert a1 == out("a", [1, 2], "xy") and b1 == out("b", [3], "z")
    assert a2 == out("a", [4], "w", FinishReason.STOP)  # with its speculation statistics
    assert b2.finish_reason is FinishReason.ERROR and b2.error == "CUDA error" and b2.finished


def test_a_stream_without_the_routers_secret_delivers_nothing():
    async def scenario():
        listener = OutputListener()
        queue = listener.open("a")
        real = await listener.reply_to()
        forged = RouterChannel.connect(StreamAddress(real.host, real.port, b"not the secret"))
        forged.add(out("a", [666], "injected", FinishReason.STOP))
        forged.flush()
        await asyncio.sleep(0.2)
        forged.close()
        await listener.aclose()
        return queue.qsize()

    assert asyncio.run(scenario()) == 0


def test_a_router_that_does_not_read_never_blocks_the_sender_and_is_dropped_past_the_bound(monkeypatch):
    monkeypatch.setattr(output_stream, "MAX_UNSENT_BYTES", 4 * 2**20)
    server = socket.create_server(("127.0.0.1", 0))  # accepts (in the kernel) and never reads
    channel = RouterChannel.connect(StreamAddress("127.0.0.1", server.getsockname()[1], b"t"))
    text = "x" * 4096
    start, flushes = time.monotonic(), 0
    while channel.flush():
        channel.add(out("a", [1], text))
        flushes += 1
        assert flushes < 10_000
    assert time.monotonic() - start < 5.0  # each flush returned at once
    assert channel.closed and "fell" in channel.closed_because and "behind" in channel.closed_because
    server.close()


def test_a_bad_frame_ends_the_stream_and_fails_its_requests():
    async def scenario():
        listener = OutputListener()
        queue = listener.open("a")
        reply_to = await listener.reply_to()
        channel = RouterChannel.connect(reply_to)
        channel.add(out("a", [1], "x"))
        assert channel.flush()
        first = await asyncio.wait_for(queue.get(), 5)
        channel._sock.send(HEADER.pack(3) + b"\xff\xff\xff")  # not a StepOutputs
        lost = await asyncio.wait_for(queue.get(), 5)
        await listener.aclose()
        return first, lost

    first, lost = asyncio.run(scenario())
    assert first.new_token_ids == [1] and isinstance(lost, StreamLost) and "bad frame" in str(lost)


def test_the_hello_names_the_version_and_the_stream():
    hello = outputs_pb2.OutputsHello(version=outputs_pb2.OUTPUTS_VERSION_1, token=b"t", stream_id="s")
    assert outputs_pb2.OutputsHello.FromString(hello.SerializeToString()) == hello


# -- a Verifier in this process -------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    target, drafter = save_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=6)
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 4, "max_tokens_limit": 512},
                         "topology": "colocated"})
    yield verifier
    verifier.shutdown()


def _free_blocks_return(verifier: Verifier, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = asyncio.run(verifier.stats())
        if stats["kv_free_blocks"] == stats["kv_blocks"] and stats["running"] == stats["waiting"] == 0:
            return True
        time.sleep(0.02)
    return False


def test_the_streamed_outputs_are_the_engines(verifier):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = asyncio.run(asyncio.wait_for(run_request(verifier, [5, 6, 7], params), 60))
    (reference,) = build_engine(verifier.config.engine).generate([[5, 6, 7]], params)  # the verifier's runs on
    assert [t for o in outputs for t in o.new_token_ids] == reference.output_ids
    assert outputs[-1].num_output_tokens == 24 and outputs[-1].finish_reason is FinishReason.LENGTH
    assert not any(o.finished for o in outputs[:-1])


def test_a_router_going_away_cancels_its_requests_and_frees_their_blocks(verifier):
    async def scenario():
        listener = OutputListener()
        queue = listener.open("gone")
        reply_to = await listener.reply_to()
        call = asyncio.ensure_future(verifier.generate(
            [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), "gone", reply_to))
        await asyncio.wait_for(queue.get(), 30)  # it runs
        await listener.aclose()  # the router's process ends: its listener and every stream close
        for writer_task in asyncio.all_tasks():
            if writer_task.get_coro().__qualname__.startswith("OutputListener._serve"):
                writer_task.cancel()
        with pytest.raises(ConnectionError, match="output stream to the router closed"):
            await asyncio.wait_for(call, 30)

    asyncio.run(scenario())
    assert _free_blocks_return(verifier)


def test_cancelling_the_call_cancels_the_request_and_frees_its_blocks(verifier):
    async def scenario():
        listener = OutputListener()
        queue = listener.open("c")
        call = asyncio.ensure_future(verifier.generate(
            [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), "c",
            await listener.reply_to()))
        await asyncio.wait_for(queue.get(), 30)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await listener.aclose()

    asyncio.run(scenario())
    assert _free_blocks_return(verifier)


def test_a_router_gets_one_channel_and_a_new_one_once_it_closed(verifier):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def two_requests(listener: OutputListener) -> list[str]:
        reply_to = await listener.reply_to()
        ids = []
        for request_id in ("one", "two"):
            queue = listener.open(request_id)
            ids.append(await asyncio.wait_for(verifier.generate([1, 2], params, request_id, reply_to), 30))
            while not (await asyncio.wait_for(queue.get(), 30)).finished:
                pass
            listener.close(request_id)
        return ids

    async def scenario():
        first, second = OutputListener(), OutputListener()
        old = await two_requests(first)
        await first.aclose()  # that router's process ends
        new = await two_requests(second)
        await second.aclose()
        return old, new

    old, new = asyncio.run(scenario())
    assert old[0] == old[1] and new[0] == new[1] and old[0] != new[0]  # one channel per router at a time
    assert asyncio.run(verifier.stats())["router_streams"] == 1  # the closed one was dropped


def test_a_call_whose_event_loop_ended_does_not_stop_the_engine(verifier):
    """The engine's thread settles each call through the call's event loop; one that has ended
    (nothing awaits the call any more) is passed over, and the verifier keeps serving."""
    loop = asyncio.new_event_loop()
    listener = OutputListener()

    async def start():
        queue = listener.open("orphan")
        task = asyncio.ensure_future(verifier.generate(
            [1, 2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), "orphan",
            await listener.reply_to()))
        await asyncio.wait_for(queue.get(), 30)  # it runs
        return task

    loop.run_until_complete(start())
    loop.close()  # with the call still awaiting its request's end, which the engine will settle
    assert _free_blocks_return(verifier)  # the request ran to its end
    verifier.check_health()  # the engine's loop is alive
    outputs = asyncio.run(asyncio.wait_for(
        run_request(verifier, [3, 4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "after"), 30))
    assert outputs[-1].finished and outputs[-1].num_output_tokens == 4
