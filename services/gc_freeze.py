"""A serving process's start-up objects kept out of Python's full garbage collections."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now — modules, the models' Python objects, the
    tokenizer, CUDA graphs: several hundred thousand — into the permanent generation, which the
    collector no longer scans. A full collection walks them all: in a serving process it stalled
    every request for 0.24–0.26 s at a time (BENCHMARKS.md, the default pair at concurrency 32).
    Call it once the process's long-lived objects are built; what is allocated later is
    collected as before. vLLM's and LightLLM's serving processes do the same."""
    gc.collect()
    gc.freeze()
