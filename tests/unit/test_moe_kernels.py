"""dflash_serve.kernels.moe: the routing and experts kernels against their torch references (the fused MoE
blocks' CPU path), at small shapes: 16 experts, top-4, 1 to 20 tokens.

As in test_kernels.py, the Triton tests run on CUDA when there is a GPU, else under Triton's
interpreter in a child pytest. The interpreter multiplies bfloat16 as raw bits, so the experts'
kernel is checked there in float32 and float16 (which has bfloat16's rounding points, finer) and
in bfloat16 on CUDA only; routing only converts its inputs, so it is checked in bfloat16 too.
Outputs start as NaN (ids as -1), so that an element never written shows up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_serve.kernels import gelu_tanh_mul, moe, silu_mul

ON_CUDA = torch.cuda.is_available()
TRITON_AVAILABLE = moe.triton is not None
TRITON_RUNS_HERE = TRITON_AVAILABLE and (ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
runs_triton = pytest.mark.skipif(not TRITON_RUNS_HERE, reason="on CPU these run in test_interpreted_moe_kernels")
requires_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
DEVICE = "cuda" if ON_CUDA else "cpu"
E, K, H, I = 16, 4, 64, 32
# Small tiles, so that these shapes take several column tiles and K steps (two per expert in down).
SMALL = moe.LaunchSettings(gate_up_block_n=16, gate_up_block_k=32, down_block_n=32, down_block_k=16)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty fills what it returns with NaN (integers with -1) while the test runs."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def router_logits(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with ties: token 0's three largest are equal, and every other token has a
    value equal to its 4th largest elsewhere (a tie for its last place, or above)."""
    g = _generator(seed)
    logits = torch.randn(tokens, E, generator=g).to(dtype)
    logits[0, [2, 9, 13]] = logits[0].max() + 1
    fourth = logits.sort(dim=-1, descending=True).values[1:, K - 1]
    logits[torch.arange(1, tokens), torch.randint(0, E, (tokens - 1,), generator=g)] = fourth
    return logits


def routed_ids(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k distinct experts among the first 6 (so these get several tokens and 6..15
    none) and positive weights."""
    g = _generator(seed)
    ids = torch.stack([torch.randperm(6, generator=g)[:K] for _ in range(tokens)])
    return ids, torch.rand(tokens, K, generator=g) + 0.1


def expert_weights(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed)
    return ((torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype),
            (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype))


def test_route_reference_takes_ties_to_the_lower_index():
    """torch.topk's order of equal values is unspecified (on the CPU [2, 4, 1] here); the
    reference's is by index."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    weights, ids = moe.moe_route_reference(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, [1, 2, 4]])


def test_route_reference_without_ties_is_the_softmax_top_k():
    logits = torch.randn(9, E, generator=_generator(1))
    scale = torch.rand(E, generator=_generator(2))
    weights, ids = moe.moe_route_reference(logits, K, renormalize=True, scale=scale)
    top, top_ids = torch.topk(torch.softmax(logits, -1), K)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True) * scale[top_ids], rtol=0, atol=0)


@runs_triton
@pytest.mark.parametrize("dtype,renormalize,scaled", [(torch.float32, True, True),  # Gemma-4's
                                                      (torch.bfloat16, True, False),  # Qwen3-MoE's
                                                      (torch.float16, False, False)])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_route_triton_matches_reference(dtype, tokens, renormalize, scaled, poisoned):
    logits = router_logits(tokens, dtype, seed=tokens).to(DEVICE)
    scale = (torch.rand(E, generator=_generator(3)) + 0.5).to(dtype).to(DEVICE) if scaled else None
    weights_dtype = torch.float32 if scaled else dtype
    want_weights, want_ids = moe.moe_route_reference(logits, K, renormalize, scale, weights_dtype)
    weights, ids = moe.moe_route_triton(logits, K, renormalize, scale, weights_dtype)
    assert torch.equal(ids, want_ids)
    assert ids[0, :2].tolist() == [2, 9]  # the first two of the three tied maxima
    assert weights.dtype == weights_dtype
    torch.testing.assert_close(weights, want_weights, rtol=2e-6 if weights_dtype == torch.float32 else 1e-2, atol=0)


QWEN, GEMMA = (silu_mul, False), (gelu_tanh_mul, True)  # weights in the model dtype, or float32
EXPERT_CASES = [(torch.float32, 1, QWEN, SMALL), (torch.float16, 1, GEMMA, SMALL),
                (torch.float32, 3, GEMMA, moe.LaunchSettings()), (torch.float16, 3, QWEN, moe.LaunchSettings()),
                (torch.float16, 16, GEMMA, SMALL), (torch.float32, 20, QWEN, SMALL)]
if ON_CUDA:
    EXPERT_CASES += [(torch.bfloat16, tokens, family, SMALL) for tokens in (1, 16) for family in (QWEN, GEMMA)]


@runs_triton
@pytest.mark.parametrize("dtype,tokens,family,settings", EXPERT_CASES)
def test_experts_triton_matches_the_torch_path(dtype, tokens, family, settings, poisoned):
    """Experts 0..5 take several tokens each, 6..15 none; 20 tokens take two chunks. SiLU with
    weights in the model dtype (Qwen3-MoE), GELU-tanh with float32 weights (Gemma-4); SMALL
    settings take several column tiles and K steps, the defaults one."""
    activation, gelu_tanh = family
    gate_up, down = (w.to(DEVICE) for w in expert_weights(dtype, seed=4))
    x = torch.randn(tokens, H, generator=_generator(5)).to(dtype).to(DEVICE)
    ids, weights = routed_ids(tokens, seed=6)
    ids, weights = ids.to(DEVICE), weights.to(torch.float32 if gelu_tanh else dtype).to(DEVICE)
    want = moe.moe_experts_grouped(x, ids, weights, gate_up, down, activation)
    got = moe.moe_experts_triton(x, ids, weights, gate_up, down, gelu_tanh=gelu_tanh, settings=settings)
    assert torch.isfinite(got).all()
    # Sums of k products in another order: an ulp of a half-precision dtype; in float32 a few ulps
    # over the hidden size (1e-5: a TF32 product, which this must catch, is off by ~4e-2 on an H200).
    tolerance = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@runs_triton
def test_experts_triton_reads_no_expert_without_tokens(poisoned):
    """NaN weights in every expert no token routes to leave the output finite."""
    gate_up, down = (w.to(DEVICE) for w in expert_weights(torch.float32 if not ON_CUDA else torch.bfloat16, seed=7))
    gate_up[6:], down[6:] = float("nan"), float("nan")
    ids, weights = (t.to(DEVICE) for t in routed_ids(5, seed=8))
    x = torch.randn(5, H, generator=_generator(9)).to(gate_up.dtype).to(DEVICE)
    assert torch.isfinite(moe.moe_experts_triton(x, ids, weights, gate_up, down, gelu_tanh=False)).all()


def test_moe_experts_takes_triton_for_few_pairs_with_a_kernel_activation(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "moe_experts_triton", lambda *args, **kwargs: calls.append(("triton", kwargs)))
    monkeypatch.setattr(moe, "moe_experts_grouped", lambda *args, **kwargs: calls.append(("grouped", {})))
    x = torch.randn(2, H)
    few, many = torch.zeros(2, K, dtype=torch.long), torch.zeros(moe.MAX_PAIRS // K + 1, K, dtype=torch.long)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    moe.moe_experts(x, few, None, None, None, silu_mul)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moe.moe_experts(x, few, None, None, None, gelu_tanh_mul)
    moe.moe_experts(x, many, None, None, None, silu_mul)
    moe.moe_experts(x, few, None, None, None, torch.nn.functional.silu)  # no kernel activation
    moe.moe_experts(x.double(), few, None, None, None, silu_mul)
    moe.moe_experts(x.bfloat16(), few, None, None, None, silu_mul)  # the interpreter's bfloat16 products
    expected = ("triton", {"gelu_tanh": True}) if TRITON_AVAILABLE else ("grouped", {})
    assert calls == [("grouped", {}), expected] + [("grouped", {})] * 4


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 16])
def test_route_and_experts_replay_in_a_cuda_graph(tokens):
    """Qwen3-30B-A3B's expert shapes in bfloat16 (128 experts, top-8), captured once and replayed
    on new inputs: the grouped_mm path's output to a bfloat16 ulp."""
    g = torch.Generator(device="cuda").manual_seed(10)
    experts, top_k, hidden, width = 128, 8, 2048, 768
    gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", generator=g).bfloat16() / hidden**0.5
    down = torch.randn(experts, hidden, width, device="cuda", generator=g).bfloat16() / width**0.5
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, experts, device="cuda", generator=g).bfloat16()

    def block():
        weights, ids = moe.moe_route(logits, top_k, True, weights_dtype=torch.bfloat16)
        return moe.moe_experts(x, ids, weights, gate_up, down, silu_mul)

    block()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    for _ in range(2):
        x.copy_(torch.randn(tokens, hidden, device="cuda", generator=g))
        logits.copy_(torch.randn(tokens, experts, device="cuda", generator=g))
        graph.replay()
        weights, ids = moe.moe_route_reference(logits, top_k, True, weights_dtype=torch.bfloat16)
        want = moe.moe_experts_grouped(x, ids, weights, gate_up, down, silu_mul)
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(ON_CUDA or TRITON_RUNS_HERE or not TRITON_AVAILABLE,
                    reason="the Triton tests run in this process (CUDA or TRITON_INTERPRET=1), or triton is absent")
def test_interpreted_moe_kernels():
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
