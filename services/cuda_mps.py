"""CUDA MPS for a server on one machine (`dflash serve --cuda-mps`).

Two processes on one GPU (the verifier and a drafter sharing its GPU) time-slice it: each gets
the whole GPU in turns, and a switch costs. As clients of one MPS server their kernels share the
SMs instead. Measured on 2 × H200 (BENCHMARKS.md, seventh session): the shared-GPU split went
from 0.91–0.92 to 0.975 of colocated at batch 1 (colocated itself run under MPS too).

The control daemon is the server's own: a private pipe directory, so no other CUDA process of
the machine becomes its client, started before any of the server's processes creates a CUDA
context (a process joins MPS when its context is made, if the pipe variable is set then), and
told to quit when the server stops. On Kubernetes this does not apply: the NVIDIA device plugin
runs MPS for a node (its `sharing.mps` setting).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"


class CudaMpsError(RuntimeError):
    """The MPS control daemon could not be started."""


@contextlib.contextmanager
def cuda_mps(timeout: float = 10.0) -> Iterator[dict[str, str]]:
    """Start a private MPS control daemon and point this process's environment (which Ray's
    processes inherit) at it; on exit, quit it and restore the environment. Yields the variables."""
    exe = shutil.which(CONTROL)
    if exe is None:
        raise CudaMpsError(f"CUDA MPS needs {CONTROL} on PATH (it comes with the NVIDIA driver's utilities); "
                           "install them or run without --cuda-mps")
    root = tempfile.mkdtemp(prefix="dflash-mps-")
    env = {PIPE_VAR: os.path.join(root, "pipe"), LOG_VAR: os.path.join(root, "log")}
    for path in env.values():
        os.mkdir(path)
    daemon_env = {**os.environ, **env}
    try:
        started = subprocess.run([exe, "-d"], env=daemon_env, capture_output=True, text=True, timeout=timeout)
        if started.returncode != 0:
            raise CudaMpsError(f"{CONTROL} -d exited with {started.returncode}: "
                               f"{(started.stderr or started.stdout).strip() or 'no message'}")
        _wait_for_pipe(env[PIPE_VAR], env[LOG_VAR], timeout)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # The daemon stops its MPS server once every client is gone, then exits; `quit` waits for
        # that. A process still holding a CUDA context (a benchmark) is one, so it leaves the
        # command to wait for its own exit, with the directory in place for the daemon.
        stop = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=daemon_env, text=True)
        stop.stdin.write("quit\n")
        stop.stdin.close()
        try:
            stop.wait(timeout=timeout)
            shutil.rmtree(root, ignore_errors=True)
        except subprocess.TimeoutExpired:
            pass


def _wait_for_pipe(pipe_dir: str, log_dir: str, timeout: float) -> None:
    """The daemon forks into the background; it is ready once it has made its control pipe."""
    deadline = time.monotonic() + timeout
    while not os.listdir(pipe_dir):
        if time.monotonic() > deadline:
            log = Path(log_dir, "control.log")
            tail = log.read_text()[-500:].strip() if log.exists() else "no log"
            raise CudaMpsError(f"{CONTROL} made no control pipe in {pipe_dir} within {timeout:.0f} s: {tail}")
        time.sleep(0.05)
