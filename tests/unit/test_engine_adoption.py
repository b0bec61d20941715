"""A verifier replica's engine process outlives the replica (`adoption`): it goes on serving the
requests it holds, and the next replica of the same code and configuration adopts it instead of
loading everything again. Here the replica's death is its end of the pipe closing (what a SIGKILL
does to it); the integration suite kills a real replica."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.verifier import adoption
from dflash_serve.services.verifier.output_stream import OutputListener, StreamLost
from dflash_serve.services.verifier.verifier import EngineProcess, Verifier
from tests.served_pair import save_tiny_pair
from tests.unit.test_verifier_health import engine_loop_in_a_thread

GREEDY = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
PROMPT = [1, 2, 3, 4]


@pytest.fixture
def orphans(monkeypatch):
    """A temporary folder of this test's own for the orphans' sockets (short: a socket's path has
    at most 107 bytes), seen by this process and the engine processes it starts."""
    folder = tempfile.mkdtemp(prefix="dfa", dir="/tmp")
    monkeypatch.setenv("TMPDIR", folder)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _config(tmp_path, **overrides) -> dict:
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    return ServeConfig.from_dict({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2},
                                  "topology": "colocated", **overrides}).to_dict()


def _start_replica(config: dict) -> tuple[EngineProcess, dict]:
    """What a replica does to start its engine (`Verifier._start_engine`, colocated)."""
    process = EngineProcess.spawn(detached=True)
    process.send([("config", config, False, "127.0.0.1")])
    return process, process.wait_ready()


def _wait_for_the_orphan() -> Path:
    deadline = time.monotonic() + 30
    while not (sockets := list(adoption.adoption_dir().glob("*.sock"))):
        assert time.monotonic() < deadline, "no orphan listened"
        time.sleep(0.05)
    (socket_path,) = sockets
    return socket_path


async def _request_until_first_tokens(send, listener: OutputListener, request_id: str, params=GREEDY):
    queue = listener.open(request_id)
    send([("add", request_id, PROMPT, params, await listener.reply_to())])
    first = await asyncio.wait_for(queue.get(), 30)
    return queue, list(first.new_token_ids)


async def _rest(queue) -> tuple[list[int], object]:
    tokens = []
    while True:
        item = await asyncio.wait_for(queue.get(), 60)
        if isinstance(item, StreamLost):
            return tokens, item
        tokens += item.new_token_ids
        if item.finished:
            return tokens, item


def test_a_replica_that_dies_leaves_its_engine_serving_to_the_next_which_adopts_it(tmp_path, orphans):
    """A router's direct request goes on to its last token while no replica has the engine; the
    next replica adopts that very process and serves through it."""
    config = _config(tmp_path, engine_adoption_s=30)
    expected = build_engine(ServeConfig.from_dict(config).engine).generate([PROMPT], GREEDY)[0].output_ids
    old, info = _start_replica(config)

    async def scenario():
        listener = OutputListener()
        intake = await listener.connect(info["intake"])  # a router's direct intake: no replica in its way
        queue = listener.open("held")
        intake.add("held", PROMPT, GREEDY)
        tokens = list((await asyncio.wait_for(queue.get(), 30)).new_token_ids)
        old.conn.close()  # the replica dies mid-request
        socket_path = _wait_for_the_orphan()
        assert socket_path.stem == str(old.pid)
        rest, last = await _rest(queue)
        assert last.finished and last.finish_reason is FinishReason.LENGTH  # served without its replica
        assert tokens + rest == expected
        verifier = Verifier(config)  # the next replica
        assert verifier._process.pid == old.pid and verifier.info["intake"] == info["intake"]
        assert not socket_path.exists()
        queue, tokens = await _request_until_first_tokens(verifier._send, listener, "after")
        rest, last = await _rest(queue)
        assert last.finished and tokens + rest == expected
        assert (await verifier.stats())["running"] == 0
        await listener.aclose()
        return verifier

    verifier = asyncio.run(scenario())
    verifier.check_health()
    verifier.shutdown()
    assert adoption.wait_exit(old.pid, 10)


def test_an_orphan_of_another_configuration_exits_before_the_new_replica_starts_its_own(tmp_path, orphans):
    old, _ = _start_replica(_config(tmp_path, engine_adoption_s=30))
    old.conn.close()
    _wait_for_the_orphan()
    verifier = Verifier(_config(tmp_path / "other", engine_adoption_s=30))
    assert adoption.wait_exit(old.pid, 0), "the orphan still runs beside the new engine"  # its memory was freed first
    assert verifier._process.pid != old.pid
    verifier.shutdown()
    assert not list(adoption.adoption_dir().glob("*.sock"))


def test_an_orphan_nobody_adopts_exits_in_time_and_its_streams_end_retryably(tmp_path, orphans):
    """The engine process's loop, here in a thread, with steps slowed down so that a request is
    still running when the orphan's time runs out."""
    config = ServeConfig.from_dict(_config(tmp_path, engine_adoption_s=0.5))
    engine = build_engine(config.engine)
    step = engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    replica, loop, thread = engine_loop_in_a_thread(engine, config)

    async def scenario():
        listener = OutputListener()
        intake = await listener.connect(loop.intake_address)
        queue = listener.open("held")
        intake.add("held", PROMPT, GREEDY)
        await asyncio.wait_for(queue.get(), 30)
        replica.close()
        _wait_for_the_orphan()
        tokens, last = await _rest(queue)
        await listener.aclose()
        return tokens, last

    tokens, last = asyncio.run(scenario())
    assert isinstance(last, StreamLost) and tokens  # served as an orphan, then the router answers UNAVAILABLE: retry

    thread.join(timeout=10)
    assert not thread.is_alive()
    assert not list(adoption.adoption_dir().glob("*.sock"))


def test_with_no_adoption_the_engine_process_ends_with_its_replica(tmp_path, orphans):
    old, _ = _start_replica(_config(tmp_path, engine_adoption_s=0))
    old.conn.close()
    assert old.wait_exited(10)
    assert not adoption.adoption_dir().exists() or not list(adoption.adoption_dir().glob("*.sock"))


def test_no_adoption_through_a_folder_others_may_write_to(orphans):
    """Another user could plant a socket there, and the pipe unpickles what it reads."""
    folder = adoption.adoption_dir()
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="not this user's alone"):
        adoption.OrphanListener()
    assert adoption.offer("any identity") is None


def test_a_split_engine_is_ready_before_its_drafter_asks_for_it_and_speculates_once_attached(tmp_path, orphans):
    """Topology split: the engine does not wait for the drafter actor's start (the longest part of a
    replica's, BENCHMARKS *Restarts*); it decodes target-only until the replica sends the address."""
    import torch

    from dflash_serve.services.drafter.server import DrafterServer

    config = _config(tmp_path, engine_adoption_s=0, topology="split")
    engine_cfg = ServeConfig.from_dict(config).engine
    expected = build_engine(engine_cfg).generate([PROMPT], GREEDY)[0].output_ids
    process, _ = _start_replica(config)
    try:
        assert process.conn.poll(30)
        assert ("drafter_wanted",) in process.conn.recv()
        process.send([("stats", 0)])
        assert _reply(process, "stats")[2]["speculative"] is False
        drafter = DrafterServer.load(engine_cfg.drafter, device="cpu", dtype=torch.float32)
        drafter.start()
        process.send([("drafter", drafter.address)])
        assert _speculating_within(process, 60)  # once its round costs are known: timed between steps, none kept
        tokens, last = generate(process.send, "split")
        assert last.finished and tokens == expected
        process.send([("stats", 2)])
        assert _reply(process, "stats")[2]["speculative"] is True  # not lost: it drafted
    finally:
        process.stop()


def generate(send, request_id: str) -> tuple[list[int], object]:
    """A request sent through `send` (a replica's pipe) with its outputs on a router's listener:
    its tokens and its last output."""

    async def scenario():
        listener = OutputListener()
        queue, tokens = await _request_until_first_tokens(send, listener, request_id)
        rest, last = await _rest(queue)
        await listener.aclose()
        return tokens + rest, last

    return asyncio.run(scenario())


def _speculating_within(process: EngineProcess, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        process.send([("stats", 1)])
        if _reply(process, "stats")[2]["speculative"]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _reply(process: EngineProcess, kind: str) -> tuple:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.conn.poll(1):
            for message in process.conn.recv():
                if message[0] == kind:
                    return message
    raise AssertionError(f"no {kind} reply")
