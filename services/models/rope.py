"""The drafter's own rotary embedding (spec §1.6): neox rotate-half over the full head_dim.

Inverse frequencies are computed in float32 the way the training code (transformers) computes
them, so the angles the drafter sees match the ones it was trained with; the angles themselves
are taken in float64 when the model runs in float64 (tests) and in float32 otherwise.
"""

from __future__ import annotations

import math

import torch

from dflash_serve.services.models.draft_config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling applied to cos/sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    base = rope.theta**exponents
    inv_freq = 1.0 / base
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        old_context = rope.original_max_position_embeddings
        low_wavelen = old_context / rope.low_freq_factor
        high_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: interpolate low frequencies, extrapolate high ones, linear ramp in between.
    factor = rope.factor
    if rope.attention_factor is not None:
        scaling = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        scaling = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        scaling = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * base)) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, scaling


class RotaryEmbedding:
    """cos/sin tables at arbitrary absolute positions; holds no parameters (not in the state dict)."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.inv_freq, self.attention_scaling = rope_inverse_frequencies(rope, head_dim)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] (long) -> cos, sin [..., head_dim] in `dtype`."""
        cos, sin = self.cos_sin_half(positions, dtype)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def cos_sin_half(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] (long) -> cos, sin [..., head_dim/2]: rotate-half repeats them."""
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = self._by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._by_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        angles = positions.to(angle_dtype)[..., None] * inv_freq.to(angle_dtype)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, T, hd]; cos/sin [N, T, hd] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
