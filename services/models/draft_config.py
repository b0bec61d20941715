"""The DFlash drafter's config.json (z-lab format, dflash-spec §2.1), parsed and checked.

The checkpoint's own dict is kept as `raw`, so writing a config back preserves every field we do
not interpret (bos/eos ids, `auto_map`, …) exactly as the checkpoint had it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


class DraftConfigError(ValueError):
    """config.json does not describe a drafter we can run; the message says which field and why."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's rule for checkpoints without `target_layer_ids` (spec §1.2).

    One draft layer takes the middle target layer; otherwise ids are spread evenly from 1 to N-3,
    rounded with Python's `round` (banker's rounding, as the reference does).
    """
    if num_target_layers < 4:
        raise DraftConfigError(f"num_target_layers={num_target_layers}: the default layer-id rule needs at least 4")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings of the drafter itself (never the target's: spec §1.6)."""

    rope_type: str = "default"
    theta: float = 1_000_000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any]) -> RopeConfig:
        # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise DraftConfigError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):
            raise DraftConfigError("per-layer-type rope_parameters are not supported for DFlash drafters")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise DraftConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise DraftConfigError("config.json has no rope_theta (top level or in rope_parameters)")
        factor = params.get("factor")
        if rope_type != "default" and factor is None and rope_type != "yarn":
            raise DraftConfigError(f"rope type {rope_type!r} needs a 'factor'")
        max_pos = cfg.get("max_position_embeddings")
        original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if rope_type in ("yarn", "llama3") and original is None:
            original = max_pos
        if rope_type == "yarn" and factor is None:
            if not (max_pos and original):
                raise DraftConfigError("yarn rope needs 'factor' or both max and original max positions")
            factor = max_pos / original
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            factor=float(factor) if factor is not None else 1.0,
            original_max_position_embeddings=int(original) if original is not None else None,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )


@dataclass(frozen=True)
class DFlashDraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    # Explicit causality: `is_causal` (top level) wins over `dflash_config.causal`; None = per layer type.
    causal_override: bool | None
    rope: RopeConfig
    attention_bias: bool = False
    input_embedding_scale: float | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dtype: str = "bfloat16"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer: int) -> bool:
        """Spec §1.5: `is_causal` → `dflash_config.causal` → causal iff the layer is sliding."""
        if self.causal_override is not None:
            return self.causal_override
        return self.layer_types[layer] == SLIDING_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashDraftConfig:
        cfg = copy.deepcopy(cfg)
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DraftConfigError("dflash_config must be an object")

        def need(name: str) -> Any:
            if cfg.get(name) is None:
                raise DraftConfigError(f"config.json is missing '{name}'")
            return cfg[name]

        def dflash_first(name: str, default: Any = None) -> Any:
            # The newest reference reads block_size / mask_token_id from dflash_config first.
            value = dflash.get(name)
            return cfg.get(name, default) if value is None else value

        archs = cfg.get("architectures") or []
        if archs and "DFlashDraftModel" not in archs:
            raise DraftConfigError(f"architectures={archs}: expected ['DFlashDraftModel'] (DFlash 2 and others are out of scope)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise DraftConfigError(f"hidden_act={act!r}: DFlash drafters use a SwiGLU MLP with 'silu'")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise DraftConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise DraftConfigError(f"head_dim={head_dim} must be even for rotary embeddings")

        mask = dflash_first("mask_token_id")
        if mask is None:
            raise DraftConfigError(
                "config.json has no mask_token_id (in dflash_config or at the top level); "
                "add dflash_config.mask_token_id with the target embedding row the drafter was trained with"
            )
        block_size = int(dflash_first("block_size", 16))
        if block_size < 2:
            raise DraftConfigError(f"block_size={block_size}: a DFlash block needs at least 2 slots")

        num_target_layers = cfg.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise DraftConfigError("config.json has neither dflash_config.target_layer_ids nor num_target_layers")
            layer_ids = default_target_layer_ids(int(num_target_layers), layers)
        layer_ids = tuple(int(i) for i in layer_ids)
        if not layer_ids or min(layer_ids) < 0:
            raise DraftConfigError(f"target_layer_ids={list(layer_ids)} must be a non-empty list of layer indices >= 0")
        if num_target_layers is not None and max(layer_ids) >= int(num_target_layers):
            raise DraftConfigError(f"target_layer_ids={list(layer_ids)} exceed num_target_layers={num_target_layers}")

        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            # Qwen3Config's rule when the list is absent.
            use_swa = bool(cfg.get("use_sliding_window")) and window is not None
            first_swa = int(cfg.get("max_window_layers") or 0)
            layer_types = [SLIDING_ATTENTION if use_swa and i >= first_swa else FULL_ATTENTION for i in range(layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != layers:
            raise DraftConfigError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={layers}")
        unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise DraftConfigError(f"layer_types has unknown entries {sorted(unknown)}")
        if SLIDING_ATTENTION in layer_types and not window:
            raise DraftConfigError("layer_types has sliding_attention layers but sliding_window is not set")

        if "is_causal" in cfg and cfg["is_causal"] is not None:
            causal_override = bool(cfg["is_causal"])
        elif dflash.get("causal") is not None:
            causal_override = bool(dflash["causal"])
        else:
            causal_override = None

        softcap = dflash.get("final_logit_softcapping")
        scale = dflash.get("input_embedding_scale")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=int(need("vocab_size")),
            block_size=block_size,
            mask_token_id=int(mask),
            target_layer_ids=layer_ids,
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            causal_override=causal_override,
            rope=RopeConfig.from_config_dict(cfg),
            attention_bias=bool(cfg.get("attention_bias", False)),
            input_embedding_scale=float(scale) if scale is not None else None,
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            raw=cfg,
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json to write: the checkpoint's own dict with the fields the format requires."""
        cfg = copy.deepcopy(self.raw)
        cfg.setdefault("architectures", ["DFlashDraftModel"])
        cfg.setdefault("model_type", "qwen3")
        cfg["block_size"] = self.block_size
        dflash = dict(cfg.get("dflash_config") or {})
        dflash["mask_token_id"] = self.mask_token_id
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        cfg["dflash_config"] = dflash
        cfg["layer_types"] = list(self.layer_types)
        cfg["sliding_window"] = self.sliding_window
        return cfg
