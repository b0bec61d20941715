"""Paged KV: one block allocator shared by the target and drafter pools, and the pools themselves.

Both models index their caches by absolute token position, and a sequence never holds more
positions in one pool than in the other (target: committed tokens + the verify block; drafter:
committed context + the draft block), so one block table per sequence addresses both pools —
and one prefix cache serves both: a cached block holds the target's K/V and the drafter's context
rows of the same committed tokens.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class OutOfKVBlocks(RuntimeError):
    """Not enough free blocks right now; the scheduler waits or preempts."""


def hash_block_tokens(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its tokens and, through `parent` (the key of the
    block before it, b"" for the first), every token before them — so equal keys mean equal
    K/V at equal positions. 128 bits: a collision would serve another prompt's cache."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def window_slots_for(window: int, block_size: int, max_num_seqs: int, lookahead: int, max_prefill_tokens: int) -> int:
    """The window slots `max_num_seqs` sequences can hold at once. Each holds those of the blocks a
    query at its next position can see and of what a step writes past it: two rounds' lookahead
    (a chained round), and its prefill chunk, of which a step's all take `max_prefill_tokens` at
    most (after the step, the chunk's blocks but its last window's give their slots back) — with
    a part-block at each end and of its chunk."""
    per_sequence = -(-(window - 1 + 2 * lookahead) // block_size) + 3
    return max_num_seqs * per_sequence + -(-max_prefill_tokens // block_size)


class BlockAllocator:
    """The blocks of the KV pools, reference-counted, with a prefix cache.

    A block full of committed tokens can be registered under its content key
    (`hash_block_tokens`): sequences whose prompts start with the same tokens then share it (each
    holds a reference), and when the last one lets go it stays cached — counted free, its K/V
    intact — until a block is needed and it is the least recently released. Blocks that were
    never registered are handed out first, so the cache is evicted only under pressure.

    Only whole blocks of committed tokens are ever shared, and a sequence writes only at its
    uncommitted positions, so no write lands in a shared block (the scheduler's part).

    Window slots (`window`: the sliding-window layers' W; `num_window_slots`): the K/V of
    sliding-window layers live in fewer, smaller slots than there are blocks. A block holds a slot
    from when it is taken until no query can see it any more (`leave_window`: it lies wholly
    before the window of the next position of every sequence holding it) or it is freed. A block
    of the prefix cache keeps its slot then, but only until a block needs one (least recently given
    up first), so that a prefix hit can end there: a hit ends only where the window before its end
    still has its slots. `window_map` (a device tensor, block -> slot) is
    what the attention kernels read; the entry of a block without a slot is stale, and only ever
    read at positions no query sees.
    """

    def __init__(self, num_blocks: int, block_size: int, *, window: int | None = None, num_window_slots: int = 0,
                 window_map: torch.Tensor | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        if window is not None and num_window_slots <= 0:
            raise ValueError(f"num_window_slots={num_window_slots}: windowed layers need at least one slot")
        self.num_window_slots = num_window_slots if window is not None else 0
        self._window_map = window_map
        self._slot_of = [-1] * num_blocks
        self._free_slots = list(range(self.num_window_slots - 1, -1, -1))
        # Cached blocks keeping a window slot no query needs (nobody holds them, or they lie before
        # the window of the one sequence holding them), least recently given up first.
        self._reclaimable: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Per block: how many of the sequences holding it have windows past it (its slot is given
        # up when all have); per table (by id): how many of its blocks they counted.
        self._out_of_sight = [0] * num_blocks
        self._window_progress: dict[int, int] = {}
        # LIFO: recently freed blocks are reused first (warm in L2).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._key_of_block: dict[int, bytes] = {}
        self._block_of_key: dict[bytes, int] = {}
        # Registered blocks no sequence holds, least recently released first: evicted in that order.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: never-registered ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_takeable(self) -> int:
        """Blocks a sequence can take now, each with a window slot where windowed layers need one."""
        if self.window is None:
            return self.num_free
        return min(self.num_free, len(self._free_slots) + len(self._reclaimable))

    def window_slot(self, block: int) -> int:
        """The window slot a block holds (-1: none)."""
        return self._slot_of[block]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._key_of_block)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._key_of_block

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_takeable

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` to cover positions 0..num_tokens-1 with blocks of its own; all or nothing."""
        missing = self.blocks_for(num_tokens) - len(table)
        if missing <= 0:
            return
        if missing > self.num_takeable:
            raise OutOfKVBlocks(f"need {missing} KV blocks, {self.num_takeable} free (with window slots)")
        for _ in range(missing):
            table.append(self._take())

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks past what positions 0..num_tokens-1 need."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._drop(table.pop())

    def release(self, table: list[int]) -> None:
        # Last block first: of a released prefix, its tail is evicted first (its head is the part
        # other prompts are likeliest to share).
        counted = self._window_progress.pop(id(table), 0)
        for index, block in enumerate(table):  # slots given up earliest block first
            if index < counted:
                self._out_of_sight[block] -= 1
            if self.window is not None:
                self._give_up_slot_if_unseen(block, holders=self._refs[block] - 1)
        for block in reversed(table):
            self._drop(block)
        table.clear()

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first — with window slots,
        ending where the window before its end still holds its slots — each with a reference
        taken for the caller (give them back with `release`)."""
        blocks = []
        for key in keys:
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
        if self.window is not None:
            while blocks and any(self._slot_of[b] < 0
                                 for b in blocks[self._first_in_window(len(blocks) * self.block_size):]):
                blocks.pop()
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._reclaimable.pop(block, None)
            self._refs[block] += 1
        return blocks

    def _first_in_window(self, position: int) -> int:
        """The first block holding a key a query at `position` (or later) can see."""
        return max(0, position - self.window + 1) // self.block_size

    def leave_window(self, table: list[int], num_cached: int) -> None:
        """A sequence's committed positions reached `num_cached`: its blocks wholly before the
        window of that position are out of its sight, and a block out of the sight of every
        sequence holding it gives up its window slot — at once, or, in the prefix cache, when a
        block needs one."""
        if self.window is None:
            return
        end = self._first_in_window(num_cached)
        looked_at = self._window_progress.get(id(table), 0)
        if end <= looked_at:
            return
        self._window_progress[id(table)] = end
        for block in table[looked_at:end]:  # the earliest first: a prefix hit can end after it the least
            self._out_of_sight[block] += 1
            self._give_up_slot_if_unseen(block)

    def _give_up_slot_if_unseen(self, block: int, holders: int | None = None) -> None:
        """If no sequence holding `block` (`holders` of them; default: all now) can see it: a
        cached block's slot may be taken when a block needs one (a prefix hit may still end after
        it), another's is free."""
        holders = self._refs[block] if holders is None else holders
        if self._out_of_sight[block] < holders or self._slot_of[block] < 0 or block in self._reclaimable:
            return
        if block in self._key_of_block:
            self._reclaimable[block] = None
        else:
            self._free_slots.append(self._slot_of[block])
            self._slot_of[block] = -1

    def register(self, block: int, key: bytes) -> bool:
        """Offer a held block, full of committed tokens whose content key is `key`, to the cache.
        False when the key is cached already (in another block: this one stays private) or the
        block is registered (under this key: it came from the cache)."""
        if key in self._block_of_key or block in self._key_of_block:
            return False
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held: only a sequence's own blocks can be registered")
        self._key_of_block[block] = key
        self._block_of_key[key] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every key (the caches' contents no longer match them, e.g. a new drafter's
        context pool is empty); blocks nobody holds become plain free blocks."""
        self._key_of_block.clear()
        self._block_of_key.clear()
        for block in self._reclaimable:  # no hit can end at them now
            self._free_slots.append(self._slot_of[block])
            self._slot_of[block] = -1
        self._reclaimable.clear()
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently released cached block
            block, _ = self._evictable.popitem(last=False)
            self._reclaimable.pop(block, None)
            del self._block_of_key[self._key_of_block.pop(block)]
        self._refs[block] = 1
        if self.window is not None and self._slot_of[block] < 0:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:  # the slot no query needs given up longest ago
                owner, _ = self._reclaimable.popitem(last=False)
                slot, self._slot_of[owner] = self._slot_of[owner], -1
            self._slot_of[block] = slot
            if self._window_map is not None:
                self._window_map[block] = slot  # stream-ordered: rounds already queued read the old entry
        return block

    def _drop(self, block: int) -> None:
        refs = self._refs[block] - 1
        if refs < 0:
            raise RuntimeError(f"KV block {block} released more often than taken")
        self._refs[block] = refs
        if refs:
            return
        if block in self._key_of_block:
            self._evictable[block] = None
            if self._slot_of[block] >= 0:
                self._reclaimable[block] = None
        else:
            self._free.append(block)
            if self._slot_of[block] >= 0:
                self._free_slots.append(self._slot_of[block])
                self._slot_of[block] = -1


@dataclass(frozen=True)
class LayerKV:
    """How one attention layer keeps its keys and values: its KV heads and head size; whether it
    stores its values only, its keys being derived from them as they are read (Gemma-4's
    `attention_k_eq_v`: one projection gives both); the earlier layer whose K/V it attends
    over (Gemma-4's `num_kv_shared_layers`: it stores none); its sliding window, if any."""

    num_kv_heads: int
    head_dim: int
    reads_layer: int | None = None
    keys_from_values: bool = False
    window: int | None = None


@dataclass
class KVGroup:
    """The stored K and V of the layers of one geometry: [len(layers), num_blocks, block_size,
    num_kv_heads, head_dim] each; no K for layers whose keys are derived from their values. A
    windowed group (sliding-window layers in window slots) has a window slot where others have a
    block: [len(layers), num_window_slots, …]."""

    layers: tuple[int, ...]
    k: torch.Tensor | None
    v: torch.Tensor
    windowed: bool = False


class KVPool:
    """K and V of every layer of one model over one set of blocks.

    Layers are grouped by geometry (KV heads, head size, keys stored or derived): a model whose
    layers all have one (Llama, Qwen, the drafter) has one group; Gemma-4's sliding and global
    layers have two. Every group is addressed by the same block ids, so one block table per
    sequence, one prefix cache and one preemption serve them all. A layer that reads another's K/V
    (`LayerKV.reads_layer`) stores none; one whose keys are derived from its values stores V alone.

    With window slots (`num_window_slots`), sliding-window layers keep their K/V in a group of
    their own indexed by window slot, not block (`BlockAllocator`'s window slots): `window_map`
    maps a block to its slot, and `window_batch` a forward's batch to the slots.
    """

    def __init__(self, layout: Sequence[LayerKV], groups: Sequence[KVGroup], num_blocks: int,
                 window_map: torch.Tensor | None = None):
        self.layout = tuple(layout)
        self.groups = tuple(groups)
        self.num_blocks = num_blocks
        self.window_map = window_map  # int32 [num_blocks] on the device: block -> window slot
        stored = {layer: (group, row) for group in self.groups for row, layer in enumerate(group.layers)}
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._windowed: list[bool] = []
        for index, spec in enumerate(self.layout):
            owner = index if spec.reads_layer is None else spec.reads_layer
            if owner not in stored or owner > index:
                raise ValueError(f"layer {index} reads the K/V of layer {owner}, which stores none before it")
            group, row = stored[owner]
            if group.v.shape[-2:] != (spec.num_kv_heads, spec.head_dim) or (group.k is None) != spec.keys_from_values:
                raise ValueError(f"layer {index} has {spec.num_kv_heads} KV heads of {spec.head_dim}, "
                                 f"but the K/V it reads has {tuple(group.v.shape[-2:])}"
                                 f"{' and no keys' if group.k is None else ''}")
            self._caches.append((None if group.k is None else group.k[row], group.v[row]))
            self._windowed.append(group.windowed)

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVPool:
        """A pool of `num_layers` layers of one geometry."""
        return cls.allocate_layers([LayerKV(num_kv_heads, head_dim)] * num_layers, num_blocks, block_size, dtype,
                                   device)

    @classmethod
    def allocate_layers(cls, layout: Sequence[LayerKV], num_blocks: int, block_size: int, dtype: torch.dtype,
                        device: torch.device | str, *, num_window_slots: int | None = None) -> KVPool:
        """`num_window_slots`: sliding-window layers in that many window slots (None: in blocks)."""
        groups = []
        for (heads, dim, derived_keys, windowed), layers in _stored_by_geometry(layout, num_window_slots).items():
            shape = (len(layers), num_window_slots if windowed else num_blocks, block_size, heads, dim)
            # Not zeroed: a slot is always written before it is read (tests/engine/test_kv_pool_uninitialized.py
            # starts every pool as NaN), and zeroing a GPU's worth of cache is work no request needs.
            k = None if derived_keys else torch.empty(shape, dtype=dtype, device=device)
            groups.append(KVGroup(tuple(layers), k, torch.empty(shape, dtype=dtype, device=device), windowed))
        window_map = None
        if any(group.windowed for group in groups):
            window_map = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        return cls(layout, groups, num_blocks, window_map)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return KVPool.layout_bytes_per_block([LayerKV(num_kv_heads, head_dim)] * num_layers, block_size, dtype)

    @staticmethod
    def layout_bytes_per_block(layout: Sequence[LayerKV], block_size: int, dtype: torch.dtype, *,
                               windowed: bool | None = None) -> int:
        """What one block holds in every group (layers reading another's K/V add nothing, layers
        whose keys are derived from their values add their values). `windowed`: with window
        slots, the groups a block holds (False) or those a window slot holds (True)."""
        element = torch.empty((), dtype=dtype).element_size()
        by_geometry = _stored_by_geometry(layout, None if windowed is None else 1)
        return sum((1 if derived_keys else 2) * len(layers) * block_size * heads * dim * element
                   for (heads, dim, derived_keys, in_slots), layers in by_geometry.items()
                   if windowed is None or in_slots == windowed)

    @staticmethod
    def window_of(layout: Sequence[LayerKV]) -> int | None:
        """The widest sliding window of the layers (what window slots must cover), or None."""
        return max((spec.window for spec in layout if spec.window is not None), default=None)

    def windowed(self, index: int) -> bool:
        """Whether layer `index`'s K/V (its own, or the layer's it reads) live in window slots."""
        return self._windowed[index]

    def window_batch(self, batch: AttentionBatch) -> AttentionBatch:
        """`batch` addressing window slots instead of blocks (on the device: CUDA-graph safe)."""
        block_size = self.groups[0].v.shape[2]
        tables = self.window_map[batch.block_tables.long()]
        slots = self.window_map[batch.slot_mapping // block_size].long() * block_size + batch.slot_mapping % block_size
        return AttentionBatch(block_tables=tables, seq_lens=batch.seq_lens, query_start=batch.query_start,
                              slot_mapping=slots, max_query_len=batch.max_query_len)

    @property
    def k(self) -> torch.Tensor:
        """[num_layers, num_blocks, block_size, num_kv_heads, head_dim]: a pool of one group only."""
        return self._single_group().k

    @property
    def v(self) -> torch.Tensor:
        return self._single_group().v

    def _single_group(self) -> KVGroup:
        group = self.groups[0]
        if len(self.groups) != 1 or len(group.layers) != len(self.layout) or group.k is None:
            raise ValueError("this KV pool has layers of several geometries (or shared K/V): use layer(i) or groups")
        return group

    def layer(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layer `index`'s K and V caches [num_blocks, block_size, num_kv_heads, head_dim] (another
        layer's, when it reads theirs); K None when its keys are derived from its values."""
        return self._caches[index]

    def stores(self, index: int) -> bool:
        """Whether layer `index` writes K/V of its own (not when it reads an earlier layer's)."""
        return self.layout[index].reads_layer is None

    def tensors(self) -> list[torch.Tensor]:
        """Every stored K and V tensor, group by group."""
        return [t for group in self.groups for t in (group.k, group.v) if t is not None]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values [T, num_kv_heads, head_dim] at flat slots [T] (the values only,
        where the keys are derived from them)."""
        k_cache, v_cache = self.layer(layer)
        if k_cache is not None:
            k_cache.view(-1, *k_cache.shape[-2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[-2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def _stored_by_geometry(layout: Sequence[LayerKV], num_window_slots: int | None
                        ) -> dict[tuple[int, int, bool, bool], list[int]]:
    """(KV heads, head size, keys derived, in window slots) -> the layers of that geometry that
    store K/V, in order; sliding-window layers are in window slots when there are any."""
    groups: dict[tuple[int, int, bool, bool], list[int]] = {}
    for index, spec in enumerate(layout):
        if spec.reads_layer is None:
            in_slots = bool(num_window_slots) and spec.window is not None
            groups.setdefault((spec.num_kv_heads, spec.head_dim, spec.keys_from_values, in_slots), []).append(index)
    return groups


@dataclass
class AttentionBatch:
    """One forward's view of the paged cache (the layout dflash_serve.kernels.paged_attention takes).

    Sequence i's new tokens are rows query_start[i]:query_start[i+1] of the packed batch, at the
    last q_len_i of its seq_lens[i] positions; slot_mapping says where their K/V go.
    """

    block_tables: torch.Tensor  # int32 [N, max_blocks]
    seq_lens: torch.Tensor  # int32 [N]
    query_start: torch.Tensor  # int32 [N + 1]
    slot_mapping: torch.Tensor  # int64 [total_q]
    max_query_len: int

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], query_lens: list[int], block_size: int,
              device: torch.device | str) -> AttentionBatch:
        """Sequences whose new tokens sit at positions starts[i] .. starts[i]+query_lens[i]-1."""
        width = max((len(t) for t in tables), default=0) or 1
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        lens = torch.tensor(query_lens, dtype=torch.int64)
        query_start = torch.zeros(len(tables) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(lens, 0)
        # positions of every new token, then their flat cache slots
        seq_index = torch.repeat_interleave(torch.arange(len(tables)), lens)
        positions = starts_t[seq_index] + torch.arange(int(lens.sum())) - query_start[:-1].long()[seq_index]
        slots = table[seq_index, positions // block_size].long() * block_size + positions % block_size
        return cls(
            block_tables=table.to(device),
            seq_lens=(starts_t + lens).to(torch.int32).to(device),
            query_start=query_start.to(device),
            slot_mapping=slots.to(device),
            max_query_len=max(query_lens, default=0),
        )

    @classmethod
    def for_round(cls, block_tables: torch.Tensor, starts: torch.Tensor, block: int, page: int,
                  query_start: torch.Tensor | None = None) -> AttentionBatch:
        """A round's batch — `block` new tokens per sequence from `starts` [N] — computed on the
        device from device tensors, so a round can be queued before the host knows its starts."""
        n = starts.shape[0]
        positions = starts[:, None] + torch.arange(block, device=starts.device)
        rows = torch.arange(n, device=starts.device)[:, None].expand(n, block)
        slots = block_tables[rows, positions // page].long() * page + positions % page
        if query_start is None:
            query_start = torch.arange(0, (n + 1) * block, block, dtype=torch.int32, device=starts.device)
        return cls(block_tables=block_tables, seq_lens=(starts + block).to(torch.int32), query_start=query_start,
                   slot_mapping=slots.flatten(), max_query_len=block)
