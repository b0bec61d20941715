"""Device time of a call repeated back to back, shared by the GPU benchmarks."""

from __future__ import annotations

import torch


def cuda_ms_per_call(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Milliseconds per call of `fn` launched `repeats` times back to back after `warmup` calls,
    between two CUDA events: a graph replay's device time, or, for eager calls, what a step pays
    when the host is the limit (launches, allocations and Python included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats
