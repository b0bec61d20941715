"""A verifier replica that can no longer serve says so: its health check raises (Serve replaces
it, the router reports NOT_SERVING) and the requests it held end with the reason, not a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.verifier.engine_process import EngineLoop, Pipe
from dflash_serve.services.verifier.output_stream import OutputListener, StreamLost
from dflash_serve.services.verifier.verifier import Verifier
from tests.served_pair import save_tiny_pair


def engine_loop_in_a_thread(engine, config: ServeConfig) -> tuple[Connection, EngineLoop, threading.Thread]:
    """The engine process's loop over `engine`, run by a thread here, and the replica's end of its pipe."""
    ours, theirs = socket.socketpair()
    loop = EngineLoop(engine, Pipe(Connection(theirs.detach())), config, record_metrics=False, intake_host="127.0.0.1")
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return Connection(ours.detach()), loop, thread


def test_a_stopped_engine_loop_ends_the_requests_it_held_and_tells_the_replica(tmp_path):
    """The engine process's loop, here in a thread: a step that raises ends every request it held
    with the reason, in its router's stream, and the replica hears the loop stopped."""
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    config = ServeConfig.from_dict({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2},
                                    "topology": "colocated"})
    engine = build_engine(config.engine)

    def broken_step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.step = broken_step
    replica, _, thread = engine_loop_in_a_thread(engine, config)

    async def one_request():
        listener = OutputListener()
        queue = listener.open("r")
        replica.send([("add", "r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5), await listener.reply_to())])
        last = await asyncio.wait_for(queue.get(), 30)
        await listener.aclose()
        return last

    last = asyncio.run(one_request())
    assert last.finished and last.finish_reason is FinishReason.ERROR
    assert last.error == "the engine loop stopped: RuntimeError: CUDA error: an illegal memory access was encountered"
    thread.join(timeout=30)
    replies = [message for _ in range(2) if replica.poll(5) for message in replica.recv()]
    kinds = [message[0] for message in replies]
    assert kinds == ["ended", "loop_error"], replies
    assert replies[1][1] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    replica.close()


def test_an_engine_process_that_dies_fails_the_health_check_and_its_calls_retryably(tmp_path):
    """The engine's process killed (the OOM killer, a crash): the calls it held fail as a lost
    replica's do (StreamLost: the router answers UNAVAILABLE, retry), and the health check raises."""
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2}, "topology": "colocated",
                         "engine_adoption_s": 0})  # its child: how it ended is known
    verifier.check_health()  # serving

    async def killed_mid_request():
        listener = OutputListener()
        queue = listener.open("r")
        call = asyncio.ensure_future(verifier.generate(
            [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True), "r",
            await listener.reply_to()))
        await asyncio.wait_for(queue.get(), 30)  # it runs
        os.kill(verifier._process.pid, signal.SIGKILL)
        with pytest.raises(StreamLost, match="engine process of this verifier replica exited .*signal 9.*retry"):
            await asyncio.wait_for(call, 30)
        while not isinstance(item := await asyncio.wait_for(queue.get(), 30), StreamLost):  # the router's side
            assert not item.finished
        await listener.aclose()

    asyncio.run(killed_mid_request())
    with pytest.raises(RuntimeError, match="the engine process exited: killed by signal 9"):
        verifier.check_health()
    verifier.shutdown()


def test_the_engine_process_logs_into_the_tree_it_relays_to_the_replica():
    """The process runs this module as __main__ (`python -m`): a logger named by __name__ would sit
    outside `dflash_serve.services`, whose records main() sends to the replica, and be lost."""
    from dflash_serve.services.verifier import engine_process

    assert engine_process.log.name.startswith("dflash_serve.services.")
    source = engine_process.__loader__.get_source(engine_process.__name__)
    assert "getLogger(__name__)" not in source
