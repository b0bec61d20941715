"""`remove_cuda_ipc_leftovers`: the CUDA driver's and torch's IPC files of this server's exited
processes go; anything else (a running process's, one older than the server, not such a file,
this process's own) stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dflash_serve.services.transport.leftovers import owner_pid, remove_cuda_ipc_leftovers


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_owner_pid_reads_both_kinds_of_name():
    assert owner_pid("cuda.shm.0.14e2.1") == 0x14E2
    assert owner_pid("torch_5346_3450990990_0") == 5346
    assert owner_pid("dflash_features_ab12") is None
    assert owner_pid("cuda.shm.0.xyz.1") is None


def test_removes_only_new_files_of_exited_processes(tmp_path):
    dead, alive = _exited_pid(), os.getppid()
    since = time.time() - 1
    names = {
        "dead driver": f"cuda.shm.0.{dead:x}.1",
        "dead torch": f"torch_{dead}_123456_0",
        "running": f"cuda.shm.0.{alive:x}.1",
        "this process": f"torch_{os.getpid()}_42_0",
        "ours": "dflash_features_0a1b",
        "unrelated": "sem.something",
        "old": f"torch_{dead}_999_1",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / names["old"], (since - 60, since - 60))  # from before the server started
    removed, running = remove_cuda_ipc_leftovers(since, shm_dir=str(tmp_path), wait_s=0.2)
    assert removed == sorted([names["dead driver"], names["dead torch"]])
    assert running == [names["running"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names.values()) - set(removed))


def test_waits_for_a_process_that_is_exiting(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    name = f"cuda.shm.0.{child.pid:x}.1"
    (tmp_path / name).write_bytes(b"x")
    try:
        removed, running = remove_cuda_ipc_leftovers(time.time() - 1, shm_dir=str(tmp_path), wait_s=20)
    finally:
        child.wait()
    assert (removed, running) == ([name], [])


def test_a_machine_without_the_shared_memory_folder_has_nothing_to_remove(tmp_path):
    assert remove_cuda_ipc_leftovers(0.0, shm_dir=str(tmp_path / "absent")) == ([], [])
