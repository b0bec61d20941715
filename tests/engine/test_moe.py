"""Mixture-of-experts targets end to end: tiny twins of Gemma-4-26B-A4B (experts beside the dense
MLP, on the 31B twin's attention) and of Qwen3-30B-A3B (sparse layers but the first) decode with a
random DFlash drafter exactly as transformers' greedy target-only decoding does. Every test runs
over both target forwards and both round loops (tests/engine/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.conftest import drafter_config, gemma4_drafter, random_drafter
from tests.engine.harness import build_engine, hf_greedy
from tests.targets import gemma4_26b_a4b_twin, qwen3_moe_twin

V, B, KV = 96, 5, 4  # vocabulary, draft block (4 drafts), tokens per KV block


def _qwen3_moe_drafter(seed: int):
    """The Qwen3 DFlash drafter layout at toy size for the 4-layer twin: 2 layers reading 2 target features."""
    cfg = drafter_config(block_size=B, num_target_layers=4, num_hidden_layers=2, layer_types=["full_attention"] * 2,
                         dflash_config={"target_layer_ids": [1, 2]})
    return random_drafter(cfg, seed=seed, dtype=torch.float32)


PAIRS = {
    "gemma-4 26B-A4B": lambda: (gemma4_26b_a4b_twin(seed=3), gemma4_drafter(block_size=B, seed=11)),
    "qwen3-30B-A3B": lambda: (qwen3_moe_twin(seed=3), _qwen3_moe_drafter(seed=11)),
}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request):
    return PAIRS[request.param]()


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, V, (n,), generator=g).tolist()


def test_a_random_drafter_is_lossless_on_a_moe_target(pair):
    """Three prompts at once (one longer than the Gemma twin's sliding window): the target's own
    greedy tokens, every block freed at the end."""
    target, drafter = pair
    engine = build_engine(target, drafter=drafter, kv_block_size=KV)
    prompts = [_tokens(n, seed) for n, seed in ((6, 1), (17, 2), (10, 3))]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for prompt, seq in zip(prompts, done, strict=True):
        assert seq.output_ids == hf_greedy(target, prompt, 20)
    assert engine.allocator.num_free == engine.allocator.num_blocks
