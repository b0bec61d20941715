"""Engine processes forked from one that has imported the engine already.

An engine process spends its first seconds importing torch, transformers and the engine: 15 s of
an H200 replica's start, its longest part (BENCHMARKS, *Restarts*). `dflash serve` starts this
server first thing, so that those imports run while Ray and Serve start: it imports them once,
without starting CUDA, and listens on a Unix socket whose path the replicas find in
$DFLASH_ENGINE_FORKSERVER (Ray's processes inherit the command's environment). A replica asks it
for its engine process (`fork_engine`), handing over its end of the pipe, its stdout and stderr and
its environment; the server forks a child that takes them (CUDA_VISIBLE_DEVICES among them: CUDA
reads it when it starts, after the fork) and runs `engine_process.main`, as a started one would
(named dflash-engine in `ps -o comm`; OMP_NUM_THREADS, which OpenMP reads as torch loads, applied).
What else the imports read from the environment is the command's, as a replica's is under `dflash serve`.
The child is not the replica's (it is detached: `engine_adoption_s` > 0 only). A replica without a
server (Kubernetes, tests), or whose code differs from the server's, starts its engine as before.

Only this user's processes may ask: the socket's folder is this user's alone and the server
checks each caller's credentials (SO_PEERCRED) before reading from it (requests are pickled).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_serve.services.process_control import die_with_parent, name_this_process
from dflash_serve.services.verifier import adoption

FORKSERVER_ENV = "DFLASH_ENGINE_FORKSERVER"
ANSWER_TIMEOUT_S = 300.0  # the server answers once its imports are done: never later than a fresh process would be
HEADER = struct.Struct("!I")


class EngineForkServer:
    """`dflash serve`'s side: the server's process, started at once; it ends with this process."""

    def __init__(self):
        folder = Path(tempfile.gettempdir()) / f"dflash-forkserver-{os.getuid()}" / "servers"
        adoption.private_folder(folder)  # PermissionError: not this user's alone
        self.path = folder / f"{os.getpid()}.sock"
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))  # before the imports: a replica's request waits in the backlog for them
        listener.listen(16)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, str(listener.fileno())],
                                            pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            listener.close()
        os.environ[FORKSERVER_ENV] = str(self.path)

    def stop(self) -> None:
        os.environ.pop(FORKSERVER_ENV, None)
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.path.unlink(missing_ok=True)


def fork_engine(pipe_fd: int, env: dict[str, str]) -> int | None:
    """The replica's side: an engine process forked for it, which runs `engine_process.main` on
    `pipe_fd` with `env`; its pid, or None where there is no server, or it runs other code."""
    path = os.environ.get(FORKSERVER_ENV)
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(adoption.CONNECT_TIMEOUT_S)
        sock.connect(path)
        if adoption.peer(sock)[1] != os.getuid():
            return None
        sock.settimeout(ANSWER_TIMEOUT_S)
        request = pickle.dumps((adoption.code_fingerprint(), env))
        socket.send_fds(sock, [HEADER.pack(len(request)) + request], [pipe_fd, 1, 2])
        answer = _read_exactly(sock, HEADER.size)
        pid = HEADER.unpack(answer)[0] if answer else 0
        return pid or None  # 0: it refused (other code) or could not fork
    except OSError:  # no server (it ended), or it died meanwhile: start one as before
        return None
    finally:
        sock.close()


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def serve_forks(listener: socket.socket) -> None:
    """The server's loop: import the engine, then fork an engine process for each request."""
    import torch

    import dflash_serve.services.engine.loader  # noqa: F401 - the imports each engine process would make
    import dflash_serve.services.verifier.engine_process  # noqa: F401
    import transformers.masking_utils  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    if torch.cuda.is_initialized():  # a child would inherit a CUDA context it cannot use
        raise RuntimeError("CUDA started while importing the engine; engine processes are not forked")
    fingerprint = adoption.code_fingerprint()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped as they end
    while True:
        conn, _ = listener.accept()
        with conn:
            if adoption.peer(conn)[1] != os.getuid():
                continue
            try:
                their_fingerprint, env, fds = _receive_request(conn)
            except Exception:  # noqa: BLE001 - not a request: dropped, the server goes on
                continue
            try:
                pid = _fork_child(listener, conn, fds, env) if their_fingerprint == fingerprint else 0
            except OSError:  # fork failed (no memory, too many processes): the replica starts its own
                pid = 0
            finally:
                for fd in fds:
                    os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(HEADER.pack(pid))


def _receive_request(conn: socket.socket) -> tuple[str, dict[str, str], list[int]]:
    """A replica's (code fingerprint, environment) and its three descriptors (`fork_engine`); the
    descriptors are closed if the rest is not a request."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        if len(fds) != 3 or len(data) < HEADER.size:
            raise ValueError("not a request")
        size = HEADER.unpack(data[:HEADER.size])[0]
        body = data[HEADER.size:] + _read_exactly(conn, size - (len(data) - HEADER.size))
        if len(body) != size:
            raise EOFError("request cut short")
        fingerprint, env = pickle.loads(body)
        return fingerprint, dict(env), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _fork_child(listener: socket.socket, conn: socket.socket, fds: list[int], env: dict[str, str]) -> int:
    pipe_fd, stdout_fd, stderr_fd = fds
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: it becomes what `python -m ...engine_process FD` would have been
        listener.close()
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd in (stdout_fd, stderr_fd, devnull):
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        name_this_process(b"dflash-engine")  # its command line stays the server's
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit():  # Ray's, for the replica; a started process's OpenMP reads it as torch loads
            import torch

            torch.set_num_threads(int(threads))
        from dflash_serve.services.verifier import engine_process

        code = engine_process.main([str(pipe_fd)])
        logging.shutdown()
    finally:
        os._exit(code)  # never back into the server's loop


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_serve.services.verifier.engine_forkserver FD`: FD is the bound, listening socket."""
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()  # `dflash serve`'s; the engine processes forked already live on
    listener = socket.socket(fileno=int(argv[0]))
    with contextlib.suppress(KeyboardInterrupt):
        serve_forks(listener)
    return 0


if __name__ == "__main__":
    sys.exit(main())
