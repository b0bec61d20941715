"""The default target_layer_ids rule (spec §1.2) and the drafter's own RoPE against transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_serve.services.models import DFlashDraftConfig, default_target_layer_ids
from dflash_serve.services.models.rope import rope_inverse_frequencies
from tests.conftest import drafter_config


@pytest.mark.parametrize(
    "target_layers, draft_layers, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-4B/8B
        (32, 5, [1, 8, 15, 22, 29]),  # LLaMA-3.1-8B
        (64, 5, [1, 16, 31, 46, 61]),  # Qwen3.5-27B
        (30, 6, [1, 6, 11, 17, 22, 27]),  # gemma-4-26B-A4B
        (60, 6, [1, 12, 23, 35, 46, 57]),  # gemma-4-31B
        (36, 1, [18]),
    ],
)
def test_default_layer_ids_reproduce_the_spec_examples(target_layers, draft_layers, expected):
    assert default_target_layer_ids(target_layers, draft_layers) == expected


def test_config_without_layer_ids_uses_the_default_rule():
    raw = drafter_config(num_target_layers=36)
    del raw["dflash_config"]["target_layer_ids"]
    assert DFlashDraftConfig.from_dict(raw).target_layer_ids == (1, 9, 17, 25, 33)


ROPE_CASES = {
    "default": {},
    "linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
    "yarn_mscale": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                     "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}},
    "rope_parameters": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0}},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_tables_equal_transformers(case):
    raw = drafter_config(head_dim=128, **ROPE_CASES[case])
    ours, our_scale = rope_inverse_frequencies(DFlashDraftConfig.from_dict(raw).rope, 128)
    fields = {k: raw[k] for k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings") if k in raw}
    hf_cfg = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=128, **fields)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        theirs, their_scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale, rel=1e-12)
