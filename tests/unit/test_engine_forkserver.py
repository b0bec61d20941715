"""`dflash serve`'s engine fork server: a replica's engine process forked from a process that has
imported the engine already serves as a started one does, and a replica falls back to starting
its own where there is no server or it runs other code."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dflash_serve.services.config import ServeConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.verifier import adoption, engine_forkserver
from dflash_serve.services.verifier.verifier import Verifier
from tests.unit.test_engine_adoption import GREEDY, PROMPT, _config, generate, orphans  # noqa: F401


@pytest.fixture
def forkserver(orphans):  # noqa: F811 - the fixture of that name: the sockets in a folder of this test's own
    server = engine_forkserver.EngineForkServer()
    yield server
    server.stop()
    assert os.environ.get(engine_forkserver.FORKSERVER_ENV) is None and not server.path.exists()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_replicas_engine_process_is_forked_by_the_server_and_serves(tmp_path, forkserver):
    config = _config(tmp_path, engine_adoption_s=30)
    expected = build_engine(ServeConfig.from_dict(config).engine).generate([PROMPT], GREEDY)[0].output_ids
    verifier = Verifier(config)
    pid = verifier._process.pid
    assert _parent(pid) == forkserver.process.pid  # not a child of the replica: detached, as adoption needs
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "dflash-engine"
    tokens, last = generate(verifier._send, "forked")
    assert last.finished and tokens == expected
    forkserver.stop()  # the server ends with `dflash serve`; the engine processes it forked live on
    assert not adoption.wait_exit(pid, 0.5)
    verifier.check_health()
    verifier.shutdown()
    assert adoption.wait_exit(pid, 10)


def test_a_replica_of_other_code_or_without_a_server_starts_its_own_engine(forkserver, monkeypatch):
    left, right = os.pipe()
    try:
        for junk in ([b"junk"], [b"\x00\x00\x00\x05junk!"]):  # no descriptors; descriptors and no pickle
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(forkserver.path))
                socket.send_fds(sock, junk, [left, left, left] if len(junk[0]) > 4 else [])
                assert sock.recv(4) == b""  # dropped: no answer
        monkeypatch.setattr(adoption, "code_fingerprint", lambda: "another version")
        assert engine_forkserver.fork_engine(right, dict(os.environ)) is None  # refused
        monkeypatch.setenv(engine_forkserver.FORKSERVER_ENV, str(forkserver.path.with_name("gone.sock")))
        assert engine_forkserver.fork_engine(right, dict(os.environ)) is None  # nobody listens
    finally:
        os.close(left)
        os.close(right)
    assert forkserver.process.poll() is None  # a refusal does not end the server
