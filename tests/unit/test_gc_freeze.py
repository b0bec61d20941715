"""A serving process's start-up objects leave the collector's full passes; later garbage does not."""

from __future__ import annotations

import gc
import weakref

from dflash_serve.services.gc_freeze import freeze_startup_objects


class _Node:
    pass


def _cycle() -> _Node:
    node = _Node()
    node.self = node
    return node


def test_start_up_objects_are_frozen_and_later_cycles_still_collected():
    garbage_at_start = weakref.ref(_cycle())  # unreachable already: collected, not frozen
    alive = _cycle()
    freeze_startup_objects()
    assert garbage_at_start() is None
    assert gc.get_freeze_count() > 0
    assert not any(obj is alive for obj in gc.get_objects(generation=2))  # out of the oldest generation
    later = weakref.ref(_cycle())
    gc.collect()
    assert later() is None


def test_graph_capture_runs_with_the_collector_off_and_restores_it(monkeypatch):
    """A collection inside a CUDA graph capture can free pinned buffers or events, which
    invalidates the capture: `capture_graph` turns the collector off around it, and back on
    afterwards — also when the capture fails — unless it was off already."""
    import contextlib

    import pytest
    import torch

    from dflash_serve.services.engine.cuda_graphs import capture_graph

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        seen.append(gc.isenabled())
        yield
        seen.append(gc.isenabled())

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with capture_graph(object(), None):
        seen.append(gc.isenabled())
    assert seen == [False, False, False] and gc.isenabled()
    with pytest.raises(RuntimeError), capture_graph(object(), None):
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with capture_graph(object(), None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
