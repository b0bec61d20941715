"""Tiny random Hugging Face causal LMs of each supported family (float64, eval mode)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "gemma4")


def tiny_target(family: str, *, layers: int = 8, hidden: int = 32, vocab: int = 96, seed: int = 0,
                softcap: float | None = None, biases: bool = False):
    """`biases` (llama): every projection has a bias (attention_bias, mlp_bias), random (transformers
    initializes them to zero, which would hide one added twice or not at all)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=biases, mlp_bias=biases))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=8, sliding_window=8,
                                                   final_logit_softcapping=softcap))
    elif family == "gemma4":
        model = Gemma4ForCausalLM(Gemma4TextConfig(**common, head_dim=8, sliding_window=8,
                                                   final_logit_softcapping=softcap,
                                                   vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=8))
    else:
        raise ValueError(family)
    return model.to(torch.float64).eval()


def _gemma4_twin(seed: int, layer_scalars: bool, **config):
    """A Gemma-4 text model with random norm weights and layer scalars (transformers initializes
    them to 0 or 1, which would hide a wrong `1 + w` or a skipped scale), float32, eval mode."""
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 512, "sliding_window": 5, "final_logit_softcapping": 30.0, **config}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=g))
        if layer_scalars:
            for layer in model.model.layers:
                layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    return model.float().eval()


GEMMA4_LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]


def gemma4_31b_twin(seed: int = 0, vocab_size: int = 96, global_kv_heads: int = 1):
    """google/gemma-4-31B's structure at toy size: sliding layers of 2 KV heads of 8 (the real:
    16 of 256), global layers of `global_kv_heads` KV heads of 16 (the real: 4 of 512) whose values
    are their keys (attention_k_eq_v), proportional RoPE on a quarter of the global head, layer
    scalars, the final logit softcap (30)."""
    return _gemma4_twin(seed, True, num_hidden_layers=6, layer_types=GEMMA4_LAYER_TYPES, global_head_dim=16,
                        num_global_key_value_heads=global_kv_heads, attention_k_eq_v=True,
                        hidden_size_per_layer_input=0, vocab_size=vocab_size)


def gemma4_e4b_twin(seed: int = 0):
    """google/gemma-4-E4B's structure at toy size: per-layer input embeddings (8 per layer; the
    real: 256), the last layers reading the K/V of the last earlier layer of their type
    (num_kv_shared_layers), those layers' double-wide MLP, global layers of head 16 (the real: 512)."""
    return _gemma4_twin(seed, True, num_hidden_layers=6, layer_types=GEMMA4_LAYER_TYPES, global_head_dim=16,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
                        use_double_wide_mlp=True)


def gemma4_26b_a4b_twin(seed: int = 0):
    """google/gemma-4-26B-A4B's structure at toy size: the 31B twin's attention (two KV geometries,
    k_eq_v, layer scalars) and in every layer 8 experts (the real: 128) of intermediate 16 routed
    top-2 (the real: top-8) beside the dense MLP, with random router input scales and per-expert
    scales (transformers initializes them to 1, which would hide a skipped scale). Its experts run
    transformers' expert loop ("eager"): its default grouped_mm has no float64."""
    model = _gemma4_twin(seed, True, num_hidden_layers=6, layer_types=GEMMA4_LAYER_TYPES, global_head_dim=16,
                         num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                         enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
                         experts_implementation="eager")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.router.scale.copy_(1.0 + 0.5 * torch.randn(layer.router.scale.shape, generator=g))
            layer.router.per_expert_scale.copy_(0.5 + torch.rand(layer.router.per_expert_scale.shape, generator=g))
            # Routers far from uniform: each token's top experts clearly apart.
            layer.router.proj.weight.copy_(torch.randn(layer.router.proj.weight.shape, generator=g))
    return model


def qwen3_moe_twin(seed: int = 0, *, norm_topk_prob: bool = True, decoder_sparse_step: int = 1,
                   mlp_only_layers: tuple[int, ...] = (0,)):
    """Qwen3-30B-A3B's structure at toy size (float32, eval): 4 layers, 8 experts (the real: 128)
    of intermediate 16 routed top-2 (the real: top-8), sparse every `decoder_sparse_step`-th layer
    but `mlp_only_layers`, which keep a dense MLP. Its experts run transformers' expert loop
    ("eager"): its default grouped_mm has no float64."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=list(mlp_only_layers), experts_implementation="eager"))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):  # routers far from uniform
                param.copy_(torch.randn(param.shape, generator=g))
    return model.float().eval()
