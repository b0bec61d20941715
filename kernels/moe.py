"""A mixture-of-experts block's routing and experts at decode and verify sizes, in four launches.

Routing (`moe_route`): per token, the float32 softmax of the router's logits, the top k, optionally
renormalized to sum to 1, optionally times a per-expert scale (Gemma-4). One program per token.
The top k are taken by logit, ties to the lower index: softmax is monotone, so these are the top k
probabilities, and the choice does not hang on how an exp rounds (torch.topk's order of equal
values is unspecified: on the CPU it returns [2, 4, 1] for the 3s of [1, 3, 3, 2, 3]).

Experts (`moe_experts`): out[t] = Σ_j w[t, j] · down[e_tj] · act(gate_up[e_tj] · x[t]), with
transformers' rounding points (see `moe_experts_grouped`). The torch path sorts the T·k (token,
expert) pairs by expert and runs each expert's rows through two grouped GEMMs: at batch-1 decode
on an H200 its ~20 kernels per block take ~4× the time its weights take to stream. The Triton path
groups without sorting: tokens go in chunks of BLOCK_T (one tensor-core tile of rows), and within a
chunk the first pair routed to an expert owns that expert — its program computes every row of the
chunk routed there, so an expert's weights are read once per chunk (once per launch up to
BLOCK_T tokens), with no host sync and a grid fixed by T:

1. gate-up + activation, grid (T·k pairs, I / BLOCK_N): an owner streams its expert's gate and up
   rows for a column tile over H; the others skip it. Each (token, slot)'s activated row lands at
   row t·k + j of a [T·k, I] buffer, and each pair records the rows its expert computes, by token
   of the chunk (-1 for none, and for every token of a pair that owns nothing).
2. down, grid (H / BLOCK_N, T·k pairs): an owner streams its expert's down rows for a column tile
   over I for every row its expert computes, and writes each (token, slot)'s weighted, rounded
   output to row t·k + j of a [T·k, H] buffer; the others return at once.
3. the sum over k, grid (T, H / BLOCK): each token's k rows added in slot order in float32, as
   the torch path sums them.

`MAX_PAIRS` bounds the pairs that take the Triton path; larger batches keep the grouped GEMMs.
Measured on an H200 (`python -m dflash_serve.services.bench.moe_kernels`, BENCHMARKS; µs a
Gemma-4-26B-A4B layer, routing and experts, Triton against torch): 46 against 114 at one token, 130
against 225 at four, 329 against 451 at sixteen, 576 against 578 at thirty-two, and 3× slower at
128, where each expert's rows are many and the grouped GEMMs' tiles fill (Qwen3-30B-A3B alike).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from dflash_serve.kernels.silu_mul import gelu_tanh_mul, silu_mul

try:
    import triton
    import triton.language as tl

    from dflash_serve.kernels.silu_mul import gate_activation
except ImportError:  # CPU-only installs run the reference
    triton = None

Activation = Callable[[torch.Tensor], torch.Tensor]

MAX_PAIRS = 128  # T·k on the Triton experts' path: 16 tokens at top-8 (a batch-1 verify); 32 tie
BLOCK_T = 16  # tokens per chunk: one tensor-core tile of rows
MAX_EXPERTS = 1024  # one program holds a token's logits
SUM_BLOCK = 512  # hidden columns a program of the sum over k adds
# The activations the experts' kernel computes in-line (GELU-tanh or not); others take the torch path.
KERNEL_ACTIVATIONS = {silu_mul: False, gelu_tanh_mul: True}


@dataclass(frozen=True)
class LaunchSettings:
    """Column tiles (gate and up columns each; down's output columns) and K steps of the two
    experts' kernels; a first guess, to be fitted with the benchmark."""

    gate_up_block_n: int = 32
    gate_up_block_k: int = 256
    down_block_n: int = 16
    down_block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- routing --------------------------------------------------------------------------------------


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, scale: torch.Tensor | None = None,
              weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in `weights_dtype`, int64 expert ids [T, k]); `scale` [E]
    (with float32 weights) multiplies each weight by its expert's. Triton on CUDA (or under the
    interpreter)."""
    if (triton is not None and (logits.is_cuda or _interpreting()) and logits.shape[-1] <= MAX_EXPERTS
            and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return moe_route_triton(logits, top_k, renormalize, scale, weights_dtype)
    return moe_route_reference(logits, top_k, renormalize, scale, weights_dtype)


def moe_route_reference(logits: torch.Tensor, top_k: int, renormalize: bool, scale: torch.Tensor | None = None,
                        weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(weights_dtype)
    # After the cast, so that weights keep the product's dtype (float32, or a float64 test's).
    return weights if scale is None else weights * scale[ids], ids


def moe_route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, scale: torch.Tensor | None = None,
                     weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and top_k <= num_experts <= MAX_EXPERTS
    assert scale is None or weights_dtype == torch.float32  # the kernel scales before it rounds
    weights = torch.empty(tokens, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights if scale is None else scale, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, HAS_SCALE=scale is not None, num_warps=1,
        )
    return weights, ids


# -- experts --------------------------------------------------------------------------------------


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: Activation) -> torch.Tensor:
    """x [T, H], each token's experts ids [T, k] and weights [T, k], gate-up [E, 2I, H] (gate rows
    first), down [E, H, I], activation [.., 2I] -> [.., I] -> [T, H]. Triton for up to MAX_PAIRS
    pairs in half precision on CUDA (float32 would take TF32 products) or float32/float16 under the
    interpreter (which multiplies bfloat16 as raw bits), with a kernel activation; else grouped."""
    interpreted = _interpreting() and x.dtype in (torch.float32, torch.float16)
    on_gpu = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    if (triton is not None and activation in KERNEL_ACTIVATIONS and 0 < ids.numel() <= MAX_PAIRS
            and (interpreted or on_gpu)):
        return moe_experts_triton(x, ids, weights, gate_up, down, gelu_tanh=KERNEL_ACTIVATIONS[activation])
    return moe_experts_grouped(x, ids, weights, gate_up, down, activation)


def moe_experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The torch path (the CPU's, and the Triton path's oracle): pairs sorted by expert, each
    expert's run through `grouped_expert_ffn`, weighted and summed per token."""
    tokens, k = ids.shape
    # Stable: an expert's rows keep token order. All on the device, without a host sync.
    sorted_ids, by_expert = torch.sort(ids.reshape(-1), stable=True)
    expert_after = torch.arange(1, gate_up.shape[0] + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, expert_after).to(torch.int32)
    sorted_out = grouped_expert_ffn(x[by_expert // k], ends, gate_up, down, activation)
    out = torch.empty_like(sorted_out)
    out[by_expert] = sorted_out
    # Weighted in the weights' dtype (Gemma-4's are float32), cast to the model's before the sum,
    # as transformers' experts do.
    weighted = (out * weights.reshape(-1, 1)).to(x.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1)


def grouped_expert_ffn(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       activation: Activation) -> torch.Tensor:
    """rows [N, H] sorted by expert, expert e's from ends[e-1] (0 for the first) to ends[e]
    (int32 [E]) -> each row through its expert: down[e] · activation(gate_up[e] · row), [N, H]."""
    if rows.is_cuda and rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (8, 0):
        return grouped_expert_ffn_grouped_mm(rows, ends, gate_up, down, activation)
    return grouped_expert_ffn_reference(rows, ends, gate_up, down, activation)


def grouped_expert_ffn_reference(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                                 activation: Activation) -> torch.Tensor:
    """A loop over the experts that have rows (only their weights are read); it reads the run ends
    on the host, so no CUDA graph can capture it."""
    out = torch.empty_like(rows)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = F.linear(activation(F.linear(rows[start:end], gate_up[expert])), down[expert])
            start = end
    return out


def grouped_expert_ffn_grouped_mm(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                                  activation: Activation) -> torch.Tensor:
    # grouped_mm multiplies by [E, K, N]: the transposed views of the [E, N, K] linear weights.
    hidden = activation(F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends))
    return F.grouped_mm(hidden, down.transpose(1, 2), offs=ends)


def moe_experts_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, *, gelu_tanh: bool,
                       settings: LaunchSettings = LaunchSettings()) -> torch.Tensor:
    tokens, hidden_size = x.shape
    top_k = ids.shape[1]
    width = down.shape[2]  # I
    assert gate_up.shape[1:] == (2 * width, hidden_size) and down.shape[1] == hidden_size
    assert x.stride(1) == gate_up.stride(2) == down.stride(2) == 1
    ids, weights = ids.contiguous(), weights.contiguous()
    activated = torch.empty(tokens * top_k, width, dtype=x.dtype, device=x.device)
    pair_rows = torch.empty(tokens * top_k, BLOCK_T, dtype=torch.int32, device=x.device)
    out = torch.empty(tokens, hidden_size, dtype=x.dtype, device=x.device)
    # float32 stays float32: Triton's default for a float32 dot is TF32 (10-bit mantissas). Its
    # tiles take twice the shared memory: half the stages (4 passed an H200's 227 KiB).
    launch = dict(TOP_K=top_k, BLOCK_T=BLOCK_T, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=settings.num_warps,
                  num_stages=settings.num_stages if x.element_size() <= 2 else max(1, settings.num_stages // 2))
    _gate_up_kernel[(tokens * top_k, triton.cdiv(width, settings.gate_up_block_n))](
        x, ids, gate_up, activated, pair_rows, tokens, hidden_size, width, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), BLOCK_SLOTS=triton.next_power_of_2(top_k), GELU_TANH=gelu_tanh,
        BLOCK_N=settings.gate_up_block_n, BLOCK_K=settings.gate_up_block_k, **launch,
    )
    weighted = torch.empty(tokens * top_k, hidden_size, dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(hidden_size, settings.down_block_n), tokens * top_k)](
        activated, ids, pair_rows, weights, down, weighted, hidden_size, width, down.stride(0), down.stride(1),
        BLOCK_N=settings.down_block_n, BLOCK_K=settings.down_block_k, **launch,
    )
    _sum_slots_kernel[(tokens, triton.cdiv(hidden_size, SUM_BLOCK))](
        weighted, out, hidden_size, TOP_K=top_k, BLOCK=SUM_BLOCK, num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, scale_ptr, weights_ptr, ids_ptr, num_experts, stride_row, TOP_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                      HAS_SCALE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + row * stride_row + experts, mask=experts < num_experts,
                         other=float("-inf")).to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, 0))
        total = tl.sum(exps, 0)
        slots = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        weights = tl.zeros([BLOCK_K], dtype=tl.float32)
        left = logits
        for j in tl.static_range(TOP_K):
            _, best = tl.max(left, 0, return_indices=True, return_indices_tie_break_left=True)
            ids = tl.where(slots == j, best, ids)
            weights = tl.where(slots == j, tl.sum(tl.where(experts == best, exps, 0.0), 0) / total, weights)
            left = tl.where(experts == best, float("-inf"), left)
        in_k = slots < TOP_K
        if RENORMALIZE:
            weights = weights / tl.sum(tl.where(in_k, weights, 0.0), 0)
        if HAS_SCALE:
            weights = weights * tl.load(scale_ptr + ids, mask=in_k, other=0.0).to(tl.float32)
        tl.store(weights_ptr + row * TOP_K + slots, weights.to(weights_ptr.dtype.element_ty), mask=in_k)
        tl.store(ids_ptr + row * TOP_K + slots, ids.to(tl.int64), mask=in_k)

    @triton.jit
    def _chunk_routing(ids_ptr, chunk, expert, tokens, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_SLOTS: tl.constexpr):
        """For the chunk's tokens [BLOCK_T]: whether each is routed to `expert`, and the slot
        (0..k-1) that routes it there (a token's k experts are distinct)."""
        rows = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_SLOTS)
        chunk_ids = tl.load(ids_ptr + rows[:, None] * TOP_K + slots[None, :],
                            mask=(rows[:, None] < tokens) & (slots[None, :] < TOP_K), other=-1)
        hit = chunk_ids == expert
        return tl.max(hit.to(tl.int32), 1) > 0, tl.sum(tl.where(hit, slots[None, :], 0), 1)

    @triton.jit
    def _owns(ids_ptr, pair, expert, tokens, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_SLOTS: tl.constexpr):
        """Whether `pair` is its chunk's first pair routed to `expert`."""
        first = (pair // (BLOCK_T * TOP_K)) * (BLOCK_T * TOP_K)
        earlier = first + tl.arange(0, BLOCK_T)[:, None] * TOP_K + tl.arange(0, BLOCK_SLOTS)[None, :]
        earlier_ids = tl.load(ids_ptr + earlier, mask=(earlier < pair) & (tl.arange(0, BLOCK_SLOTS)[None, :] < TOP_K),
                              other=-1)
        return tl.max(tl.max((earlier_ids == expert).to(tl.int32), 1), 0) == 0

    @triton.jit
    def _gate_up_kernel(x_ptr, ids_ptr, gate_up_ptr, activated_ptr, pair_rows_ptr, tokens, hidden_size, width,
                        stride_x, stride_expert, stride_row, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_SLOTS: tl.constexpr, GELU_TANH: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair)
        owns = _owns(ids_ptr, pair, expert, tokens, TOP_K, BLOCK_T, BLOCK_SLOTS)
        chunk = pair // (BLOCK_T * TOP_K)
        routed, slot = _chunk_routing(ids_ptr, chunk, expert, tokens, TOP_K, BLOCK_T, BLOCK_SLOTS)
        # tl.where, not `&`: the interpreter cannot `&` a scalar mask with a vector one.
        routed = tl.where(owns, routed, False)
        rows = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
        out_rows = rows * TOP_K + slot  # the (token, slot) pairs' flat index: t·k + j
        if tl.program_id(1) == 0:
            # For the down kernel: the pairs this pair's expert computes, by token of the chunk (-1: none).
            tl.store(pair_rows_ptr + pair * BLOCK_T + tl.arange(0, BLOCK_T), tl.where(routed, out_rows, -1))
        if owns:
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            weight = gate_up_ptr + expert * stride_expert
            gate = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, hidden_size, BLOCK_K):
                kk = k0 + ks
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                            mask=routed[:, None] & (kk[None, :] < hidden_size), other=0.0)
                w_mask = (cols[None, :] < width) & (kk[:, None] < hidden_size)
                gate += tl.dot(x, tl.load(weight + cols[None, :] * stride_row + kk[:, None], mask=w_mask, other=0.0),
                               input_precision=DOT_PRECISION)
                up += tl.dot(x, tl.load(weight + (width + cols[None, :]) * stride_row + kk[:, None], mask=w_mask,
                                        other=0.0), input_precision=DOT_PRECISION)
            # Each GEMM's output rounded to the dtype, as grouped_mm's is; then act(gate) · up as
            # the activation kernels round it.
            dtype = activated_ptr.dtype.element_ty
            act = gate_activation(gate.to(dtype).to(tl.float32), GELU_TANH).to(dtype).to(tl.float32)
            tl.store(activated_ptr + out_rows[:, None].to(tl.int64) * width + cols[None, :],
                     (act * up.to(dtype).to(tl.float32)).to(dtype), mask=routed[:, None] & (cols[None, :] < width))

    @triton.jit
    def _down_kernel(activated_ptr, ids_ptr, pair_rows_ptr, weights_ptr, down_ptr, weighted_ptr, hidden_size, width,
                     stride_expert, stride_row, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pair = tl.program_id(1)
        pair_rows = tl.load(pair_rows_ptr + pair * BLOCK_T + tl.arange(0, BLOCK_T))  # -1: none (or not the owner)
        if tl.max(pair_rows, 0) >= 0:
            routed = pair_rows >= 0
            expert = tl.load(ids_ptr + pair)
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, width, BLOCK_K):
                kk = k0 + ks
                a = tl.load(activated_ptr + pair_rows.to(tl.int64)[:, None] * width + kk[None, :],
                            mask=routed[:, None] & (kk[None, :] < width), other=0.0)
                w = tl.load(down_ptr + expert * stride_expert + cols[None, :] * stride_row + kk[:, None],
                            mask=(cols[None, :] < hidden_size) & (kk[:, None] < width), other=0.0)
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            # The expert's output rounded to the dtype (grouped_mm's), times the token's weight
            # rounded to the weights' dtype, cast to the model's: the torch path's rounding points.
            dtype = weighted_ptr.dtype.element_ty
            weight = tl.load(weights_ptr + pair_rows, mask=routed, other=0.0).to(tl.float32)
            out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(weights_ptr.dtype.element_ty).to(dtype)
            tl.store(weighted_ptr + pair_rows.to(tl.int64)[:, None] * hidden_size + cols[None, :], out,
                     mask=routed[:, None] & (cols[None, :] < hidden_size))

    @triton.jit
    def _sum_slots_kernel(weighted_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden_size
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for slot in tl.static_range(TOP_K):
            total += tl.load(weighted_ptr + (token * TOP_K + slot) * hidden_size + cols, mask=mask, other=0.0)
        tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=mask)
