"""GPU kernels behind small Python APIs, each beside the plain-torch reference that is also its CPU path.

- `paged_attention`: packed variable-length queries over a paged KV cache (causal or not,
  sliding window, GQA; keys derived from the cached values for Gemma-4's k_eq_v layers) — target
  prefill/verify/decode and the drafter's block forward.
- `inject_context_kv`: the drafter's fused k_norm + RoPE + paged cache write of context K/V for all
  draft layers in one launch.
- `rms_norm`: Qwen3/Llama (or Gemma) RMSNorm in one launch instead of seven; `add_rms_norm` with the
  residual add before it (and Gemma's norm of the sublayer output before that).
- `rope_kv_write`: a target layer's q/k norm + RoPE + paged K/V write, from its merged QKV output.
- `silu_mul`, `gelu_tanh_mul`: SiLU(gate) · up (Llama, Qwen) or GELU-tanh(gate) · up (Gemma) of a
  merged gate-up projection.
- `moe_route`, `moe_experts`: a mixture-of-experts block's routing (softmax top-k, renormalized,
  scaled) and its experts at decode and verify sizes (each routed expert's weights read once per
  launch, no sort); larger batches take the grouped GEMMs.
- `SkinnyLinear`: a linear layer whose GEMMs of at most 16 rows (decode, verify, draft) are one
  launch streaming the weight, split-K reduce included.
- `row_argmax`: greedy token choice over a vocabulary (the first index of each row's maximum).
- `accept_round`: a round's accepted drafts, the row the host reads and the next round's bonus
  tokens and starts, in one launch.
- `InvariantLinear`, `paged_attention_invariant`: a GEMM and paged attention whose every row has
  the same bits whatever else is in the batch (`engine.deterministic`): one reduction order over K
  for any number of rows; attention keys folded in chunks fixed by key position.
- `sample_race`: seeded sampling (the exponential race with counter-based noise keyed by seed and
  position, greedy rows, top-k / top-p thresholds) of a whole batch in two launches.

The Triton kernels run when the tensors are on CUDA (or under TRITON_INTERPRET=1); otherwise, or
without triton installed, the references run — for attention `paged_attention_batched`, its
reference's math over a whole batch at once. Nothing here imports `dflash_serve.services`.
"""

from dflash_serve.kernels.accept import accept_round, accept_round_reference, accept_round_triton, warm_accept_round
from dflash_serve.kernels.argmax import row_argmax, row_argmax_reference, row_argmax_triton
from dflash_serve.kernels.invariant_attention import (
    paged_attention_invariant,
    paged_attention_invariant_reference,
    paged_attention_invariant_triton,
)
from dflash_serve.kernels.invariant_linear import InvariantLinear, invariant_linear_reference, invariant_linear_triton
from dflash_serve.kernels.kv_injection import inject_context_kv, inject_context_kv_reference, inject_context_kv_triton
from dflash_serve.kernels.moe import (
    moe_experts,
    moe_experts_grouped,
    moe_experts_triton,
    moe_route,
    moe_route_reference,
    moe_route_triton,
)
from dflash_serve.kernels.paged_attention import (
    paged_attention,
    paged_attention_batched,
    paged_attention_reference,
    paged_attention_triton,
)
from dflash_serve.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_reference,
    rms_norm_triton,
)
from dflash_serve.kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference, rope_kv_write_triton
from dflash_serve.kernels.sampling import sample_race, sample_race_reference, sample_race_triton, warm_sample_race
from dflash_serve.kernels.skinny_linear import SkinnyLinear, skinny_linear_reference, skinny_linear_triton
from dflash_serve.kernels.silu_mul import (
    gelu_tanh_mul,
    gelu_tanh_mul_reference,
    gelu_tanh_mul_triton,
    silu_mul,
    silu_mul_reference,
    silu_mul_triton,
)

__all__ = [
    "InvariantLinear",
    "SkinnyLinear",
    "accept_round",
    "accept_round_reference",
    "accept_round_triton",
    "add_rms_norm",
    "add_rms_norm_reference",
    "add_rms_norm_triton",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "gelu_tanh_mul_triton",
    "inject_context_kv",
    "inject_context_kv_reference",
    "inject_context_kv_triton",
    "invariant_linear_reference",
    "invariant_linear_triton",
    "moe_experts",
    "moe_experts_grouped",
    "moe_experts_triton",
    "moe_route",
    "moe_route_reference",
    "moe_route_triton",
    "paged_attention",
    "paged_attention_batched",
    "paged_attention_invariant",
    "paged_attention_invariant_reference",
    "paged_attention_invariant_triton",
    "paged_attention_reference",
    "paged_attention_triton",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_triton",
    "rope_kv_write",
    "row_argmax",
    "row_argmax_reference",
    "row_argmax_triton",
    "rope_kv_write_reference",
    "rope_kv_write_triton",
    "sample_race",
    "sample_race_reference",
    "sample_race_triton",
    "warm_accept_round",
    "warm_sample_race",
    "silu_mul",
    "silu_mul_reference",
    "silu_mul_triton",
    "skinny_linear_reference",
    "skinny_linear_triton",
]
