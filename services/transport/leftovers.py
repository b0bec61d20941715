"""Files that CUDA IPC leaves in /dev/shm after a process exits, and their removal.

A process that exports CUDA memory or an interprocess event gets a driver file
`cuda.shm.<n>.<pid in hex>.<n>` that outlives it, even after a clean exit; one that ends while it
still shares CUDA tensors (Ray stopping a replica) also leaves torch's reference-counter file
`torch_<pid>_<n>_<n>`. Each is about 80 KB (measured on the H100 machine; BENCHMARKS). Our own
segments (`dflash_*`) are unlinked as soon as the peer has mapped them; these two are not ours
to name, so `dflash serve` removes those of its exited processes when it stops. In Kubernetes
the pod's /dev/shm goes with the pod.
"""

from __future__ import annotations

import contextlib
import os
import re
import time

from dflash_serve.services.transport.shared_buffer import SHM_DIR

_CUDA_DRIVER_FILE = re.compile(r"cuda\.shm\.\d+\.([0-9a-f]+)\.\d+")
_TORCH_REF_COUNTERS = re.compile(r"torch_(\d+)_\d+_\d+")


def owner_pid(name: str) -> int | None:
    """The process a CUDA IPC leftover in /dev/shm belongs to (None: not such a file)."""
    if match := _CUDA_DRIVER_FILE.fullmatch(name):
        return int(match.group(1), 16)
    if match := _TORCH_REF_COUNTERS.fullmatch(name):
        return int(match.group(1))
    return None


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has: only its parent's wait is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_cuda_ipc_leftovers(since: float, *, shm_dir: str = SHM_DIR, wait_s: float = 5.0
                              ) -> tuple[list[str], list[str]]:
    """Remove this user's CUDA IPC files in `shm_dir` written since `since` (a `time.time()`)
    whose process has exited, after waiting up to `wait_s` for those still exiting (Ray ends its
    workers after `ray.shutdown()` returns). This process's own are left alone. Returns (removed,
    kept because their process still runs)."""
    if not os.path.isdir(shm_dir):  # no POSIX shared memory there (macOS): nothing was left
        return [], []
    deadline = time.monotonic() + wait_s
    while True:
        owners: dict[str, int] = {}
        for name in os.listdir(shm_dir):
            pid = owner_pid(name)
            if pid is None or pid == os.getpid():
                continue
            with contextlib.suppress(FileNotFoundError):
                stat = os.stat(os.path.join(shm_dir, name))
                if stat.st_uid == os.getuid() and stat.st_mtime >= since:
                    owners[name] = pid
        running = sorted(name for name, pid in owners.items() if _running(pid))
        if not running or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    removed = sorted(set(owners) - set(running))
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
    return removed, running
