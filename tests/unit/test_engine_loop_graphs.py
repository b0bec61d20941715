"""The engine process's loop captures the graphs the loader deferred after it answers: back to back
while idle, one at a time between steps under load, so a request never waits for all of them."""

from __future__ import annotations

import asyncio
import time

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.engine import Engine
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.verifier.engine_process import EngineLoop
from dflash_serve.services.verifier.output_stream import OutputListener
from tests.served_pair import save_tiny_pair
from tests.unit.test_verifier_health import engine_loop_in_a_thread

PIECES = 12  # graphs to capture
PIECE_S = 0.1  # each capture's time


def _engine_with_slow_captures(tmp_path, monkeypatch):
    """A CPU engine (colocated, no adoption) standing in for one with PIECES graphs to capture,
    each taking PIECE_S; `left` counts those not yet captured."""
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    config = ServeConfig.from_dict({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2},
                                    "topology": "colocated", "engine_adoption_s": 0})
    engine = build_engine(config.engine)
    left = [PIECES]
    monkeypatch.setattr(Engine, "graphs_pending", property(lambda self: left[0] > 0))

    def capture_next_graph():
        time.sleep(PIECE_S)
        left[0] -= 1

    engine.capture_next_graph = capture_next_graph
    return config, engine, left


def test_a_request_is_answered_between_captures_and_the_rest_are_captured_when_idle(tmp_path, monkeypatch):
    config, engine, left = _engine_with_slow_captures(tmp_path, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = engine.generate([[1, 2, 3]], params)[0].output_ids
    replica, _, thread = engine_loop_in_a_thread(engine, config)

    async def one_request():
        listener = OutputListener()
        queue = listener.open("r")
        replica.send([("add", "r", [1, 2, 3], params, await listener.reply_to())])
        tokens = []
        while True:
            out = await asyncio.wait_for(queue.get(), 30)
            tokens += out.new_token_ids
            if out.finished:
                break
        captured_by_then = PIECES - left[0]
        await listener.aclose()
        return tokens, captured_by_then

    tokens, captured_by_then = asyncio.run(one_request())
    assert tokens == expected
    assert captured_by_then < PIECES  # answered long before every graph was captured
    deadline = time.monotonic() + 30
    while left[0] and time.monotonic() < deadline:  # idle: the rest back to back
        time.sleep(0.05)
    assert left[0] == 0
    replica.close()  # the loop ends: its replica is gone (engine_adoption_s 0)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_drafter_that_comes_while_graphs_are_captured_attaches_once_they_are(tmp_path, monkeypatch):
    """Its first attach may measure the round costs on all the graphs, holding the loop while it
    captures the rest: the loop captures them first, between steps, and attaches after."""
    config, engine, left = _engine_with_slow_captures(tmp_path, monkeypatch)
    attached = []  # graphs left to capture at each attach
    monkeypatch.setattr(EngineLoop, "connect_drafter", lambda self, address: attached.append((address, left[0])))
    replica, _, thread = engine_loop_in_a_thread(engine, config)
    replica.send([("drafter", "the actor's address")])
    deadline = time.monotonic() + 30
    while not attached and time.monotonic() < deadline:
        time.sleep(0.05)
    assert attached == [("the actor's address", 0)]
    replica.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
