"""An engine process that outlives its verifier replica, for the next replica to adopt.

Loading the models, sizing the KV cache and capturing graphs take most of a replica's start (on an
H200 ~20 s of the ~23 s a killed replica took to serve again: BENCHMARKS, *Restarts*). A killed
replica's engine process has all of that, and needs none of the replica: routers reach it
directly. So when its replica's pipe closes, the engine process becomes an orphan for up to
`ServeConfig.engine_adoption_s`: it goes on serving the requests it holds, and listens on a Unix
socket under `adoption_dir()`, named by its pid, for a new replica on the same node and GPU.

Only processes of the same user meet there: the folders must be this user's alone, and each side
checks the other's credentials (SO_PEERCRED) before reading anything from it (the pipe pickles).

A new replica offers its identity (the code it runs, its configuration, whether it records
metrics and its intake's host: `identity`) to each orphan it finds there. An orphan with the
same identity answers `ready` with its intake's address, and the pipe is that connection from then
on; one with another identity answers `refused` and exits, so that its GPU memory is free before
the new replica starts an engine of its own. An orphan nobody adopts in time exits; its requests'
streams then end as a replica's death ends them (UNAVAILABLE: retry).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import socket
import struct
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

ANSWER_TIMEOUT_S = 10.0  # an orphan answers between two engine steps
CONNECT_TIMEOUT_S = 2.0
OFFER_TIMEOUT_S = 2.0  # an adopting replica offers at once; the orphan's loop waits no longer for it


def adoption_dir() -> Path:
    """Where the orphans a replica of this process's Ray node and GPUs may adopt listen: per user,
    Ray node (its raylet's pid: another cluster's replicas never meet them) and CUDA_VISIBLE_DEVICES
    (Ray gives each GPU replica its own), so only a replica placed on the same GPU finds them."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() or "none"
    scope = f"{os.environ.get('RAY_RAYLET_PID', 'no-ray')}-{gpus}"
    return Path(tempfile.gettempdir()) / f"dflash-orphans-{os.getuid()}" / re.sub(r"[^0-9A-Za-z,-]", "_", scope)


def cluster_gone() -> bool:
    """Whether the Ray node this process was started under has ended (no replica can come)."""
    raylet = os.environ.get("RAY_RAYLET_PID")
    return bool(raylet) and wait_exit(int(raylet), 0)


def code_fingerprint() -> str:
    """The code an engine process runs: the interpreter, and every source file of dflash_serve by
    path, size and modification time (an upgrade in place changes it). Taken at an engine's start."""
    package = Path(__file__).parents[2]
    digest = hashlib.sha256(os.path.realpath(sys.executable).encode())
    for folder in (package / "services", package / "kernels"):
        for path in sorted(folder.rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def identity(config: dict, record_metrics: bool, intake_host: str, fingerprint: str) -> str:
    """What an orphan and its adopter must share: it serves their configuration as they would."""
    return json.dumps([fingerprint, config, record_metrics, intake_host], sort_keys=True, default=str)


def private_folder(directory: Path) -> None:
    """Makes `directory` (and its parent) this user's alone, or raises PermissionError if someone
    else owns either or may write there."""
    directory.parent.mkdir(mode=0o700, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    if not _ours(directory):
        raise PermissionError(f"{directory} or its parent is not this user's alone")


def _ours(directory: Path) -> bool:
    """Whether `directory` and its parent are this user's and no one else may write there."""
    for folder in (directory, directory.parent):
        info = folder.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return False
    return True


def peer(sock: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of a Unix socket's other end."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class OrphanListener:
    """The orphan's side: a listening socket at adoption_dir()/PID.sock, removed when closed."""

    def __init__(self):
        directory = adoption_dir()
        private_folder(directory)
        self.path = directory / f"{os.getpid()}.sock"
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        self.sock.listen(4)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Connection | None:
        """The connection of a process of this user; None for anyone else's (closed unread)."""
        conn, _ = self.sock.accept()
        if peer(conn)[1] != os.getuid():
            conn.close()
            return None
        conn.setblocking(True)
        return Connection(conn.detach())

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


def offer(wanted: str) -> tuple[Connection, int, dict] | None:
    """The replica's side: the first orphan here that has `wanted` identity, as (the pipe, its pid,
    its `ready` info); None if there is none. Orphans of another identity exit, and this waits for
    them (their GPU memory is free once this returns)."""
    directory = adoption_dir()
    if not directory.is_dir() or not _ours(directory):
        return None
    for path in sorted(directory.glob("*.sock")):
        if not path.stem.isdigit():
            continue
        pid = int(path.stem)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except OSError:  # left behind by an orphan that was killed: nobody listens
            sock.close()
            if wait_exit(pid, 0):
                path.unlink(missing_ok=True)
            continue
        if peer(sock) != (pid, os.getuid()):  # not the orphan its name says
            sock.close()
            continue
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            conn.send(("adopt", wanted))
            if not conn.poll(ANSWER_TIMEOUT_S):
                raise TimeoutError(f"no answer in {ANSWER_TIMEOUT_S:.0f} s")
            answer = conn.recv()
        except (OSError, EOFError, TimeoutError):  # it ended meanwhile, or another replica adopted it
            conn.close()
            continue
        if answer[0] == "ready":
            return conn, pid, answer[1]
        conn.close()
        wait_exit(pid, ANSWER_TIMEOUT_S)  # refused: it exits, freeing its memory
    return None


def wait_exit(pid: int, timeout: float) -> bool:
    """Whether process `pid` (not a child of this one: a pidfd, which also sees a zombie as ended)
    ended within `timeout`; 0: whether it has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)
