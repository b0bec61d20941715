"""The draft model against the independent oracle (tests/oracle), and the attention rules of spec §1.5."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_serve.services.models import DFlashDraftConfig, DraftContext, TargetModel
from tests.conftest import drafter_config, random_drafter
from tests.oracle.dflash_reference import reference_draft_logits
from tests.targets import tiny_target

H = 32

# name -> (target family, target softcap, drafter config overrides)
CONFIGS = {
    "qwen3_5xfull_b16": ("qwen3", None, {}),
    "llama_b10": ("llama", None, {"block_size": 10, "num_hidden_layers": 5}),
    "gemma_4swa_1full_softcap_F6": (
        "gemma3",
        30.0,
        {
            "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
            "sliding_window": 6,
            "dflash_config": {"target_layer_ids": [1, 2, 3, 4, 5, 6]},  # F = 6 != L = 5
        },
    ),
    "yarn_rope": (
        "qwen3",
        None,
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
         "block_size": 8},
    ),
    "newest_reference_fields": (
        "qwen3",
        None,
        {"is_causal": True, "dflash_config": {"input_embedding_scale": 1.5, "output_multiplier": 0.75,
                                              "final_logit_softcapping": 20.0, "block_size": 6}},
    ),
}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _contexts(target: TargetModel, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target features for each prompt, padded into one batch -> (features, positions, valid)."""
    feats = [target.forward_with_features(p[None])[1][0] for p in prompts]
    longest = max(f.shape[0] for f in feats)
    features = torch.zeros(len(feats), longest, feats[0].shape[-1], dtype=feats[0].dtype)
    valid = torch.zeros(len(feats), longest, dtype=torch.bool)
    for i, f in enumerate(feats):
        features[i, : f.shape[0]] = f
        valid[i, : f.shape[0]] = True
    positions = torch.arange(longest).expand(len(feats), -1).clone()
    return features, positions, valid


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_draft_logits_match_the_spec_oracle(name):
    family, softcap, overrides = CONFIGS[name]
    cfg = drafter_config(**overrides)
    drafter = random_drafter(cfg, seed=hash(name) % 1000)
    target = TargetModel(tiny_target(family, softcap=softcap), drafter.config.target_layer_ids)
    drafter.check_target(target)

    # Three sequences of different lengths in one batch (padding must not leak into attention).
    prompts = [torch.randint(0, 90, (n,)) for n in (21, 9, 14)]
    features, positions, valid = _contexts(target, prompts)
    context = DraftContext(drafter.context_kv(features, positions), positions, valid)
    bonus = torch.tensor([7, 11, 3])
    start = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits = drafter.draft_logits(target, bonus, start, context)

    cfg_obj = drafter.config
    assert logits.shape == (3, cfg_obj.block_size - 1, 96)
    weights = {k: v for k, v in drafter.state_dict().items()}
    if cfg_obj.input_embedding_scale is not None:
        embed_scale = cfg_obj.input_embedding_scale
    else:
        embed_scale = math.sqrt(H) if family.startswith("gemma") else 1.0
    for i, prompt in enumerate(prompts):
        expected = reference_draft_logits(
            cfg,
            weights,
            embed_weight=target.input_embeddings.weight.detach(),
            embed_scale=embed_scale,
            lm_head_weight=target.lm_head.weight.detach(),
            logit_softcap=cfg_obj.final_logit_softcapping or softcap,
            output_multiplier=cfg_obj.output_multiplier,
            context_features=features[i, : len(prompt)],
            bonus_token=int(bonus[i]),
            start=len(prompt),
        )
        assert _relative_error(logits[i], expected) <= 1e-6, name


def _window_probe(cfg: dict, changed_positions: list[int], *, start: int = 20) -> bool:
    """Does changing the context features at `changed_positions` change the draft logits?"""
    drafter = random_drafter(cfg, seed=3)
    target = TargetModel(tiny_target("qwen3"), drafter.config.target_layer_ids)
    features = torch.randn(1, start, drafter.config.num_features * H, dtype=torch.float64)
    positions = torch.arange(start)[None]
    valid = torch.ones(1, start, dtype=torch.bool)

    def logits(feats):
        ctx = DraftContext(drafter.context_kv(feats, positions), positions, valid)
        return drafter.draft_logits(target, torch.tensor([5]), torch.tensor([start]), ctx)

    changed = features.clone()
    changed[0, changed_positions] += 3.0
    with torch.no_grad():
        return not torch.equal(logits(features), logits(changed))


@pytest.mark.parametrize("causal", [None, True, False])
def test_sliding_layers_ignore_context_beyond_their_window(causal):
    window, start = 6, 20
    overrides = {"layer_types": ["sliding_attention"] * 2, "num_hidden_layers": 2, "sliding_window": window,
                 "block_size": 4, "dflash_config": {"target_layer_ids": [1, 3]}}
    if causal is not None:
        overrides["dflash_config"]["causal"] = causal
    cfg = drafter_config(**overrides)
    # The earliest query (the bonus token at `start`) sees keys at positions > start - window.
    assert not _window_probe(cfg, list(range(0, start - window + 1)), start=start)
    assert _window_probe(cfg, [start - window + 1], start=start)


def test_full_layers_see_the_whole_context():
    cfg = drafter_config(num_hidden_layers=2, layer_types=["full_attention"] * 2, block_size=4,
                         dflash_config={"target_layer_ids": [1, 3]})
    assert _window_probe(cfg, [0])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, [False, False, False, False, True]),  # causal iff sliding
        ({"dflash_config": {"causal": False}}, [False] * 5),
        ({"dflash_config": {"causal": True}}, [True] * 5),
        ({"is_causal": False, "dflash_config": {"causal": True}}, [False] * 5),  # is_causal wins
    ],
)
def test_causality_resolution_order(overrides, expected):
    base = {"layer_types": ["full_attention"] * 4 + ["sliding_attention"], "sliding_window": 8}
    cfg = DFlashDraftConfig.from_dict(drafter_config(**base, **overrides))
    assert [cfg.layer_is_causal(i) for i in range(5)] == expected


@pytest.mark.parametrize("causal", [True, False])
def test_block_slots_see_later_slots_only_when_non_causal(causal):
    drafter = random_drafter(drafter_config(block_size=6, is_causal=causal), seed=5)
    ctx_len = 7
    features = torch.randn(1, ctx_len, drafter.config.num_features * H, dtype=torch.float64)
    positions = torch.arange(ctx_len)[None]
    context = DraftContext(drafter.context_kv(features, positions), positions, torch.ones(1, ctx_len, dtype=torch.bool))
    embeds = torch.randn(1, 6, H, dtype=torch.float64)
    block_positions = (ctx_len + torch.arange(6))[None]
    with torch.no_grad():
        before = drafter(embeds, block_positions, context)
        embeds[0, 4] += 1.0
        after = drafter(embeds, block_positions, context)
    assert torch.equal(before[0, :4], after[0, :4]) == causal
    assert not torch.equal(before[0, 4:], after[0, 4:])


def test_bf16_forward_is_finite_and_close_to_float64():
    cfg = drafter_config()
    exact = random_drafter(cfg, seed=9)
    half = random_drafter(cfg, seed=9, dtype=torch.bfloat16)
    target = TargetModel(tiny_target("qwen3"), exact.config.target_layer_ids)
    features = torch.randn(2, 12, exact.config.num_features * H, dtype=torch.float64)
    positions = torch.arange(12).expand(2, -1)
    valid = torch.ones(2, 12, dtype=torch.bool)
    out = {}
    with torch.no_grad():
        for key, model in (("f64", exact), ("bf16", half)):
            ctx = DraftContext(model.context_kv(features, positions), positions, valid)
            out[key] = model.draft_logits(target, torch.tensor([1, 2]), torch.tensor([12, 12]), ctx)
    assert torch.isfinite(out["bf16"]).all()
    assert _relative_error(out["bf16"].double(), out["f64"]) < 0.1
