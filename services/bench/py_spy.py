"""py-spy on a running `dflash serve`'s processes while a bench run holds a given load: where the
serving path's time goes (issue 67), from the same command that measures it.

    python -m dflash_serve.services.bench.serving_path ... --profile-concurrency 32

The processes are found among the server's descendants by the titles Ray gives them: Serve's
proxy, the Router and Verifier replicas, the engine's process (the Verifier's child) and, split, the
drafter's actor. Each is
sampled with `py-spy record --threads` (threads that run Python, not those waiting), into one raw
file a process, and summarized as how busy it was and the functions most samples pass through.
py-spy must be on PATH (`pip install py-spy`; it reads other processes' memory, which ptrace must
allow: root, or kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import threading
import time
from pathlib import Path

# Process titles (Ray's `ray::ServeReplica:<app>:<deployment>`, `ray::ProxyActor`, `ray::DrafterActor`) by role.
ROLES = {"proxy": "ProxyActor", "router": ":Router", "verifier": ":Verifier", "drafter": "DrafterActor"}
RATE_HZ = 200
TOP_FUNCTIONS = 15


def py_spy() -> str:
    path = shutil.which("py-spy")
    if path is None:
        raise RuntimeError("--profile-concurrency needs py-spy on PATH (pip install py-spy)")
    return path


def server_processes(root_pid: int) -> dict[str, int]:
    """role -> pid among `root_pid`'s descendants; "engine" is the Verifier replica's child."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 2) for line in table.splitlines() if len(line.split(None, 2)) == 3]
    children = collections.defaultdict(list)
    for pid, ppid, args in rows:
        children[int(ppid)].append((int(pid), args))
    found, stack = {}, [root_pid]
    while stack:
        for pid, args in children[stack.pop()]:
            stack.append(pid)
            for role, title in ROLES.items():
                if title in args and args.startswith("ray::") and role not in found:
                    found[role] = pid
    if "verifier" in found and children[found["verifier"]]:
        found["engine"] = children[found["verifier"]][0][0]
    return found


def top_functions(raw: Path, count: int = TOP_FUNCTIONS, *, innermost: bool = False
                  ) -> tuple[int, list[tuple[str, float]]]:
    """(samples, the functions the most samples of a raw collapsed-stack file pass through with that
    share); `innermost`: the function each sample was in (a thread's own frame where it ran native
    code), which the frames every thread passes through do not crowd out."""
    counted, total = collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        total += int(samples)
        frames = stack.split(";")
        for frame in [frames[-1]] if innermost else set(frames):
            counted[frame] += int(samples)
    ranked = sorted(counted.items(), key=lambda item: (-item[1], item[0]))[:count]  # ties by name: stable output
    return total, [(frame, n / total) for frame, n in ranked] if total else []


class LoadProfiler:
    """Samples the server's processes for `seconds` once the bench's log shows the run at
    `concurrency` (its progress bar, `c=N`), written after `offset` in that log."""

    def __init__(self, server_pid: int, log_path: Path, offset: int, concurrency: int, seconds: float, out: Path,
                 client_pid: int | None = None):
        """client_pid: the load's own process, sampled too (a client can be what caps a load)."""
        self.server_pid, self.log_path, self.offset, self.client_pid = server_pid, log_path, offset, client_pid
        self.marker, self.seconds, self.out = f" c={concurrency}:", seconds, out
        self.summary: str | None = None
        self._tool = py_spy()
        self._bench_ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="py-spy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._load_started():
            if self._bench_ended.wait(0.2):
                return
        time.sleep(1.0)  # past the first requests' admission
        self.out.mkdir(parents=True, exist_ok=True)
        processes = server_processes(self.server_pid)
        if not processes:
            self.summary = f"py-spy: no Serve process found under the server's pid {self.server_pid}\n"
            return
        if self.client_pid is not None:
            processes["bench client"] = self.client_pid
        recorders = {role: subprocess.Popen(
            [self._tool, "record", "--nonblocking", "--threads", "--rate", str(RATE_HZ), "--duration",
             str(int(self.seconds)), "--format", "raw", "--output", str(self.out / f"{role}.txt"), "--pid", str(pid)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for role, pid in processes.items()}
        said = {role: recorder.communicate()[0].strip() for role, recorder in recorders.items()}
        lines = [f"py-spy, {self.seconds:g} s at{self.marker.rstrip(':')}, {RATE_HZ} Hz: per process, its samples of "
                 f"running Python (100 % = one core), the functions most of them were in, and those most of them "
                 f"pass through"]
        for role in recorders:
            raw = self.out / f"{role}.txt"
            samples, top = top_functions(raw) if raw.exists() else (0, [])
            lines.append(f"\n{role} (pid {processes[role]}): {samples / (self.seconds * RATE_HZ):.0%} of a core")
            if not top:
                lines.append(f"  no samples; py-spy said: {said[role]}")
                continue
            lines += ["  in:"] + [f"  {share:6.1%}  {frame}" for frame, share in top_functions(raw, innermost=True)[1]]
            lines += ["  through:"] + [f"  {share:6.1%}  {frame}" for frame, share in top]
        self.summary = "\n".join(lines) + "\n"
        (self.out / "summary.txt").write_text(self.summary)

    def _load_started(self) -> bool:
        with open(self.log_path, errors="replace") as log:
            log.seek(self.offset)
            return self.marker in log.read()

    def finish(self) -> None:
        """Called once the bench has ended: a load it never reached is not waited for."""
        self._bench_ended.set()
        self._thread.join()
