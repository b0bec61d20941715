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
