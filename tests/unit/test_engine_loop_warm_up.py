"""The engine process's loop does the start-up work the loader deferred after it answers — the CUDA
graphs' captures, then the drafter's round costs — back to back while idle, a piece at a time between
steps under load, so a request never waits for all of it."""

from __future__ import annotations

import asyncio
import copy
import time

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.engine import Engine
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.round_costs import CostMeasurement
from dflash_serve.services.engine.sampling_params import SamplingParams
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


async def _one_request(replica, params: SamplingParams, then) -> tuple[list[int], object]:
    """A request through the loop's pipe: its tokens, and `then()` when it finished."""
    listener = OutputListener()
    queue = listener.open("r")
    replica.send([("add", "r", [1, 2, 3], params, await listener.reply_to())])
    tokens = []
    while True:
        out = await asyncio.wait_for(queue.get(), 30)
        tokens += out.new_token_ids
        if out.finished:
            break
    state = then()
    await listener.aclose()
    return tokens, state


def _wait_for(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _stop(replica, thread) -> None:
    replica.close()  # the loop ends: its replica is gone (engine_adoption_s 0)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_request_is_answered_between_captures_and_the_rest_are_captured_when_idle(tmp_path, monkeypatch):
    config, engine, left = _engine_with_slow_captures(tmp_path, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = engine.generate([[1, 2, 3]], params)[0].output_ids
    replica, _, thread = engine_loop_in_a_thread(engine, config)
    tokens, captured_by_then = asyncio.run(_one_request(replica, params, lambda: PIECES - left[0]))
    assert tokens == expected
    assert captured_by_then < PIECES  # answered long before every graph was captured
    assert _wait_for(lambda: left[0] == 0)  # idle: the rest back to back
    _stop(replica, thread)


def test_a_drafter_whose_round_costs_are_unknown_attaches_once_the_loop_has_timed_them(tmp_path, monkeypatch):
    """A first start (no costs kept): the deferred engine answers target-only while the loop times
    the drafter's round costs a round at a time, after the graphs; then it speculates, with the
    same greedy tokens, and the costs are kept for the next start."""
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    engine_cfg = {"target": target, "drafter": drafter, "max_num_seqs": 2, "speculation": "adaptive"}
    config = ServeConfig.from_dict({"engine": {**engine_cfg, "round_costs_dir": str(tmp_path / "costs")},
                                    "topology": "colocated", "engine_adoption_s": 0})
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reference = build_engine(ServeConfig.from_dict({"engine": {**engine_cfg, "round_costs_dir": ""}}).engine)
    expected = reference.generate([[1, 2, 3]], params)[0].output_ids
    timed = []  # (graphs left to capture) at each timed round

    def slow_measure_next(self, measure_next=CostMeasurement.measure_next):
        time.sleep(PIECE_S)
        timed.append(left[0])
        return measure_next(self)

    monkeypatch.setattr(CostMeasurement, "measure_next", slow_measure_next)
    engine = build_engine(config.engine, defer_warm_up=True)
    assert engine.proposer is None and engine.measuring_costs and engine.warming_up
    left = [3]  # graphs "to capture" first
    monkeypatch.setattr(Engine, "graphs_pending", property(lambda self: left[0] > 0))
    engine.capture_next_graph = lambda: left.__setitem__(0, left[0] - 1)
    replica, _, thread = engine_loop_in_a_thread(engine, config)
    tokens, speculating_by_then = asyncio.run(_one_request(replica, params, lambda: engine.proposer is not None))
    assert tokens == expected and not speculating_by_then
    assert _wait_for(lambda: engine.proposer is not None)  # idle: the rest of the timings back to back
    assert len(timed) > 10 and set(timed) == {0}  # on the graphs, so after them
    assert not engine.warming_up and engine.speculation.costs is not None
    assert list((tmp_path / "costs").iterdir())  # kept
    tokens, _ = asyncio.run(_one_request(replica, params, lambda: None))
    assert tokens == expected
    _stop(replica, thread)


def test_a_drafter_whose_round_costs_are_kept_attaches_at_once(tmp_path):
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    config = ServeConfig.from_dict({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2,
                                               "speculation": "adaptive", "round_costs_dir": str(tmp_path / "costs")}})
    build_engine(config.engine)  # measures and keeps them
    engine = build_engine(config.engine, defer_warm_up=True)
    assert engine.proposer is not None and not engine.warming_up and engine.speculation.costs is not None


def _deferred_engine(tmp_path, **settings):
    """A deferred engine with adaptive speculation and no round costs kept: its drafter waits for them."""
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    config = ServeConfig.from_dict({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2,
                                               "speculation": "adaptive", "round_costs_dir": str(tmp_path / "costs"),
                                               **settings}})
    engine = build_engine(config.engine, defer_warm_up=True)
    assert engine.measuring_costs
    return engine


def test_a_drafter_that_comes_while_another_waits_for_its_costs_replaces_it(tmp_path):
    """The drafter of a split replica died and came back while its costs were timed: the first's
    timing stops and it is released; the second's starts afresh. No KV block is held between timings."""
    engine = _deferred_engine(tmp_path)
    first = engine._measurement.proposer
    engine.warm_up_next()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    released = []
    second = copy.copy(first)  # another drafter object (on the same pools: the first's release is recorded only)
    first.release = lambda: released.append(first)
    engine.attach_when_measured(second)
    assert released == [first] and engine.measuring_costs
    while engine.warming_up:
        engine.warm_up_next()
    assert engine.proposer is second
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_the_timings_wait_while_the_running_requests_hold_every_kv_block(tmp_path):
    engine = _deferred_engine(tmp_path, num_kv_blocks=40)
    held: list[int] = []
    engine.allocator.grow(held, engine.allocator.num_blocks * engine.allocator.block_size)
    for _ in range(3):
        engine.warm_up_next()
    assert engine.measuring_costs and engine.proposer is None
    engine.allocator.release(held)
    while engine.warming_up:
        engine.warm_up_next()
    assert engine.proposer is not None and engine.speculation.costs is not None


def test_a_cache_smaller_than_the_timed_context_has_them_timed_at_a_context_it_holds(tmp_path):
    engine = _deferred_engine(tmp_path, num_kv_blocks=8)
    while engine.warming_up:
        engine.warm_up_next()
    assert engine.speculation.costs.context == 8 * engine.allocator.block_size - 6  # its block of 6 after it
