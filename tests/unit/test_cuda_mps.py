"""`dflash serve --cuda-mps`: a private MPS control daemon around the server, against a stand-in
for nvidia-cuda-mps-control that logs how it was called (the real one needs a GPU)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from dflash_serve.services.cuda_mps import LOG_VAR, PIPE_VAR, CudaMpsError, cuda_mps

FAKE = """#!/bin/sh
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
if [ "$1" = "-d" ]; then
    if [ -n "$FAKE_MPS_FAIL" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
    [ -n "$FAKE_MPS_NO_PIPE" ] || mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
    exit 0
fi
sed 's/^/stdin=/' >> "$FAKE_MPS_LOG"
[ -z "$FAKE_MPS_QUIT_WAITS" ] || sleep 30
"""


@pytest.fixture
def control(tmp_path, monkeypatch):
    """The stand-in daemon first on PATH; returns a function reading its log lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.delenv(PIPE_VAR, raising=False)
    monkeypatch.setenv(LOG_VAR, "/the/operator's")
    return lambda: log.read_text().splitlines() if log.exists() else []


def test_the_daemon_is_private_started_before_and_told_to_quit_after(control):
    with cuda_mps() as env:
        pipe = env[PIPE_VAR]
        assert os.environ[PIPE_VAR] == pipe and os.environ[LOG_VAR] == env[LOG_VAR]  # what Ray's processes inherit
        assert os.path.basename(os.path.dirname(pipe)).startswith("dflash-mps-") and os.listdir(pipe) == ["control"]
        assert control() == [f"args=-d pipe={pipe}"]
    assert control() == [f"args=-d pipe={pipe}", f"args= pipe={pipe}", "stdin=quit"]
    assert PIPE_VAR not in os.environ and os.environ[LOG_VAR] == "/the/operator's"  # restored
    assert not os.path.exists(os.path.dirname(pipe))


def test_the_daemon_quits_when_the_server_fails(control):
    with pytest.raises(RuntimeError, match="the server failed"):
        with cuda_mps() as env:
            raise RuntimeError("the server failed")
    assert control()[-1] == "stdin=quit" and not os.path.exists(os.path.dirname(env[PIPE_VAR]))


def test_a_process_still_a_client_is_not_held_by_the_quit(control, monkeypatch):
    """`quit` waits for every client to go; a benchmark holding a CUDA context is one, so the
    context exits after the timeout and leaves the daemon its directory until then."""
    monkeypatch.setenv("FAKE_MPS_QUIT_WAITS", "1")
    started = time.monotonic()
    with cuda_mps(timeout=0.5) as env:
        pass
    assert time.monotonic() - started < 5 and control()[-1] == "stdin=quit"
    assert os.path.isdir(env[PIPE_VAR]) and PIPE_VAR not in os.environ


def test_a_daemon_that_will_not_start_is_a_clear_error(control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(CudaMpsError, match="-d exited with 1: An instance of this daemon is already running"):
        with cuda_mps():
            pytest.fail("the server must not start")
    assert PIPE_VAR not in os.environ and len(control()) == 1

    monkeypatch.delenv("FAKE_MPS_FAIL")
    monkeypatch.setenv("FAKE_MPS_NO_PIPE", "1")
    with pytest.raises(CudaMpsError, match="made no control pipe .* within 0 s: no log"):
        with cuda_mps(timeout=0.2):
            pytest.fail("the server must not start")


def test_without_the_control_binary_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CudaMpsError, match="needs nvidia-cuda-mps-control on PATH .* or run without --cuda-mps"):
        with cuda_mps():
            pytest.fail("the server must not start")


def test_serve_refuses_cuda_mps_for_a_cpu_server(capsys):
    from dflash_serve.services.cli import main

    assert main(["serve", "--cuda-mps", "--target", "my/target", "--drafter", "none", "--device", "cpu"]) == 2
    assert "--cuda-mps is for a GPU server; engine.device is cpu" in capsys.readouterr().err
