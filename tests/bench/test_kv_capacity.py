"""`spec_engine --capacity-len`: how many long sequences the KV pools hold, with and without the
sliding-window layers' window slots, sized as `assemble_engine` sizes the pools."""

from __future__ import annotations

import torch

from dflash_serve.services.bench.spec_engine import sequences_that_fit
from dflash_serve.services.engine.draft_runner import DraftRunner
from dflash_serve.services.engine.kv_cache import KVPool, window_slots_for
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.models import TargetModel
from tests.conftest import gemma4_drafter
from tests.targets import gemma4_31b_twin

SEQ_LEN, BLOCK, PREFILL = 1000, 16, 64


def test_window_slots_hold_more_long_sequences_and_the_count_is_the_allocators():
    """The 31B twin (sliding layers of window 5, global layers storing values only) with its
    drafter: the budget for exactly n sequences admits n, a byte less admits n - 1."""
    layout = TargetRunner.kv_layout(TargetModel(gemma4_31b_twin()))
    draft_cfg = gemma4_drafter(block_size=4, seed=0).config
    dtype = torch.bfloat16
    blocks = -(-(SEQ_LEN + 2 * draft_cfg.block_size) // BLOCK)  # a sequence's blocks, two rounds' lookahead
    d_layers, d_heads, d_dim = DraftRunner.kv_shape(draft_cfg)
    draft = KVPool.bytes_per_block(d_layers, BLOCK, d_heads, d_dim, dtype)
    every_block = blocks * (KVPool.layout_bytes_per_block(layout, BLOCK, dtype) + draft)
    slots = KVPool.layout_bytes_per_block(layout, BLOCK, dtype, windowed=True)

    def windowed_bytes(n: int) -> int:
        return (n * blocks * (KVPool.layout_bytes_per_block(layout, BLOCK, dtype, windowed=False) + draft)
                + window_slots_for(KVPool.window_of(layout), BLOCK, n, draft_cfg.block_size, PREFILL) * slots)

    for n in (1, 3, 7):
        for windowed, needed in ((False, n * every_block), (True, windowed_bytes(n))):
            fit = [sequences_that_fit(layout, draft_cfg, SEQ_LEN, budget, windowed=windowed, block_size=BLOCK,
                                      max_prefill_tokens=PREFILL, dtype=dtype) for budget in (needed, needed - 1)]
            assert fit == [n, n - 1], (windowed, n, fit)
    budget = 10 * every_block
    assert sequences_that_fit(layout, draft_cfg, SEQ_LEN, budget, windowed=True, block_size=BLOCK,
                              max_prefill_tokens=PREFILL, dtype=dtype) > 10
