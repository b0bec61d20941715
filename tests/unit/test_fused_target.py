"""The fused target forward against transformers' own layer code, on tiny random targets.

Every family with a fused forward runs the same packed, paged forwards through both runners:
three sequences of different lengths prefilled in two chunks, then a verify block each. Logits
and the drafter's features must agree to float32 rounding (the issue's bound is 1e-5 relative;
the fused path is in fact bit-exact in float32 on CPU), and the features must be the HF model's
own `hidden_states[k + 1]` of an unpaged forward.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.fused_target import FusedTargetRunner, fused_unsupported_reason
from dflash_serve.services.engine.kv_cache import AttentionBatch, BlockAllocator, KVPool
from dflash_serve.services.engine.loader import target_runner
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.models import TargetModel
from tests.targets import gemma4_31b_twin, gemma4_e4b_twin, tiny_target

LAYER_IDS = (0, 1, 3)  # 3: the last layer, whose feature comes out of the final norm's fused add
PAGE = 4
CHUNKS = ([3, 5, 2], [2, 4, 1], [4, 4, 4])  # query lengths of 3 sequences: two prefill chunks, then a verify block


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def with_random_norms(model, seed: int):
    """Random norm weights (Gemma initializes them to 0 or 1, which would hide a wrong `1 + w`)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=g, dtype=param.dtype) * 0.5)
    return model


def gemma_targets():
    """Gemma-3 and Gemma-4 dense text models with sliding and global layers, each with its RoPE."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(5)
    # Gemma-3 27B's shape of RoPE: local base 10k, global base 1M with linear scaling; a query
    # scale that is not head_dim's; the final logit softcap.
    gemma3 = Gemma3ForCausalLM(Gemma3TextConfig(**common, query_pre_attn_scalar=12, final_logit_softcapping=5.0,
                                                rope_parameters={
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1000000.0}}))
    # Gemma-4's dense text layer (value norm, attention scale 1, proportional partial RoPE on global
    # layers) where every layer has one head size and no per-layer inputs or KV sharing.
    gemma4 = Gemma4ForCausalLM(Gemma4TextConfig(**common, global_head_dim=8, hidden_size_per_layer_input=0,
                                                final_logit_softcapping=5.0))
    return [("gemma3 (sliding + global, linear global RoPE)", with_random_norms(gemma3, 1).double().eval()),
            ("gemma4 dense text layers", with_random_norms(gemma4, 2).double().eval())]


def fused_families():
    """(name, model) of every configuration the fused forward claims."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(3)
    llama3 = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    qwen3_sliding = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, use_sliding_window=True, sliding_window=6,
                                                 max_window_layers=2,
                                                 layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2))
    return [
        ("llama", tiny_target("llama", layers=4)),
        ("qwen2 (qkv bias)", tiny_target("qwen2", layers=4)),
        ("qwen3 (q/k norm)", tiny_target("qwen3", layers=4)),
        ("llama-3 rope, attention and mlp biases", llama3.double().eval()),
        ("qwen3 with sliding-window layers", qwen3_sliding.double().eval()),
        *gemma_targets(),
        # KV groups of two geometries, k_eq_v, layer scalars
        ("gemma-4 31B twin", gemma4_31b_twin(seed=4)),
        # per-layer inputs, KV-shared layers, double-wide MLP
        ("gemma-4 E4B twin", gemma4_e4b_twin(seed=6)),
    ]


def paged_forwards(runner, dtype, seed: int = 0):
    """Chunked prefill of 3 sequences (lengths 5, 9, 3 in two chunks), then a 4-token block each."""
    tables = [[], [], []]
    allocator = BlockAllocator(64, PAGE)
    for table in tables:
        allocator.grow(table, 24)
    g = torch.Generator().manual_seed(seed)
    starts, outputs, all_ids = [0, 0, 0], [], []
    for query_lens in CHUNKS:
        ids = torch.randint(0, 90, (sum(query_lens),), generator=g)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)])
        batch = AttentionBatch.build(tables, starts, query_lens, PAGE, "cpu")
        outputs.append(runner.forward(ids, positions, batch, torch.arange(sum(query_lens))))
        all_ids.append(ids.split(query_lens))
        starts = [s + n for s, n in zip(starts, query_lens, strict=True)]
    sequences = [torch.cat([chunk[i] for chunk in all_ids]) for i in range(3)]
    return outputs, sequences


def runners(model, dtype):
    target = TargetModel(model.to(dtype), LAYER_IDS)
    pools = [KVPool.allocate_layers(TargetRunner.kv_layout(target), 64, PAGE, dtype, "cpu") for _ in range(2)]
    return (target, TargetRunner(target, pools[0], max_positions=64),
            FusedTargetRunner(target, pools[1], max_positions=64))


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float64, 1e-6)])
@pytest.mark.parametrize("index", range(9))
def test_fused_forward_equals_transformers_on_chunked_prefill_and_verify(index, dtype, bound):
    name, model = fused_families()[index]
    target, hf_runner, fused_runner = runners(model, dtype)
    (hf_out, sequences), (fused_out, _) = paged_forwards(hf_runner, dtype), paged_forwards(fused_runner, dtype)
    for (hf_logits, hf_features), (logits, features) in zip(hf_out, fused_out, strict=True):
        assert logits.shape == hf_logits.shape and features.shape == hf_features.shape
        # float64 differs only because transformers' RMSNorm computes in float32 whatever the input.
        assert relative(logits, hf_logits) < bound, name
        assert relative(features, hf_features) < bound, name
    # The features are the HF model's own hidden states of an unpaged forward over each sequence.
    rows_of = [[] for _ in sequences]  # each sequence's feature rows, forward after forward
    for query_lens, (_, features) in zip(CHUNKS, fused_out, strict=True):
        for i, rows in enumerate(features.split(query_lens)):
            rows_of[i].append(rows)
    with torch.no_grad():
        for ids, rows in zip(sequences, rows_of, strict=True):
            states = model(input_ids=ids[None], output_hidden_states=True).hidden_states
            got = torch.cat(rows).chunk(len(LAYER_IDS), dim=-1)
            for slot, k in enumerate(LAYER_IDS[:-1]):  # HF's last entry is after the final norm
                assert relative(got[slot], states[k + 1][0]) < bound, name


def test_a_layer_listed_twice_gives_its_feature_twice():
    model = tiny_target("llama", layers=4).float()
    target = TargetModel(model, (3, 0, 3))
    layout = TargetRunner.kv_layout(target)
    hf_runner = TargetRunner(target, KVPool.allocate_layers(layout, 64, PAGE, torch.float32, "cpu"),
                             max_positions=64)
    fused_runner = FusedTargetRunner(target, KVPool.allocate_layers(layout, 64, PAGE, torch.float32, "cpu"),
                                     max_positions=64)
    for (_, hf_features), (_, features) in zip(paged_forwards(hf_runner, torch.float32)[0],
                                               paged_forwards(fused_runner, torch.float32)[0], strict=True):
        assert features.shape[-1] == 3 * 32
        assert torch.equal(features[..., :32], features[..., 64:])  # layer 3's feature, twice
        # Equal to the transformers path to float32 rounding: under TRITON_INTERPRET=1 the fused
        # forward's norms run as Triton kernels, which round differently from the reference.
        assert relative(features, hf_features) < 1e-5


def test_fusing_shares_the_hf_weights_and_leaves_the_hf_model_working():
    model = tiny_target("qwen2", layers=4).float()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    _, _, fused = runners(model, torch.float32)
    attn = model.model.layers[0].self_attn
    layer = fused.stack.layers[0]
    # q/k/v are row blocks of the merged weight: one copy of each weight in memory.
    assert attn.q_proj.weight.data_ptr() == layer.qkv.weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() == layer.qkv.bias[-attn.v_proj.bias.numel():].data_ptr()
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() == layer.gate_up.weight[model.config.intermediate_size:].data_ptr()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def kv_pool_for(target):
    return KVPool.allocate_layers(TargetRunner.kv_layout(target), 8, PAGE, torch.float32, "cpu")


def test_auto_takes_the_fused_forward_where_it_applies_and_says_which(caplog):
    with caplog.at_level(logging.INFO, logger="dflash_serve.services.engine.loader"):
        for family in ("llama", "qwen2", "qwen3", "gemma3"):
            target = TargetModel(tiny_target(family, layers=2).float())
            assert isinstance(target_runner("auto", target, kv_pool_for(target), max_positions=64), FusedTargetRunner)
            assert isinstance(target_runner("transformers", target, kv_pool_for(target), max_positions=64),
                              TargetRunner)
        # Gemma-4's mixture-of-experts blocks (26B-A4B) are not fused.
        gemma4 = TargetModel(_gemma4_moe())
        runner = target_runner("auto", gemma4, kv_pool_for(gemma4), max_positions=64)
        assert type(runner) is TargetRunner
    assert ("transformers layer code for Gemma4ForCausalLM (no fused forward: Gemma-4 mixture-of-experts blocks"
            in caplog.text)
    assert "fused layers for Qwen3ForCausalLM (target_impl=auto)" in caplog.text
    assert "fused layers for Gemma3ForCausalLM (target_impl=auto)" in caplog.text
    with pytest.raises(ValueError, match="target_impl=fused: Gemma4ForCausalLM has no fused forward"):
        target_runner("fused", gemma4, kv_pool_for(gemma4), max_positions=64)


def _gemma4(**overrides):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0,
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    return Gemma4ForCausalLM(Gemma4TextConfig(**{**config, **overrides})).float().eval()


def _gemma3(**overrides):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              **overrides)).float().eval()


def _gemma4_moe():
    return _gemma4(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=16)


REFUSED_GEMMAS = {
    "Gemma-4 mixture-of-experts blocks (enable_moe_block)": _gemma4_moe,
    "attention logit softcapping": lambda: _gemma3(attn_logit_softcapping=50.0),
    "bidirectional attention over text tokens": lambda: _gemma3(use_bidirectional_attention=True),
    "hidden_activation 'gelu'": lambda: _gemma3(hidden_activation="gelu"),
}


@pytest.mark.parametrize("reason", list(REFUSED_GEMMAS))
def test_gemma_features_the_fused_layers_do_not_compute_are_refused_by_name(reason):
    target = TargetModel(REFUSED_GEMMAS[reason]())
    assert reason in fused_unsupported_reason(target)
    with pytest.raises(ValueError, match="no fused forward"):
        FusedTargetRunner(target, kv_pool_for(target), max_positions=64)


def test_rope_that_changes_with_the_sequence_stays_on_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, rope_parameters={
                                             "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    target = TargetModel(model.float())
    pool = KVPool.allocate(1, 8, PAGE, 2, 8, torch.float32, "cpu")
    assert type(target_runner("auto", target, pool, max_positions=64)) is TargetRunner
    with pytest.raises(ValueError, match="RoPE type 'dynamic'"):
        FusedTargetRunner(target, pool, max_positions=64)


def test_target_impl_is_validated():
    with pytest.raises(ValueError, match="target_impl='fast': choose one of auto, fused, transformers"):
        EngineConfig(target="t", target_impl="fast")
