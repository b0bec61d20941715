"""Target forwards on the paged KV cache, through the transformers model code itself.

We register our attention as a transformers attention implementation ("dflash_paged"): every
decoder layer of any HF causal LM then writes its new K/V into our pool and attends over it with
`dflash_serve.kernels.paged_attention`. Sequences are packed into one row (batch dimension 1, per-token
position ids), so prefill chunks and verify blocks of different lengths run in one forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from dflash_serve.kernels import paged_attention, rms_norm
from dflash_serve.services.engine.fused_target import layer_rope_kinds, rope_tables
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool, LayerKV
from dflash_serve.services.models.target import TargetModel

ATTENTION_NAME = "dflash_paged"
# transformers RMSNorm classes with exactly dflash_serve.kernels.rms_norm's semantics (Gemma's (1 + w) differs).
FUSABLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    paged_batch: AttentionBatch,
    paged_pool: KVPool,
    paged_keys_from_values: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    paged_window_batch: AttentionBatch | None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers calls this with query [1, heads, T, hd], key/value [1, kv_heads, T, hd]."""
    if softcap:
        raise ValueError("attention logit softcapping (Gemma-2) is not supported by the paged kernel")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)
    if paged_pool.windowed(layer):  # a sliding-window layer whose K/V live in window slots
        paged_batch = paged_window_batch
    # A layer reading an earlier layer's K/V (Gemma-4 KV sharing) gets that layer's keys here; they
    # are in the pool already.
    if paged_pool.stores(layer):
        paged_pool.write(layer, paged_batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_cache, v_cache = paged_pool.layer(layer)
    # A k_eq_v layer's cache holds its values only: its keys are derived from them as they are read.
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        paged_batch.block_tables,
        paged_batch.seq_lens,
        paged_batch.query_start,
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        causal=True,
        window=sliding_window,
        max_query_len=paged_batch.max_query_len,
        keys_from_values=paged_keys_from_values.get(layer),
    )
    return out[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Visibility comes from the block tables and positions; transformers need not build a mask.
    return None


@functools.cache
def register_paged_attention() -> None:
    """Our attention as transformers' ATTENTION_NAME implementation; done when a runner is built,
    not on import: transformers' model code takes seconds to import, and the drafter's process,
    which imports this module, never runs a transformers forward (BENCHMARKS, Restarts)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def fuse_rms_norms(model: nn.Module) -> int:
    """Run the model's Llama-style RMSNorms as one kernel each (same result, 1 launch, not 7)."""
    fused = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = lambda x, m=module: rms_norm(x, m.weight, m.variance_epsilon)
            fused += 1
    return fused


# Layer types whose state is K/V the paged cache holds (all of it, or what a sliding window sees).
PAGED_LAYER_TYPES = ("full_attention", "sliding_attention")


def unservable_reason(target: TargetModel) -> str | None:
    """Why neither target forward computes this target as transformers does — the config field
    and what would serve it — or None."""
    cfg = target.config
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap:
        return (f"attn_logit_softcapping={softcap}: the paged attention kernel has no softcap of the scores "
                "(serving it needs one in dflash_serve.kernels.paged_attention)")
    if getattr(cfg, "use_bidirectional_attention", None) == "all":
        return ("use_bidirectional_attention='all': text tokens attend to later ones, which neither decoding nor "
                "verifying a block can compute (serve a checkpoint with causal text attention)")
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(PAGED_LAYER_TYPES))
    if other:
        return (f"layer_types has {', '.join(other)}: only full and sliding-window attention keep their state in "
                "the paged KV cache; other layers need a state cache rolled back to the accepted prefix after "
                "each verify (dflash-spec §1.9)")
    if any(hasattr(layer.self_attn, "sinks") for layer in target.layers):
        return ("attention sinks (a learnt `sinks` logit per head, gpt-oss): the paged attention kernel has none "
                "(serving it needs one in dflash_serve.kernels.paged_attention)")
    return None


def _kv_source(target: TargetModel, index: int, layer: nn.Module) -> int | None:
    """For a Gemma-4 KV-shared layer: the last earlier layer of its type that computes K/V
    (transformers' "store" layer), whose K/V it attends over; None for every other layer. Read
    from the attention modules' own flags, which transformers sets from 5.17 on (the config's
    `kv_sharing_modes` exists only from 5.24)."""
    if not getattr(layer.self_attn, "is_kv_shared_layer", False):
        return None
    types = target.config.layer_types
    return next(i for i in range(index - 1, -1, -1)
                if types[i] == types[index] and getattr(target.layers[i].self_attn, "store_full_length_kv", False))


def _kv_geometry(target: TargetModel, index: int, attn: nn.Module) -> tuple[int, int]:
    """(KV heads, head size) of layer `index`: from its key projection where it has one, else from
    its resolved config (transformers' per-layer view where the config is heterogeneous)."""
    head_dim, k_proj = getattr(attn, "head_dim", None), getattr(attn, "k_proj", None)
    if head_dim and isinstance(k_proj, nn.Linear):
        return k_proj.out_features // head_dim, head_dim
    cfg = target.config
    per_layer = getattr(cfg, "per_layer_config", None)
    layer_cfg = per_layer[index] if per_layer is not None and cfg.num_hidden_layers == target.num_layers else cfg
    heads = layer_cfg.num_attention_heads
    return (getattr(layer_cfg, "num_key_value_heads", None) or heads,
            getattr(layer_cfg, "head_dim", None) or layer_cfg.hidden_size // heads)


class TargetRunner:
    """Runs a `TargetModel` over packed tokens with its KV in a `KVPool`."""

    def __init__(self, target: TargetModel, pool: KVPool, *, max_positions: int):
        """`max_positions`: one past the largest position a forward may write (the RoPE tables a
        layer whose keys are derived from its values reads them with)."""
        self.target = target
        self.pool = pool
        model = target.model
        reason = unservable_reason(target)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot be served: {reason}")
        register_paged_attention()
        if target.device.type == "cuda":
            fuse_rms_norms(model)
        # The HF model stays usable as it was (plain forwards, training): our attention is switched
        # on only for the duration of our own forwards.
        self._configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
        self._keys_from_values = {}
        if any(spec.keys_from_values for spec in pool.layout):
            tables, kinds = rope_tables(target, max_positions), layer_rope_kinds(target)
            for index, spec in enumerate(pool.layout):
                if spec.keys_from_values:
                    owner = target.layers[index if spec.reads_layer is None else spec.reads_layer].self_attn
                    self._keys_from_values[index] = (owner.k_norm.weight.detach().float(), *tables[kinds[index]])

    @staticmethod
    def kv_layout(target: TargetModel) -> list[LayerKV]:
        """Each decoder layer's K/V geometry — its attention's own (Gemma-4's global layers have
        their own head size and KV heads) — and the earlier layer whose K/V a layer reads when it
        computes none (Gemma-4's `num_kv_shared_layers`)."""
        layout = []
        for index, layer in enumerate(target.layers):
            source = _kv_source(target, index, layer)
            owner_index = index if source is None else source
            owner = target.layers[owner_index].self_attn
            kv_heads, head_dim = _kv_geometry(target, owner_index, owner)
            # Gemma-4's attention_k_eq_v: a key projection and no value projection; its values are
            # the projection normed, its keys the same normed with a weight and rotated: stored once.
            keys_from_values = hasattr(owner, "k_proj") and getattr(owner, "v_proj", False) is None
            layout.append(LayerKV(kv_heads, head_dim, reads_layer=source, keys_from_values=keys_from_values,
                                  window=getattr(layer.self_attn, "sliding_window", None)))
        return layout

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, logits_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed tokens [T] at positions [T] -> (logits [K, V] of rows `logits_rows`, features [T, F*H])."""
        saved = [c._attn_implementation for c in self._configs]
        for c in self._configs:
            c._attn_implementation = ATTENTION_NAME
        try:
            logits, features = self.target.forward_with_features(
                input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_rows,
                paged_batch=batch,
                paged_pool=self.pool,
                paged_keys_from_values=self._keys_from_values,
                paged_window_batch=None if self.pool.window_map is None else self.pool.window_batch(batch),
            )
        finally:
            for c, name in zip(self._configs, saved, strict=True):
                c._attn_implementation = name
        return logits[0], None if features is None else features[0]
