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
)

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "gemma4")


def tiny_target(family: str, *, layers: int = 8, hidden: int = 32, vocab: int = 96, seed: int = 0,
                softcap: float | None = None):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
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
