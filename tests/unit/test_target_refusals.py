"""Targets that neither forward computes as transformers does are refused when the engine is
built, with the config field that makes them so and what would serve them — never a
transformers attribute error, never silently wrong tokens."""

from __future__ import annotations

import re

import pytest
import torch

from dflash_serve.services.engine.kv_cache import KVPool, LayerKV
from dflash_serve.services.engine.loader import target_runner
from dflash_serve.services.engine.target_runner import TargetRunner, unservable_reason
from dflash_serve.services.models import TargetModel

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


def _gemma2_softcapped():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**TINY, attn_logit_softcapping=50.0))


def _gemma4_bidirectional():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return Gemma4ForCausalLM(Gemma4TextConfig(**TINY, global_head_dim=8, hidden_size_per_layer_input=0,
                                              use_bidirectional_attention="all"))


def _qwen3_next_linear_attention():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(
        **TINY, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"]))


def _gpt_oss_sinks():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(**TINY, num_local_experts=2, num_experts_per_tok=1))


REFUSED = {
    "attn_logit_softcapping=50.0: the paged attention kernel has no softcap": _gemma2_softcapped,
    "use_bidirectional_attention='all': text tokens attend to later ones": _gemma4_bidirectional,
    "layer_types has linear_attention: only full and sliding-window attention": _qwen3_next_linear_attention,
    "attention sinks (a learnt `sinks` logit per head, gpt-oss)": _gpt_oss_sinks,
}


@pytest.mark.parametrize("reason", list(REFUSED))
@pytest.mark.parametrize("impl", ["auto", "fused", "transformers"])
def test_a_target_no_forward_computes_is_refused_naming_its_config_field(reason, impl):
    target = TargetModel(REFUSED[reason]().float().eval())
    assert reason in unservable_reason(target)
    pool = KVPool.allocate(target.num_layers, 4, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="cannot be served: " + re.escape(reason)):
        target_runner(impl, target, pool, max_positions=64)
    with pytest.raises(ValueError, match="cannot be served"):
        TargetRunner(target, pool, max_positions=64)


def test_gemma4_layers_of_their_own_kv_geometry_are_no_refusal():
    """What the issue found refused with transformers' AmbiguousGlobalPerLayerAttributeError:
    global layers of another head size and KV-head count, read from each layer's own config."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**TINY, "head_dim": 32}, global_head_dim=64,
                                               num_global_key_value_heads=1, attention_k_eq_v=True,
                                               hidden_size_per_layer_input=0))
    target = TargetModel(model.float().eval())
    assert unservable_reason(target) is None
    layout = TargetRunner.kv_layout(target)
    assert layout == [LayerKV(2, 32, window=512), LayerKV(1, 64, keys_from_values=True)]
    # The global layer's values are stored once: its keys are derived from them.
    assert KVPool.layout_bytes_per_block(layout, 4, torch.float32) == 4 * (2 * 2 * 32 + 64) * 4


@pytest.mark.parametrize("twin", ["gemma4_26b_a4b_twin", "qwen3_moe_twin"])
def test_moe_targets_take_the_fused_forward_on_the_cpu_and_on_cuda(twin, monkeypatch):
    """Checked against transformers on the CPU (tests/unit/test_fused_moe.py) and in bf16 on a GPU
    (tests/gpu/test_engine_cuda.py): `auto` takes the fused forward on both."""
    import tests.targets as targets
    from dflash_serve.services.engine.fused_target import FusedTargetRunner, fused_unsupported_reason
    from dflash_serve.services.engine import loader

    target = TargetModel(getattr(targets, twin)())
    pool = KVPool.allocate_layers(TargetRunner.kv_layout(target), 8, 4, torch.float32, "cpu")
    assert isinstance(loader.target_runner("auto", target, pool, max_positions=64), FusedTargetRunner)
    monkeypatch.setattr(TargetModel, "device", property(lambda self: torch.device("cuda")))
    assert fused_unsupported_reason(target) is None
    # Which runner each choice builds (building one would touch CUDA).
    monkeypatch.setattr(loader, "FusedTargetRunner", lambda *args, **kwargs: "fused")
    monkeypatch.setattr(loader, "TargetRunner", lambda *args, **kwargs: "transformers")
    assert loader.target_runner("auto", target, pool, max_positions=64) == "fused"
    assert loader.target_runner("fused", target, pool, max_positions=64) == "fused"
    assert loader.target_runner("transformers", target, pool, max_positions=64) == "transformers"
