"""The engine's draft forward (the drafter's layers in the target's fused layout, over the paged
pool) against the model code of `dflash_serve.services.models.draft` over a dense context, in float32.

The engine injects context rows and drafts a block per sequence; the reference recomputes the
context from the committed tokens with `context_kv` and runs `draft_logits` over it. Variants
cover non-causal and causal layers, sliding windows shorter than the context, biases and the
newest reference fields (input embedding scale, output multiplier, softcap).
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.kv_cache import AttentionBatch
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models.draft import DraftContext
from tests.conftest import drafter_config, random_drafter
from tests.engine.harness import build_engine
from tests.targets import tiny_target

V, B = 96, 6
VARIANTS = {
    "non_causal": {},
    "sliding_causal_and_biases": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5,
                                  "attention_bias": True},
    "all_causal_newest_fields": {"is_causal": True, "dflash_config": {
        "input_embedding_scale": 1.5, "output_multiplier": 0.75, "final_logit_softcapping": 20.0}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_draft_forward_equals_the_model_code(variant):
    target = tiny_target("qwen3", layers=4, vocab=V, seed=3).float()
    overrides = {"layer_types": ["full_attention"] * 2, **VARIANTS[variant]}
    dflash = {"mask_token_id": V - 1, "target_layer_ids": [0, 2], **overrides.pop("dflash_config", {})}
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2, dflash_config=dflash,
                         **overrides)
    drafter = random_drafter(cfg, seed=5, dtype=torch.float32)
    engine = build_engine(target, drafter=drafter)
    prompts = [[3, 7, 1, 9, 4, 4, 2, 8, 11, 5, 6], [20, 21], [30, 31, 32, 33, 34, 35, 36]]
    seqs = [engine.sequences[engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=8))] for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()  # prefill: the prompts' feature rows go into the drafter's pool
    runner = engine.proposer
    for seq in seqs:
        engine.allocator.grow(seq.block_table, seq.num_cached + B)
    starts = torch.tensor([s.num_cached for s in seqs])
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
    batch = AttentionBatch.for_round(tables, starts, B, engine.allocator.block_size)
    bonus = torch.tensor([s.bonus for s in seqs])
    fused = runner.draft_logits(bonus, starts, batch)

    with torch.no_grad():
        for i, seq in enumerate(seqs):
            n = seq.num_cached
            _, features = runner.target.forward_with_features(torch.tensor([seq.tokens[:n]]))
            positions = torch.arange(n)[None]
            context = DraftContext(drafter.context_kv(features, positions), positions, torch.ones(1, n, dtype=torch.bool))
            expected = drafter.draft_logits(runner.target, bonus[i : i + 1], starts[i : i + 1], context)[0]
            error = ((fused[i] - expected).abs().max() / expected.abs().max()).item()
            assert error <= 1e-5, (seq.request_id, error)
            assert torch.equal(fused[i].argmax(-1), expected.argmax(-1))
    # A round that verifies k drafts asks for those alone: the same rows of the LM head (to rounding:
    # a GEMM over fewer rows may sum in another order, as on an AVX2-only CPU) and the same drafts.
    for k in range(1, B - 1):
        head = runner.draft_logits(bonus, starts, batch, num_drafts=k)
        assert ((head - fused[:, :k]).abs().max() / fused[:, :k].abs().max()).item() <= 1e-6
        runner.request_drafts([s.request_id for s in seqs], bonus, starts, None, batch, num_drafts=k)
        assert torch.equal(runner.receive_drafts(), fused[:, :k].argmax(-1))
