"""The KV pools are allocated without a memset (`KVPool.allocate_layers` takes torch.empty), so a
slot holds whatever was there until it is written. That must never reach an output: here every
pool starts as NaN, which any read of an unwritten slot would spread, and few blocks make
sequences give theirs up and take others back (and, for Gemma-4's sliding layers, window slots)."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.kv_cache import KVPool
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.conftest import drafter_config, gemma4_drafter, random_drafter
from tests.engine.harness import build_engine, hf_greedy
from tests.targets import gemma4_31b_twin, tiny_target

V, B = 96, 4


def _llama_pair():
    """A Llama target and its drafter: one KV geometry a pool."""
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    return tiny_target("llama", layers=4, vocab=V, seed=21).float(), random_drafter(cfg, seed=5, dtype=torch.float32), {}


def _gemma4_pair():
    """Gemma-4's 31B twin: two geometries, keys derived from values in the global layers, and
    the sliding layers in window slots (those settings give them slots: tests/engine/test_gemma4.py)."""
    return gemma4_31b_twin(), gemma4_drafter(block_size=B, seed=11), {"num_blocks": 28, "max_prefill_tokens": 8}


def _fill_nan(pool: KVPool) -> None:
    for group in pool.groups:
        for stored in (group.k, group.v):
            if stored is not None:
                stored.fill_(float("nan"))


@pytest.mark.parametrize("pair", [_llama_pair, _gemma4_pair], ids=["llama", "gemma4-31b-twin"])
def test_greedy_outputs_from_nan_filled_pools_are_the_targets(pair):
    target, drafter, settings = pair()
    engine = build_engine(target, drafter=drafter, **{"num_blocks": 20, "max_num_seqs": 4, **settings})
    if settings:  # the case is there for its window slots
        assert engine.allocator.num_window_slots > 0
    _fill_nan(engine.runner.pool)
    _fill_nan(engine.proposer.pool)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (5, 9, 13, 7)]
    seqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == hf_greedy(target, prompt, 24)
    assert engine.scheduler.num_preemptions > 0  # blocks were given up and written again
