"""Independent reference (test oracle) for one DFlash draft forward pass.

Written only from /work/shared/dflash-spec.md (sections 1, 2.1 and the Addendum); it deliberately
shares no code with services/models/.  Plain torch, one function per concept, read top to bottom.

One call = one drafting round at batch size 1:
    block ids  = [bonus_token, MASK x (B-1)]            at absolute positions start .. start+B-1
    ctx        = hidden_norm(fc(context_features))      one row per context position 0 .. T-1
    per layer  : pre-norm Qwen3 block; K/V = [ctx ; block] (context first), QK-norm, RoPE, GQA
    logits     = target lm_head(norm(x))[slots 1..B-1] * output_multiplier, then optional softcap
"""

import copy

import torch
import torch.nn.functional as F_
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


# ----------------------------------------------------------------------------------------------
# config helpers


def _dflash_field(config: dict, name: str):
    """Read `name` from config["dflash_config"] first, then from the top level (spec Addendum)."""
    dflash_cfg = config.get("dflash_config") or {}
    if dflash_cfg.get(name) is not None:
        return dflash_cfg[name]
    if config.get(name) is not None:
        return config[name]
    raise KeyError(f"{name!r} found neither in dflash_config nor at the top level of the config")


def _layer_attention(config: dict, i: int) -> tuple[bool, int | None]:
    """(causal, sliding_window or None) for draft layer i (spec 1.5, vLLM resolution order)."""
    layer_types = config.get("layer_types")
    layer_type = layer_types[i] if layer_types else "full_attention"
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ValueError(f"unknown layer type {layer_type!r} for layer {i}")
    is_sliding = layer_type == "sliding_attention"

    dflash_cfg = config.get("dflash_config") or {}
    if config.get("is_causal") is not None:
        causal = bool(config["is_causal"])
    elif dflash_cfg.get("causal") is not None:
        causal = bool(dflash_cfg["causal"])
    else:
        causal = is_sliding

    window = None
    if is_sliding:
        window = config.get("sliding_window")
        if window is None:
            raise ValueError(f"layer {i} is sliding_attention but config['sliding_window'] is null")
        window = int(window)
    return causal, window


# ----------------------------------------------------------------------------------------------
# RoPE: inverse frequencies and attention scaling come from transformers' own init functions


_ROPE_KEYS = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "original_max_position_embeddings",
)


def rope_inv_freq_and_scaling(config: dict) -> tuple[torch.Tensor, float]:
    """inv_freq [hd/2] (float32 values as transformers computes them, held in float64) and attention_scaling for the draft's own RoPE (spec 1.6)."""
    hd = int(config["head_dim"])
    fields = {k: copy.deepcopy(config[k]) for k in _ROPE_KEYS if config.get(k) is not None}
    rp = fields.get("rope_parameters")
    if isinstance(rp, dict) and ({"full_attention", "sliding_attention"} & set(rp)):
        raise NotImplementedError("per-layer-type rope_parameters are not expected on a qwen3 drafter")
    cfg = Qwen3Config(
        hidden_size=int(config["hidden_size"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        head_dim=hd,
        **fields,
    )  # Qwen3Config standardizes old (rope_theta + rope_scaling) and new (rope_parameters) formats
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        # transformers' own default (float32 inv_freq, as the drafter was trained with)
        inv_freq, scaling = Qwen3RotaryEmbedding.compute_default_rope_parameters(cfg)
        inv_freq = inv_freq.to(torch.float64)
    elif rope_type in ("dynamic", "longrope"):
        # these depend on the running sequence length; no z-lab drafter uses them
        raise NotImplementedError(f"rope_type {rope_type!r} is sequence-length dependent; not supported")
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        inv_freq = inv_freq.to(torch.float64)
    if inv_freq.shape != (hd // 2,):
        raise ValueError(f"RoPE must cover the full head_dim {hd}; got inv_freq of shape {tuple(inv_freq.shape)}")
    return inv_freq, float(scaling)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
    """cos/sin [P, hd] in float64 for integer absolute positions [P] (neox layout: halves duplicated)."""
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [P, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, hd]
    return angles.cos() * scaling, angles.sin() * scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, heads, hd]; cos/sin [P, hd]."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------------------------
# building blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain Qwen3 RMSNorm: x * rsqrt(mean(x^2) + eps) * w; math in fp32 (fp64 if the input is fp64)."""
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute_dtype)
    xc = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T  # no biases anywhere (attention_bias is false)


def attention_mask(q_pos, k_pos, causal: bool, window: int | None) -> torch.Tensor:
    """bool [Q, K], True = visible. q_pos [Q], k_pos [K] absolute positions."""
    diff = q_pos[:, None] - k_pos[None, :]  # q - k
    visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        visible = visible & (diff < window)
        if not causal:
            visible = visible & (-diff < window)
    return visible


def draft_layer(x, ctx, w, prefix, config, cos_q, sin_q, cos_k, sin_k, mask):
    """One pre-norm Qwen3-style draft layer with KV injection. x [B, H], ctx [T, H]."""
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    hd = int(config["head_dim"])
    eps = float(config["rms_norm_eps"])
    B, T = x.shape[0], ctx.shape[0]

    # --- attention
    y = rms_norm(x, w[prefix + "input_layernorm.weight"], eps)
    kv_in = torch.cat([ctx, y], dim=0)  # context first, then block; ctx is NOT input-normed

    q = linear(y, w[prefix + "self_attn.q_proj.weight"]).view(B, nh, hd)
    k = linear(kv_in, w[prefix + "self_attn.k_proj.weight"]).view(T + B, nkv, hd)
    v = linear(kv_in, w[prefix + "self_attn.v_proj.weight"]).view(T + B, nkv, hd)

    q = rms_norm(q, w[prefix + "self_attn.q_norm.weight"], eps)  # per-head QK-norm, before RoPE
    k = rms_norm(k, w[prefix + "self_attn.k_norm.weight"], eps)
    q = apply_rope(q, cos_q, sin_q)
    k = apply_rope(k, cos_k, sin_k)

    rep = nh // nkv  # GQA: kv head g serves query heads g*rep .. g*rep+rep-1
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)

    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, P, hd]
    scores = (q @ k.transpose(-1, -2)) * (hd ** -0.5)  # [nh, B, T+B]
    scores = scores.masked_fill(~mask[None, :, :], float("-inf"))
    softmax_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(q.dtype)
    attn = (probs @ v).transpose(0, 1).reshape(B, nh * hd)
    x = x + linear(attn, w[prefix + "self_attn.o_proj.weight"])

    # --- SwiGLU MLP
    y = rms_norm(x, w[prefix + "post_attention_layernorm.weight"], eps)
    gate = linear(y, w[prefix + "mlp.gate_proj.weight"])
    up = linear(y, w[prefix + "mlp.up_proj.weight"])
    x = x + linear(F_.silu(gate) * up, w[prefix + "mlp.down_proj.weight"])
    return x


# ----------------------------------------------------------------------------------------------
# the oracle


def reference_draft_logits(
    config: dict,
    weights: dict[str, torch.Tensor],
    embed_weight: torch.Tensor,
    embed_scale: float,
    lm_head_weight: torch.Tensor,
    logit_softcap: float | None,
    output_multiplier: float,
    context_features: torch.Tensor,
    bonus_token: int,
    start: int,
) -> torch.Tensor:
    """[B-1, V] draft logits for block slots 1..B-1 (slot j predicts the token AT position start+j)."""
    if config.get("attention_bias"):
        raise NotImplementedError("attention_bias=true is not part of the spec'd drafter")
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {config['hidden_act']!r}")

    block_size = int(_dflash_field(config, "block_size"))
    mask_token_id = int(_dflash_field(config, "mask_token_id"))
    n_layers = int(config["num_hidden_layers"])
    eps = float(config["rms_norm_eps"])
    T = context_features.shape[0]
    if T > start:
        raise ValueError(f"context has {T} positions but the bonus token sits at position {start}")

    # 1. block embeddings from the target's table (+ target's scaling, e.g. Gemma sqrt(H))
    ids = torch.tensor([bonus_token] + [mask_token_id] * (block_size - 1), dtype=torch.long)
    x = embed_weight[ids]
    x = x * torch.tensor(embed_scale, dtype=x.dtype)

    # 2. fused context features, shared by every layer's K/V
    ctx = rms_norm(linear(context_features, weights["fc.weight"]), weights["hidden_norm.weight"], eps)

    # 3. positions, RoPE tables, per-layer visibility
    q_pos = start + torch.arange(block_size)
    k_pos = torch.cat([torch.arange(T), q_pos])
    inv_freq, rope_scaling = rope_inv_freq_and_scaling(config)
    cos_q, sin_q = rope_cos_sin(q_pos, inv_freq, rope_scaling)
    cos_k, sin_k = rope_cos_sin(k_pos, inv_freq, rope_scaling)

    # 4. decoder layers
    for i in range(n_layers):
        causal, window = _layer_attention(config, i)
        mask = attention_mask(q_pos, k_pos, causal, window)
        x = draft_layer(x, ctx, weights, f"layers.{i}.", config, cos_q, sin_q, cos_k, sin_k, mask)

    # 5. final norm, target LM head on slots 1..B-1, output multiplier, then softcap
    h = rms_norm(x, weights["norm.weight"], eps)[1:]
    logits = linear(h, lm_head_weight)
    logits = logits * output_multiplier
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    return logits
