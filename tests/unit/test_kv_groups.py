"""A KV pool of several layer geometries: one group per (KV heads, head size), all over the same
block ids; layers that read an earlier layer's K/V store none."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.kv_cache import BlockAllocator, KVPool, LayerKV, OutOfKVBlocks, hash_block_tokens

SLIDING, GLOBAL = LayerKV(16, 256), LayerKV(4, 512)  # gemma-4-31B's two geometries


def test_layers_are_grouped_by_geometry_over_the_same_blocks():
    layout = [SLIDING, SLIDING, GLOBAL, SLIDING, GLOBAL]
    pool = KVPool.allocate_layers([LayerKV(s.num_kv_heads // 4, s.head_dim // 32) for s in layout], 7, 4,
                                  torch.float32, "cpu")
    assert [g.layers for g in pool.groups] == [(0, 1, 3), (2, 4)]
    assert [tuple(g.k.shape) for g in pool.groups] == [(3, 7, 4, 4, 8), (2, 7, 4, 1, 16)]
    assert pool.num_blocks == 7
    k3, v3 = pool.layer(3)
    assert k3.data_ptr() == pool.groups[0].k[2].data_ptr() and v3.data_ptr() == pool.groups[0].v[2].data_ptr()
    with pytest.raises(ValueError, match="several geometries"):
        pool.k  # noqa: B018 - one tensor for all layers exists only for a pool of one geometry
    # A write lands in the layer's own group, at the flat slot of (block, offset), and nowhere else
    # (the pool is not zeroed when allocated: it is filled here to see what the write touched).
    for group in pool.groups:
        group.k.fill_(-1.0)
        group.v.fill_(-1.0)
    pool.write(4, torch.tensor([9]), torch.ones(1, 1, 16), torch.full((1, 1, 16), 2.0))
    assert torch.equal(pool.groups[1].k[1, 2, 1], torch.ones(1, 16))
    assert torch.equal(pool.groups[1].v[1, 2, 1], torch.full((1, 16), 2.0))
    assert (pool.groups[0].k == -1).all() and (pool.groups[1].k[0] == -1).all()
    assert (pool.groups[1].k != -1).sum() == 16 and (pool.groups[1].v != -1).sum() == 16


def test_bytes_per_block_count_each_groups_own_geometry():
    assert KVPool.layout_bytes_per_block([SLIDING] * 50 + [GLOBAL] * 10, 16, torch.bfloat16) == (
        2 * 16 * 2 * (50 * 16 * 256 + 10 * 4 * 512))
    assert KVPool.layout_bytes_per_block([SLIDING] * 3, 16, torch.bfloat16) == KVPool.bytes_per_block(
        3, 16, 16, 256, torch.bfloat16)


def test_a_layer_reading_an_earlier_layers_kv_allocates_none_and_sees_its_cache():
    sliding, full = LayerKV(2, 8), LayerKV(1, 16)
    layout = [sliding, full, sliding, LayerKV(2, 8, reads_layer=2), LayerKV(1, 16, reads_layer=1)]
    pool = KVPool.allocate_layers(layout, 5, 4, torch.float32, "cpu")
    assert [g.layers for g in pool.groups] == [(0, 2), (1,)]
    assert not pool.stores(3) and pool.stores(2)
    assert pool.layer(3)[0].data_ptr() == pool.layer(2)[0].data_ptr()
    assert pool.layer(4)[1].data_ptr() == pool.layer(1)[1].data_ptr()
    assert KVPool.layout_bytes_per_block(layout, 4, torch.float32) == 2 * 4 * 4 * (2 * 2 * 8 + 16)


def test_a_layer_whose_keys_are_derived_from_its_values_stores_its_values_alone():
    """gemma-4-31B's global layers (attention_k_eq_v): one tensor per layer, not two."""
    sliding, k_eq_v = LayerKV(2, 8), LayerKV(1, 16, keys_from_values=True)
    layout = [sliding, k_eq_v, sliding, k_eq_v]
    pool = KVPool.allocate_layers(layout, 3, 4, torch.float32, "cpu")
    assert [(g.layers, g.k is None) for g in pool.groups] == [((0, 2), False), ((1, 3), True)]
    assert pool.layer(3)[0] is None and pool.layer(3)[1].shape == (3, 4, 1, 16)
    assert len(pool.tensors()) == 3
    assert KVPool.layout_bytes_per_block(layout, 4, torch.float32) == 4 * 4 * 2 * (2 * 2 * 8 + 16)
    pool.write(3, torch.tensor([5]), torch.full((1, 1, 16), 9.0), torch.full((1, 1, 16), 2.0))
    assert torch.equal(pool.groups[1].v[1, 1, 1], torch.full((1, 16), 2.0))
    with pytest.raises(ValueError, match="several geometries"):
        pool.v  # noqa: B018


@pytest.mark.parametrize("layout, message", [
    ([LayerKV(2, 8, reads_layer=1), LayerKV(2, 8)], "reads the K/V of layer 1, which stores none before it"),
    ([LayerKV(2, 8), LayerKV(1, 16, reads_layer=0)], "has 1 KV heads of 16, but the K/V it reads has"),
])
def test_a_layout_reading_kv_that_is_not_there_is_refused(layout, message):
    with pytest.raises(ValueError, match=message):
        KVPool.allocate_layers(layout, 2, 4, torch.float32, "cpu")


def _window_allocator(num_blocks=12, slots=4, window=5, block_size=4):
    window_map = torch.full((num_blocks,), -7, dtype=torch.int32)
    allocator = BlockAllocator(num_blocks, block_size, window=window, num_window_slots=slots, window_map=window_map)
    return allocator, window_map


def test_blocks_take_window_slots_and_give_them_back_once_no_query_sees_them():
    alloc, window_map = _window_allocator()
    table = []
    alloc.grow(table, 12)  # 3 blocks, 3 slots
    assert [alloc.window_slot(b) for b in table] == [0, 1, 2]
    assert window_map[table].tolist() == [0, 1, 2] and alloc.num_takeable == 1
    assert not alloc.can_hold(table, 20) and alloc.can_hold(table, 16)  # slots, not blocks, run out
    # Position 12's window (5) starts at 8: blocks 0 and 1 (positions 0-7) are out of sight.
    alloc.leave_window(table, 12)
    assert [alloc.window_slot(b) for b in table] == [-1, -1, 2] and alloc.num_takeable == 3
    alloc.grow(table, 20)  # 2 more blocks take the freed slots
    assert sorted(alloc.window_slot(b) for b in table[3:]) == [0, 1]
    with pytest.raises(OutOfKVBlocks, match="window slots"):
        alloc.grow(table, 28)
    alloc.release(table)
    assert alloc.num_free == 12 and alloc.num_takeable == 4


def test_a_shared_block_keeps_its_slot_and_a_cached_one_keeps_it_until_a_block_needs_it():
    alloc, _ = _window_allocator(slots=5)
    keys = [hash_block_tokens(b"", [1, 2, 3, 4]), hash_block_tokens(b"x", [5, 6, 7, 8])]
    first = []
    alloc.grow(first, 8)
    for block, key in zip(first, keys, strict=True):
        alloc.register(block, key)
    second = alloc.cached_prefix(keys)  # both blocks, shared now
    assert second == first
    alloc.leave_window(first, 12)  # out of first's window, but second holds them
    assert all(alloc.window_slot(b) >= 0 for b in first)
    alloc.release(second)
    alloc.leave_window(first, 12)  # cached: their slots stay until a block needs one
    assert all(alloc.window_slot(b) >= 0 for b in first) and alloc.num_takeable == 5
    other = []
    alloc.grow(other, 16)  # 3 free slots, then the least recently given up cached block's
    assert alloc.window_slot(first[0]) == -1 and alloc.window_slot(first[1]) >= 0
    # A hit ends only where the window before its end holds its slots: 2 blocks (window from
    # position 4: block 1) still can, and without block 1's slot none can.
    hit = alloc.cached_prefix(keys)
    assert hit == first
    alloc.release(hit)
    alloc.leave_window(first, 12)
    alloc.grow(other, 20)  # takes block 1's slot: no hit can end after block 0 or 1 now
    assert alloc.window_slot(first[1]) == -1
    assert alloc.cached_prefix(keys) == []


def test_forgetting_the_prefix_cache_frees_the_slots_only_it_kept():
    alloc, _ = _window_allocator(slots=3)
    table = []
    alloc.grow(table, 8)
    alloc.register(table[0], hash_block_tokens(b"", [1, 2, 3, 4]))
    alloc.leave_window(table, 12)  # block 0 (cached) keeps its slot, block 1 gives it back
    assert alloc.window_slot(table[0]) >= 0 and alloc.window_slot(table[1]) == -1
    alloc.reset_prefix_cache()
    assert alloc.window_slot(table[0]) == -1 and alloc.num_takeable == 3
