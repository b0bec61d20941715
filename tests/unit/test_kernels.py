"""Kernels against their plain-torch references, and the references against naive versions.

The Triton kernels run on CUDA when there is a GPU, else under Triton's interpreter on the CPU.
The interpreter cannot do bfloat16 arithmetic (it computes on the raw bits), so bfloat16 kernels
are checked on CUDA only. Inputs are random; caches and outputs start as NaN so that an element
written wrongly, read from outside a sequence or never written shows up.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_serve.kernels.kv_injection import inject_context_kv_reference, inject_context_kv_triton
from dflash_serve.kernels.paged_attention import (
    derive_keys,
    paged_attention,
    paged_attention_batched,
    paged_attention_reference,
    paged_attention_triton,
)
from dflash_serve.services.models.draft import RMSNorm
from dflash_serve.services.models.rope import apply_rotary

attention_module = importlib.import_module("dflash_serve.kernels.paged_attention")
injection_module = importlib.import_module("dflash_serve.kernels.kv_injection")
ON_CUDA = torch.cuda.is_available()
TRITON_AVAILABLE = attention_module.triton is not None
# Triton picks its interpreter when `import triton` decorates its own standard library, and by the
# time this file is collected transformers (torch._dynamo) has imported triton. So on a CPU-only
# machine the Triton tests run in a child pytest started with TRITON_INTERPRET=1.
TRITON_RUNS_HERE = TRITON_AVAILABLE and (ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
runs_triton = pytest.mark.skipif(
    not TRITON_RUNS_HERE,
    reason="triton is not installed: Triton kernels untested (reference tests still run)" if not TRITON_AVAILABLE
    else "on CPU these run under the Triton interpreter, in test_interpreted_kernels_in_a_child_pytest",
)
requires_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
DEVICE = "cuda" if ON_CUDA else "cpu"
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# ‖out − ref‖ / ‖ref‖ against a float64 reference.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output (unwritten, or read outside a sequence)"
    return ((out - ref).norm() / ref.norm()).item()


# -- paged attention ------------------------------------------------------------------------------


def paged_kv(seq_lens, *, num_kv_heads, head_dim, block_size, generator):
    """float64 caches holding each sequence in shuffled, non-contiguous blocks. Every slot no
    sequence owns is NaN and block-table padding points at a NaN block, so a read outside a
    sequence poisons the output."""
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.full((len(seq_lens), max(pages) + 1), int(order[-1]), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    used = 0
    for i, (seq_len, num_pages) in enumerate(zip(seq_lens, pages)):
        blocks = order[used:used + num_pages]
        used += num_pages
        block_tables[i, :num_pages] = blocks
        positions = torch.arange(seq_len)
        slots = blocks[positions // block_size], positions % block_size
        k_cache[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        v_cache[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
    return k_cache, v_cache, block_tables


def attention_case(*, seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, seed=0, strided_q=False):
    """float64 CPU inputs of one paged_attention call (q in sequence order, last q_len positions)."""
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, generator=generator
    )
    num_heads = num_kv_heads * group
    total_q = sum(q_lens)
    if strided_q:  # q as a view into a fused qkv projection
        q = torch.randn(total_q, num_heads + 2 * num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        q = q[:, :num_heads]
    else:
        q = torch.randn(total_q, num_heads, head_dim, generator=generator, dtype=torch.float64)
    query_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens, query_start


def is_visible(query_pos: int, key_pos: int, causal: bool, window: int | None) -> bool:
    if causal and key_pos > query_pos:
        return False
    if window is not None and (query_pos - key_pos >= window or (not causal and key_pos - query_pos >= window)):
        return False
    return True


def naive_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal, window):
    """Dense K/V per sequence gathered token by token, an explicit mask, float64 softmax per head."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        table = block_tables[i].tolist()
        k = torch.stack([k_cache[table[p // block_size], p % block_size] for p in range(seq_len)])
        v = torch.stack([v_cache[table[p // block_size], p % block_size] for p in range(seq_len)])
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            query_pos = seq_len - q_len + j
            mask = torch.tensor([is_visible(query_pos, key_pos, causal, window) for key_pos in range(seq_len)])
            for head in range(q.shape[1]):
                scores = (k[:, head // group] @ q[starts[i] + j, head]) * scale
                probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=0)
                out[starts[i] + j, head] = probs @ v[:, head // group]
    return out


ATTENTION_CASES = {
    # target decode: one query per sequence, a 1-token sequence among them
    "decode-gqa4": dict(seq_lens=[37, 1, 80], q_lens=[1, 1, 1], num_kv_heads=2, group=4, head_dim=32,
                        block_size=16, causal=True, window=None),
    # target verify: 16 queries per sequence, mixed with a short chunk and an idle (q_len 0) sequence
    "verify-gqa4-q0": dict(seq_lens=[50, 16, 100, 23], q_lens=[16, 16, 0, 5], num_kv_heads=2, group=4,
                           head_dim=64, block_size=8, causal=True, window=None),
    # target prefill chunks (whole prompt and a later chunk), MHA
    "prefill-mha": dict(seq_lens=[70, 45], q_lens=[70, 20], num_kv_heads=3, group=1, head_dim=16,
                        block_size=16, causal=True, window=None),
    # drafter block forward: non-causal over context + block
    "drafter-noncausal": dict(seq_lens=[40, 73, 16], q_lens=[16, 16, 16], num_kv_heads=2, group=4,
                              head_dim=32, block_size=16, causal=False, window=None),
    # sliding-window draft layers, window smaller than the block
    "window7-causal": dict(seq_lens=[40, 90, 16], q_lens=[16, 16, 16], num_kv_heads=1, group=4,
                           head_dim=32, block_size=8, causal=True, window=7),
    "window5-noncausal": dict(seq_lens=[60, 30], q_lens=[16, 16], num_kv_heads=2, group=1,
                              head_dim=16, block_size=16, causal=False, window=5),
    # a window larger than any context equals no window
    "window-beyond-context": dict(seq_lens=[40, 33], q_lens=[0, 33], num_kv_heads=2, group=4, head_dim=16,
                                  block_size=8, causal=False, window=500),
    # head_dim that is not a power of two, q a strided view, sequences longer than a key tile
    "head-dim-24-strided-q": dict(seq_lens=[130, 9], q_lens=[16, 9], num_kv_heads=2, group=2, head_dim=24,
                                  block_size=16, causal=True, window=100, strided_q=True),
}


def split_case(name):
    config = dict(ATTENTION_CASES[name])
    causal, window = config.pop("causal"), config.pop("window")
    inputs = attention_case(**config)
    return inputs, dict(scale=1.5 / math.sqrt(config["head_dim"]), causal=causal, window=window)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_reference_matches_naive(name, dtype):
    (q, k_cache, v_cache, *rest), options = split_case(name)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    out = paged_attention_reference(q, k_cache, v_cache, *rest, **options)
    assert out.dtype == dtype
    assert relative_error(out, naive_paged_attention(q, k_cache, v_cache, *rest, **options)) < TOLERANCE[dtype]


def test_attention_reference_window_beyond_context_is_full_attention():
    (q, *rest), options = split_case("window-beyond-context")
    windowed = paged_attention_reference(q, *rest, **options)
    assert torch.equal(windowed, paged_attention_reference(q, *rest, **{**options, "window": None}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_batched_matches_reference(name, dtype):
    (q, k_cache, v_cache, *rest), options = split_case(name)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    result = paged_attention_batched(q, k_cache, v_cache, *rest, **options, out=out)
    assert result is out  # every row written (NaN otherwise), in place
    assert relative_error(out, paged_attention_reference(q, k_cache, v_cache, *rest, **options)) < TOLERANCE[dtype]


@pytest.mark.parametrize("budget", [None, 1], ids=["one-matmul", "a-sequence-at-a-time"])
def test_attention_batched_rounds_of_many_sequences_match_reference(monkeypatch, budget):
    """A round's shape: many sequences of one query length with very different context lengths
    (keys past each one's length are masked, not read), next to prefill chunks of other lengths;
    under a small score budget the group is attended in slices with the same result."""
    if budget is not None:
        monkeypatch.setattr(attention_module, "BATCHED_KEYS_BUDGET", budget)
    seq_lens = [6, 300, 17, 64, 6, 129, 40, 7, 90, 33, 200, 21]
    q_lens = [6] * 10 + [11, 21]
    inputs = attention_case(seq_lens=seq_lens, q_lens=q_lens, num_kv_heads=2, group=3, head_dim=16, block_size=8)
    for causal, window in [(True, None), (False, None), (True, 9), (False, 4)]:
        options = dict(scale=0.3, causal=causal, window=window)
        out = paged_attention_batched(*inputs, **options)
        assert relative_error(out, paged_attention_reference(*inputs, **options)) < TOLERANCE[torch.float64]


# Every dtype with the default kv split (1 at these sizes), and a forced split of 3 (each split's
# partial softmax merged by the second kernel) in float32, where the merge is checked tightest; 16
# splits leave most of them empty at these lengths (no output written, none read by the merge).
SPLIT_CASES = [(dtype, None) for dtype in TRITON_DTYPES] + [(torch.float32, 3), (torch.float32, 16)]
if ON_CUDA:
    SPLIT_CASES.append((torch.bfloat16, 3))


def test_kv_split_count_is_a_power_of_two_within_one_wave(monkeypatch):
    """The split count is a kernel constant: powers of two keep an eager forward's new shapes on the
    variants already compiled, and the count still never overfills one wave of programs."""
    pa = importlib.import_module("dflash_serve.kernels.paged_attention")  # the package exports a function of that name
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)  # an H100's
    slots = pa.PROGRAMS_PER_SM * 132
    counts = set()
    for programs in range(1, 300):
        for max_keys in (16, 300, 1536, 8192, 40000):
            splits = pa.choose_num_kv_splits(programs, max_keys, torch.device("cpu"))
            assert splits & (splits - 1) == 0 and 1 <= splits <= pa.MAX_KV_SPLITS
            assert splits == 1 or (programs * splits <= slots and splits * pa.MIN_KEYS_PER_SPLIT <= max_keys)
            counts.add(splits)
    assert counts == {1, 2, 4, 8, 16, 32}


@runs_triton
@pytest.mark.parametrize("dtype, num_kv_splits", SPLIT_CASES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_triton_matches_reference(name, dtype, num_kv_splits):
    inputs, options = split_case(name)
    reference = paged_attention_reference(*inputs, **options)  # float64
    q, k_cache, v_cache, *rest = (t.to(DEVICE) for t in inputs)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    max_query_len = int((rest[2][1:] - rest[2][:-1]).max())
    result = paged_attention_triton(q, k_cache, v_cache, *rest, **options, max_query_len=max_query_len, out=out,
                                    num_kv_splits=num_kv_splits)
    assert result is out
    assert relative_error(out, reference) < TOLERANCE[dtype]


def keys_from_values_case(name, dtype):
    """A case's inputs in `dtype` with keys to be derived from the values (Gemma-4's
    attention_k_eq_v): the key norm weight and a RoPE table of its head size, and the k_cache
    that writing each derived key at its position would hold (the oracle)."""
    (q, _, v_cache, block_tables, seq_lens, query_start), options = split_case(name)
    head_dim = v_cache.shape[-1]
    g = torch.Generator().manual_seed(3)
    weight = 1 + 0.3 * torch.randn(head_dim, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(512).float()[:, None] * inv_freq[None]
    q, v_cache = q.to(dtype), v_cache.to(dtype)
    keys_from_values = (weight, freqs.cos().to(dtype), freqs.sin().to(dtype))
    k_cache = torch.full_like(v_cache, float("nan"))
    block_size = v_cache.shape[1]
    for i, seq_len in enumerate(seq_lens.tolist()):
        for position in range(seq_len):
            slot = int(block_tables[i, position // block_size]), position % block_size
            k_cache[slot] = derive_keys(v_cache[slot][None], torch.tensor([position]), keys_from_values)[0]
    return (q, k_cache, v_cache, block_tables, seq_lens, query_start), keys_from_values, options


KEYS_FROM_VALUES_CASES = ["decode-gqa4", "verify-gqa4-q0", "prefill-mha", "window7-causal", "head-dim-24-strided-q"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", KEYS_FROM_VALUES_CASES)
def test_keys_derived_from_values_are_attention_over_the_keys_written(name, dtype):
    """A layer that stores its values only attends exactly as one that stored the keys its
    values derive (reference and the batched CPU path)."""
    (q, k_cache, v_cache, *rest), keys_from_values, options = keys_from_values_case(name, dtype)
    for attend in (paged_attention_reference, paged_attention_batched):
        out = attend(q, None, v_cache, *rest, **options, keys_from_values=keys_from_values)
        assert torch.equal(out, attend(q, k_cache, v_cache, *rest, **options)), attend.__name__


@runs_triton
@pytest.mark.parametrize("dtype, num_kv_splits", SPLIT_CASES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("name", KEYS_FROM_VALUES_CASES)
def test_attention_triton_with_keys_derived_from_values_matches_reference(name, dtype, num_kv_splits):
    (q, k_cache, v_cache, *rest), keys_from_values, options = keys_from_values_case(name, dtype)
    reference = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), *rest, **options)
    moved = [t.to(DEVICE) for t in (q, v_cache, *rest)]
    weight, cos, sin = (t.to(DEVICE) for t in keys_from_values)
    out = paged_attention_triton(moved[0], None, moved[1], *moved[2:], **options, num_kv_splits=num_kv_splits,
                                 keys_from_values=(weight, cos, sin))
    assert relative_error(out, reference) < TOLERANCE[dtype]


@runs_triton
def test_attention_triton_without_max_query_len():
    inputs, options = split_case("verify-gqa4-q0")
    q, k_cache, v_cache, *rest = (t.to(DEVICE).float() if t.is_floating_point() else t.to(DEVICE) for t in inputs)
    out = paged_attention_triton(q, k_cache, v_cache, *rest, **options)
    assert relative_error(out, paged_attention_reference(*inputs, **options)) < TOLERANCE[torch.float32]


@pytest.mark.gpu
@runs_triton
@requires_cuda
def test_attention_triton_verify_shapes_on_cuda():
    """Target verify as served: 32 q / 8 kv heads, head_dim 128, bf16, long contexts, the default
    (SM-count based) kv split."""
    inputs = attention_case(seq_lens=[3000, 517, 1200, 64], q_lens=[16, 16, 16, 16], num_kv_heads=8, group=4,
                            head_dim=128, block_size=16)
    options = dict(scale=128**-0.5, causal=True, window=None)
    q, k_cache, v_cache, *rest = (t.to(DEVICE) for t in inputs)
    out = paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), *rest, **options, max_query_len=16)
    assert relative_error(out, paged_attention_reference(*inputs, **options)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@runs_triton
@requires_cuda
def test_attention_replays_in_a_cuda_graph():
    """With max_query_len given the call is capturable; replays follow new seq_lens in place."""
    inputs = attention_case(seq_lens=[700, 130], q_lens=[16, 16], num_kv_heads=2, group=4, head_dim=128,
                            block_size=16)
    options = dict(scale=128**-0.5, causal=False, window=None)
    q, k_cache, v_cache, block_tables, seq_lens, query_start = (t.to(DEVICE) for t in inputs)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start)
    out = torch.full_like(q, float("nan"))
    paged_attention(*args, **options, max_query_len=16, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, **options, max_query_len=16, out=out)
    for shorter in (0, 5, 40):
        seq_lens.copy_(inputs[4] - shorter)
        out.fill_(float("nan"))
        graph.replay()
        expected = paged_attention_reference(*inputs[:4], inputs[4] - shorter, inputs[5], **options)
        assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


# -- context KV injection -------------------------------------------------------------------------


def injection_case(*, num_rows, num_layers, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Inputs of one inject_context_kv call and NaN caches with room for twice the rows."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_rows, num_layers, 2, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
    k_norm_weight = 1 + 0.5 * torch.randn(num_layers, head_dim, generator=generator, dtype=torch.float64)
    positions = torch.randint(0, 4096, (num_rows, 1), generator=generator)
    angles = positions * torch.rand(head_dim // 2, generator=generator, dtype=torch.float64)
    angles = torch.cat([angles, angles], dim=-1)
    num_blocks = math.ceil(2 * num_rows / block_size)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_rows]
    cache_shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(2)]
    return (kv.to(dtype), k_norm_weight.to(dtype), angles.cos(), angles.sin(), slot_mapping, *caches)


def written_rows(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """cache [L, blocks, block_size, ...] -> the rows of slot_mapping, [T, L, ...]."""
    block_size = cache.shape[2]
    return cache[:, slot_mapping // block_size, slot_mapping % block_size].transpose(0, 1)


def untouched_are_nan(cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool, device=cache.device)
    untouched[slot_mapping] = False
    return bool(cache.flatten(1, 2)[:, untouched].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_injection_reference_is_the_models_k_norm_and_rope_bit_for_bit(dtype):
    kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache = injection_case(
        num_rows=11, num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, dtype=dtype
    )
    eps = 1e-6
    inject_context_kv_reference(kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, eps=eps)
    for layer in range(kv.shape[1]):
        k_norm = RMSNorm(kv.shape[-1], eps).to(dtype)
        with torch.no_grad():
            k_norm.weight.copy_(k_norm_weight[layer])
            keys = k_norm(kv[:, layer, 0].transpose(0, 1)[None])  # [1, heads, T, hd], as the model holds them
        expected = apply_rotary(keys, cos.to(dtype)[None], sin.to(dtype)[None])[0].transpose(0, 1)
        assert torch.equal(written_rows(k_cache, slot_mapping)[:, layer], expected)
    assert torch.equal(written_rows(v_cache, slot_mapping), kv[:, :, 1])
    assert untouched_are_nan(k_cache, slot_mapping) and untouched_are_nan(v_cache, slot_mapping)


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(
    "num_rows, num_layers, num_kv_heads, head_dim, block_size",
    [(9, 3, 2, 32, 16), (20, 2, 3, 24, 8), (1, 5, 8, 128, 16)],
)
def test_injection_triton_matches_reference(dtype, num_rows, num_layers, num_kv_heads, head_dim, block_size):
    inputs = injection_case(num_rows=num_rows, num_layers=num_layers, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype)
    kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache = (t.to(DEVICE) for t in inputs)
    inject_context_kv_triton(kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, eps=1e-6)
    ref_k_cache, ref_v_cache = inputs[5].clone(), inputs[6].clone()
    inject_context_kv_reference(*inputs[:5], ref_k_cache, ref_v_cache, eps=1e-6)
    slot_mapping = slot_mapping.cpu()
    # The kernel rounds at the reference's steps; only its float32 mean/rsqrt differ in the last bits.
    assert relative_error(written_rows(k_cache.cpu(), slot_mapping), written_rows(ref_k_cache, slot_mapping)) < {
        torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert torch.equal(written_rows(v_cache.cpu(), slot_mapping), kv[:, :, 1].cpu())
    assert untouched_are_nan(k_cache, slot_mapping.to(DEVICE)) and untouched_are_nan(v_cache, slot_mapping.to(DEVICE))


@requires_cuda
def test_injection_triton_writes_the_last_layer_of_a_pool_past_two_to_the_31_elements():
    """A Qwen3-8B drafter's pool on an H200: 5 layers of 33k blocks (16 tokens, 8 heads of 128),
    so layer 4 starts past 2**31 elements. An int32 offset wrapped there and the kernel wrote
    outside the pool (an illegal memory access in `dflash bench` on the H200, 2026-12-02)."""
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 5, 33_000, 16, 8, 128
    assert (num_layers - 1) * num_blocks * block_size * num_kv_heads * head_dim > 2**31
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    num_rows = 256
    kv = torch.randn(num_rows, num_layers, 2, num_kv_heads, head_dim, generator=generator, device="cuda",
                     dtype=torch.bfloat16)
    k_norm_weight = torch.ones(num_layers, head_dim, dtype=torch.bfloat16, device="cuda")
    angles = torch.rand(num_rows, head_dim, generator=generator, device="cuda")
    slot_mapping = torch.arange(num_rows, device="cuda") + (num_blocks - 32) * block_size  # the last blocks
    inject_context_kv_triton(kv, k_norm_weight, angles.cos(), angles.sin(), slot_mapping, k_cache, v_cache, eps=1e-6)
    torch.cuda.synchronize()
    assert torch.equal(written_rows(v_cache, slot_mapping), kv[:, :, 1])
    expected = k_cache.new_zeros((num_layers, 32, block_size, num_kv_heads, head_dim))
    inject_context_kv_reference(kv, k_norm_weight, angles.cos(), angles.sin(), slot_mapping - (num_blocks - 32) * block_size,
                                expected, expected.clone(), eps=1e-6)
    assert relative_error(k_cache[:, -32:].float(), expected.float()) < 4e-3
    del k_cache, v_cache


# -- dispatch -------------------------------------------------------------------------------------


def test_dispatch_picks_the_kernel_on_cuda_or_the_interpreter_else_the_torch_path(monkeypatch):
    calls = []
    # The torch path of attention is the batched one (the reference is its oracle).
    for module, name, torch_path in [(attention_module, "paged_attention", "batched"),
                                     (injection_module, "inject_context_kv", "reference")]:
        monkeypatch.setattr(module, f"{name}_triton", lambda *args, **kwargs: calls.append("triton"))
        monkeypatch.setattr(module, f"{name}_{torch_path}", lambda *args, **kwargs: calls.append("reference"))
    x = torch.randn(2, 2, 16)

    def call_both(tensor):
        attention_module.paged_attention(tensor, None, None, None, None, None, scale=1.0, causal=True)
        injection_module.inject_context_kv(tensor, None, None, None, None, None, None, eps=1e-6)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call_both(x)
    assert calls == ["reference"] * 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    call_both(x)
    call_both(x.double())  # float64 (the test oracle dtype) always runs the reference
    expected = "triton" if TRITON_AVAILABLE else "reference"
    assert calls == ["reference"] * 2 + [expected] * 2 + ["reference"] * 2
    if ON_CUDA:
        call_both(x.cuda())
        assert calls[-2:] == [expected] * 2


@pytest.mark.skipif(ON_CUDA or TRITON_RUNS_HERE or not TRITON_AVAILABLE,
                    reason="the Triton tests run in this process (CUDA or TRITON_INTERPRET=1), or triton is absent")
def test_interpreted_kernels_in_a_child_pytest():
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]


# -- RMSNorm --------------------------------------------------------------------------------------


def test_rms_norm_reference_is_transformers_qwen3_rmsnorm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dflash_serve.kernels.rms_norm import rms_norm_reference

    norm = Qwen3RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64, dtype=dtype)
        n = norm.to(dtype)
        assert torch.equal(rms_norm_reference(x, n.weight, 1e-6), n(x))


def gemma_norms(dim: int, eps: float):
    """transformers' Gemma-3 and Gemma-4 RMSNorms with random weights, each with the float32 weight
    the fused path multiplies by (Gemma-3's `1 + w`, Gemma-4's `w`)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    gemma3, gemma4 = Gemma3RMSNorm(dim, eps=eps), Gemma4RMSNorm(dim, eps=eps)
    for norm in (gemma3, gemma4):
        torch.nn.init.normal_(norm.weight)
    return [(gemma3, lambda: 1.0 + gemma3.weight.float()), (gemma4, lambda: gemma4.weight.float())]


def test_rms_norm_reference_scaled_in_float32_is_transformers_gemma_rmsnorms():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from dflash_serve.kernels.rms_norm import rms_norm_reference

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64, dtype=dtype)
        for norm, weight in gemma_norms(64, 1e-6):
            norm = norm.to(dtype)
            out = rms_norm_reference(x, weight(), 1e-6, scale_in_float32=True)
            # Gemma-4 takes pow(·, -0.5) where we take rsqrt: equal but for the last float32 bit.
            assert out.dtype == dtype and relative_error(out, norm(x)) < {torch.float32: 1e-7, torch.bfloat16: 4e-3}[dtype]
        assert relative_error(rms_norm_reference(x, None, 1e-6, scale_in_float32=True),
                              Gemma4RMSNorm(64, 1e-6, with_scale=False)(x)) < {torch.float32: 1e-7,
                                                                               torch.bfloat16: 4e-3}[dtype]
    x = torch.randn(4, 64)
    norm, weight = gemma_norms(64, 1e-6)[0]
    assert torch.equal(rms_norm_reference(x, weight(), 1e-6, scale_in_float32=True), norm(x))  # Gemma-3: bit for bit


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 4, 128), (1, 576), (5, 100)])
@pytest.mark.parametrize("scale_in_float32", [False, True], ids=["llama", "gemma"])
def test_rms_norm_triton_matches_reference(dtype, shape, scale_in_float32):
    from dflash_serve.kernels.rms_norm import rms_norm_reference, rms_norm_triton

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    # Gemma's weights are float32 (1 + w folded at load); Llama's are the model's dtype.
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(torch.float32 if scale_in_float32 else dtype).to(DEVICE)
    kwargs = dict(scale_in_float32=scale_in_float32)
    ref = rms_norm_reference(x.double(), w.double(), 1e-6, **kwargs)
    out = rms_norm_triton(x, w, 1e-6, **kwargs)
    assert out.shape == x.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]
    # A strided input (per-head view of a projection, as q_norm/k_norm see it).
    wide = torch.randn(4, 2 * shape[-1], generator=g).to(dtype).to(DEVICE)
    view = wide[:, : shape[-1]]
    assert relative_error(rms_norm_triton(view, w, 1e-6, **kwargs),
                          rms_norm_reference(view.double(), w.double(), 1e-6, **kwargs)) < TOLERANCE[dtype]


# -- optional flash-attn backend ------------------------------------------------------------------


def _flash_attn_stand_in(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size):
    """flash_attn_with_kvcache as its documentation defines it, written independently of our
    reference: queries aligned to the end of the keys; key k visible to query position p when
    k < seqlen, k <= p if causal, and p - left <= k <= p + right for a window (-1 = unbounded)."""
    batch, q_len, heads, dim = q.shape
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(cache_seqlens[b])
        idx = torch.arange(n)
        blocks = block_table[b, idx // page].long()
        k = k_cache[blocks, idx % page].double()  # [n, kv_heads, dim]
        v = v_cache[blocks, idx % page].double()
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        p = (n - q_len + torch.arange(q_len))[:, None]
        visible = torch.ones(q_len, n, dtype=torch.bool)
        if causal:
            visible &= idx[None] <= p
        left, right = window_size
        if left >= 0:
            visible &= idx[None] >= p - left
        if right >= 0 and not causal:
            visible &= idx[None] <= p + right
        scores = torch.einsum("qhd,khd->hqk", q[b].double(), k) * softmax_scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 5), (False, 5)])
def test_flash_backend_maps_our_semantics_onto_flash_attn(monkeypatch, causal, window):
    from dflash_serve.kernels import flash_backend

    monkeypatch.setattr(flash_backend, "flash_attn_with_kvcache", _flash_attn_stand_in)
    g = torch.Generator().manual_seed(3)
    page, q_len, seq_lens = 256, 4, [300, 9, 700]
    num_blocks = sum(math.ceil(n / page) for n in seq_lens) + 1
    k_cache = torch.randn(num_blocks, page, 2, 16, generator=g)
    v_cache = torch.randn(num_blocks, page, 2, 16, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(3, 3, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for j in range(math.ceil(n / page)):
            tables[i, j] = order.pop()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query_start = torch.arange(0, 4 * q_len, q_len, dtype=torch.int32)
    q = torch.randn(3 * q_len, 8, 16, generator=g)
    ours = flash_backend.flash_paged_attention(q, k_cache, v_cache, tables, lens, scale=0.25, causal=causal,
                                               window=window, max_query_len=q_len)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, lens, query_start, scale=0.25, causal=causal,
                                    window=window)
    assert relative_error(ours, ref) < 1e-5


def test_flash_backend_is_only_used_when_it_can_serve_the_call(monkeypatch):
    from dflash_serve.kernels import flash_backend

    q = torch.randn(8, 4, 16)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    monkeypatch.setattr(flash_backend, "flash_attn_with_kvcache", None)
    assert not flash_backend.can_serve(q, torch.zeros(2, 256, 2, 16), lens, 4)  # not installed
    monkeypatch.setattr(flash_backend, "flash_attn_with_kvcache", _flash_attn_stand_in)
    assert not flash_backend.can_serve(q, torch.zeros(2, 256, 2, 16), lens, 4)  # CPU tensors
    if ON_CUDA:
        qc = q.cuda().half()
        assert flash_backend.can_serve(qc, torch.zeros(2, 256, 2, 16), lens, 4)
        assert not flash_backend.can_serve(qc, torch.zeros(2, 16, 2, 16), lens, 4)  # page size 16
        assert not flash_backend.can_serve(qc, torch.zeros(2, 256, 2, 16), lens, 5)  # lengths differ
        assert not flash_backend.can_serve(qc, torch.zeros(2, 256, 2, 16), lens, None)


# -- fused decoder-layer ops (add + RMSNorm, q/k norm + RoPE + KV write, SiLU·mul) -----------------


def test_add_rms_norm_reference_is_transformers_residual_add_then_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from dflash_serve.kernels.rms_norm import add_rms_norm_reference

    norm = LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x, res = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
        normed, summed = add_rms_norm_reference(x, res, norm.to(dtype).weight, 1e-5)
        assert torch.equal(summed, res + x) and torch.equal(normed, norm(res + x))


def test_add_rms_norm_reference_with_a_sandwich_norm_is_transformers_gemma3_residual_step():
    from dflash_serve.kernels.rms_norm import add_rms_norm_reference

    (post, post_weight), (pre, pre_weight) = gemma_norms(64, 1e-6)[0], gemma_norms(64, 1e-6)[0]
    for dtype in (torch.float32, torch.bfloat16):
        post, pre = post.to(dtype), pre.to(dtype)
        x, res = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
        normed, summed = add_rms_norm_reference(x, res, pre_weight(), 1e-6, x_norm_weight=post_weight(),
                                                scale_in_float32=True)
        # Gemma3DecoderLayer: hidden = post_norm(sublayer output); hidden = residual + hidden; pre_norm(hidden)
        assert torch.equal(summed, res + post(x)) and torch.equal(normed, pre(res + post(x)))


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (1, 576), (5, 100)])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma-sandwich"])
def test_add_rms_norm_triton_matches_reference(dtype, shape, gemma):
    from dflash_serve.kernels.rms_norm import add_rms_norm_reference, add_rms_norm_triton

    g = torch.Generator().manual_seed(sum(shape))
    x, res = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w_dtype = torch.float32 if gemma else dtype
    w, x_w = ((1 + 0.3 * torch.randn(shape[-1], generator=g)).to(w_dtype).to(DEVICE) for _ in range(2))
    kwargs = dict(x_norm_weight=x_w, scale_in_float32=True) if gemma else {}
    normed, summed = add_rms_norm_triton(x, res, w, 1e-6, **kwargs)
    ref_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ref_normed, ref_summed = add_rms_norm_reference(x.cpu(), res.cpu(), w.cpu(), 1e-6, **ref_kwargs)
    assert normed.dtype == summed.dtype == dtype
    if gemma:  # the sandwich norm's sum of squares may round differently: the sum is off by an ulp at most
        assert relative_error(summed, ref_summed) < TOLERANCE[dtype]
    else:
        assert torch.equal(summed.cpu(), ref_summed)  # one rounding of the same sum
    assert relative_error(normed, ref_normed) < TOLERANCE[dtype]


def test_silu_mul_reference_is_transformers_llama_mlp_activation():
    from transformers.activations import ACT2FN

    from dflash_serve.kernels.silu_mul import silu_mul_reference

    for dtype in (torch.float32, torch.bfloat16):
        gate, up = torch.randn(3, 40, dtype=dtype), torch.randn(3, 40, dtype=dtype)
        assert torch.equal(silu_mul_reference(torch.cat([gate, up], -1)), ACT2FN["silu"](gate) * up)


def test_gelu_tanh_mul_reference_is_transformers_gemma_mlp_activation():
    from transformers.activations import ACT2FN

    from dflash_serve.kernels.silu_mul import gelu_tanh_mul_reference

    for dtype in (torch.float32, torch.bfloat16):
        gate, up = 3 * torch.randn(3, 40, dtype=dtype), torch.randn(3, 40, dtype=dtype)
        expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
        assert torch.equal(gelu_tanh_mul_reference(torch.cat([gate, up], -1)), expected)


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 48), (9, 1500), (4, 2048)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_mul_triton_matches_reference(dtype, rows, width, activation):
    act_mul = importlib.import_module("dflash_serve.kernels.silu_mul")  # `dflash_serve.kernels.silu_mul` is also the function
    triton_fn = getattr(act_mul, f"{activation}_mul_triton")
    reference = getattr(act_mul, f"{activation}_mul_reference")
    g = torch.Generator().manual_seed(rows * width)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype).to(DEVICE)
    out = triton_fn(gate_up)
    assert out.shape == (rows, width) and out.dtype == dtype
    assert relative_error(out, reference(gate_up.cpu())) < {
        torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]


def rope_case(*, tokens, heads, kv_heads, head_dim, block_size, dtype, qk_norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 200, (tokens,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(256).float()[:, None] * inv_freq[None]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    weights = [(1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)] if qk_norm else [None, None]
    return qkv, positions, cos, sin, slots, k_cache, k_cache.clone(), weights


def test_rope_kv_write_reference_is_transformers_qwen3_attention_input():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from dflash_serve.kernels.rope_kv_write import rope_kv_write_reference

    heads, kv_heads, head_dim = 4, 2, 16
    for dtype in (torch.float32, torch.bfloat16):
        qkv, positions, cos, sin, slots, k_cache, v_cache, (qw, kw) = rope_case(
            tokens=11, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=4, dtype=dtype, qk_norm=True)
        q = rope_kv_write_reference(qkv, positions, cos, sin, slots, k_cache, v_cache, num_heads=heads,
                                    num_kv_heads=kv_heads, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)
        q_norm, k_norm = Qwen3RMSNorm(head_dim, 1e-6).to(dtype), Qwen3RMSNorm(head_dim, 1e-6).to(dtype)
        q_norm.weight.data, k_norm.weight.data = qw, kw
        hq, hk, hv = qkv.view(11, -1, head_dim).split([heads, kv_heads, kv_heads], 1)
        full_cos, full_sin = torch.cat([cos, cos], -1)[positions], torch.cat([sin, sin], -1)[positions]
        ref_q, ref_k = apply_rotary_pos_emb(q_norm(hq).transpose(0, 1)[None], k_norm(hk).transpose(0, 1)[None],
                                            full_cos[None], full_sin[None])
        assert torch.equal(q, ref_q[0].transpose(0, 1))
        flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        assert torch.equal(flat_k[slots], ref_k[0].transpose(0, 1)) and torch.equal(flat_v[slots], hv)


def test_rope_kv_write_reference_is_transformers_gemma4_attention_input():
    """Gemma's q/k norms scale in float32 (weights folded at load), and Gemma-4 norms the values."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, apply_rotary_pos_emb

    from dflash_serve.kernels.rope_kv_write import rope_kv_write_reference

    heads, kv_heads, head_dim = 4, 2, 16
    for dtype in (torch.float32, torch.bfloat16):
        qkv, positions, cos, sin, slots, k_cache, v_cache, _ = rope_case(
            tokens=11, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=4, dtype=dtype, qk_norm=False)
        (q_norm, _), (k_norm, _) = gemma_norms(head_dim, 1e-6)[1], gemma_norms(head_dim, 1e-6)[1]
        q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
        v_norm = Gemma4RMSNorm(head_dim, 1e-6, with_scale=False)
        q = rope_kv_write_reference(qkv, positions, cos, sin, slots, k_cache, v_cache, num_heads=heads,
                                    num_kv_heads=kv_heads, q_norm_weight=q_norm.weight.float(),
                                    k_norm_weight=k_norm.weight.float(), eps=1e-6, scale_in_float32=True, v_norm=True)
        hq, hk, hv = qkv.view(11, -1, head_dim).split([heads, kv_heads, kv_heads], 1)
        full_cos, full_sin = torch.cat([cos, cos], -1)[positions], torch.cat([sin, sin], -1)[positions]
        ref_q = apply_rotary_pos_emb(q_norm(hq), full_cos, full_sin, unsqueeze_dim=1)
        ref_k = apply_rotary_pos_emb(k_norm(hk), full_cos, full_sin, unsqueeze_dim=1)
        flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        # Gemma-4's pow(·, -0.5) against our rsqrt: equal but for the last float32 bit.
        bound = {torch.float32: 1e-7, torch.bfloat16: 4e-3}[dtype]
        for got, expected in ((q, ref_q), (flat_k[slots], ref_k), (flat_v[slots], v_norm(hv))):
            assert got.dtype == dtype and relative_error(got, expected) < bound


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("norms", ["none", "qwen3", "gemma4"])
# (3, 20, 4, 16) and (2, 12, 4, 8): more heads than one program takes, its tiles splitting q and v heads.
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim",
                         [(1, 4, 2, 16), (13, 8, 2, 32), (5, 2, 2, 24), (3, 20, 4, 16), (2, 12, 4, 8)])
def test_rope_kv_write_triton_matches_reference(dtype, norms, tokens, heads, kv_heads, head_dim):
    from dflash_serve.kernels.rope_kv_write import rope_kv_write_reference, rope_kv_write_triton

    qkv, positions, cos, sin, slots, k_cache, v_cache, (qw, kw) = rope_case(
        tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=4, dtype=dtype,
        qk_norm=norms != "none")
    gemma = norms == "gemma4"
    if gemma:  # float32 weights (as folded at load), float32 scaling, normed values
        qw, kw = qw.float(), kw.float()
    kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-6, scale_in_float32=gemma, v_norm=gemma)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = rope_kv_write_reference(qkv, positions, cos, sin, slots, ref_k, ref_v, q_norm_weight=qw,
                                    k_norm_weight=kw, **kwargs)
    moved = [None if t is None else t.to(DEVICE) for t in (qkv, positions, cos, sin, slots, k_cache, v_cache, qw, kw)]
    k_out, v_out = moved[5], moved[6]
    q = rope_kv_write_triton(*moved[:7], q_norm_weight=moved[7], k_norm_weight=moved[8], **kwargs)
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert relative_error(q, ref_q) < tolerance
    flat = lambda cache: cache.cpu().view(-1, kv_heads, head_dim)  # noqa: E731
    assert relative_error(flat(k_out)[slots], flat(ref_k)[slots]) < tolerance
    if gemma:
        assert relative_error(flat(v_out)[slots], flat(ref_v)[slots]) < tolerance
    else:
        assert torch.equal(flat(v_out)[slots], flat(ref_v)[slots])
    untouched = torch.ones(flat(k_out).shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat(k_out)[untouched].isnan().all() and flat(v_out)[untouched].isnan().all()


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("layer", ["values_from_keys", "values_only", "queries_only"])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 4, 1, 16), (13, 8, 2, 32), (3, 20, 4, 16)])
def test_rope_kv_write_triton_matches_reference_on_gemma4_global_and_kv_shared_layers(dtype, layer, tokens, heads,
                                                                                      kv_heads, head_dim):
    """A k_eq_v layer's projection has no value heads (values are its raw keys, normed), and it may
    write its values alone (its keys derived from them as they are read); a layer reading an
    earlier layer's K/V projects queries only and writes nothing."""
    from dflash_serve.kernels.rope_kv_write import rope_kv_write_reference, rope_kv_write_triton

    qkv, positions, cos, sin, slots, k_cache, v_cache, (qw, kw) = rope_case(
        tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=4, dtype=dtype, qk_norm=True)
    qw, kw = qw.float(), kw.float()
    kv_sets = 0 if layer == "queries_only" else 1
    qkv = qkv[:, : (heads + kv_sets * kv_heads) * head_dim].contiguous()
    caches = {"values_from_keys": (k_cache, v_cache), "values_only": (None, v_cache),
              "queries_only": (None, None)}[layer]
    kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-6, scale_in_float32=True, v_norm=True,
                  values_from_keys=bool(kv_sets))
    ref_caches = [None if c is None else c.clone() for c in caches]
    ref_q = rope_kv_write_reference(qkv, positions, cos, sin, slots, *ref_caches, q_norm_weight=qw,
                                    k_norm_weight=kw, **kwargs)
    moved = [None if t is None else t.to(DEVICE) for t in (qkv, positions, cos, sin, slots, *caches, qw, kw)]
    q = rope_kv_write_triton(*moved[:7], q_norm_weight=moved[7], k_norm_weight=moved[8], **kwargs)
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert relative_error(q, ref_q) < tolerance
    if kv_sets:
        hk = qkv.view(tokens, -1, head_dim)[:, heads:]
        for got, want in zip(moved[5:7], ref_caches, strict=True):
            if want is None:
                continue
            flat_got, flat_want = got.cpu().view(-1, kv_heads, head_dim), want.view(-1, kv_heads, head_dim)
            assert relative_error(flat_got[slots], flat_want[slots]) < tolerance
        # The values are the raw key heads RMS-normed without a weight, not rotated.
        from dflash_serve.kernels.rms_norm import rms_norm_reference

        expected_v = rms_norm_reference(hk, None, 1e-6, scale_in_float32=True)
        assert relative_error(ref_caches[1].view(-1, kv_heads, head_dim)[slots], expected_v) < tolerance


# -- argmax ---------------------------------------------------------------------------------------


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 4096), (2, 3, 9000), (5, 12_289)])
def test_row_argmax_triton_is_torch_argmax(dtype, shape):
    """Random rows, and rows whose maximum is tied within a chunk, across chunks, and in the last,
    partial chunk: the first index wins, as torch's."""
    from dflash_serve.kernels.argmax import BLOCK_COLS, row_argmax_reference, row_argmax_triton

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1, shape[-1])
    vocab = shape[-1]
    for row, columns in enumerate([[vocab - 1], [0, vocab - 1], [vocab // 2, min(vocab - 1, vocab // 2 + BLOCK_COLS)]]):
        if row < flat.shape[0]:
            flat[row, columns] = 50.0
    expected = row_argmax_reference(x)
    got = row_argmax_triton(x.to(DEVICE))
    assert got.shape == expected.shape and got.dtype == torch.long
    assert torch.equal(got.cpu(), expected)


# -- a round's acceptance --------------------------------------------------------------------------


def _round_case(n, k, seed, *, limits=False, strided=False):
    """Tokens of a small vocabulary, drafts that match the first 0..k slots of each row (then may
    match again by chance past a mismatch, which must not count)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 5, (n, k + 1), generator=g)
    drafts = None
    if k:
        width = k + 3 if strided else k  # drafts read out of a wider buffer, as from a graph's
        buffer = torch.randint(0, 5, (n, width), generator=g)
        drafts = buffer[:, :k]
        for row, match in enumerate(torch.randint(0, k + 1, (n,), generator=g).tolist()):
            drafts[row, :match] = tokens[row, :match]
    starts = torch.randint(0, 1000, (n,), generator=g)
    caps = torch.randint(0, k + 1, (n,), generator=g) if limits else None
    return tokens, starts, drafts, caps


def test_accept_round_reference_is_the_rounds_definition():
    tokens = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[4, 5, 6], [0, 5, 6], [1, 0, 3], [9, 9, 9]])
    starts = torch.tensor([10, 20, 30, 40])
    from dflash_serve.kernels.accept import accept_round_reference

    results, bonus, next_starts = accept_round_reference(tokens, starts, drafts)
    assert results[:, 0].tolist() == [3, 0, 1, 3]  # a match after a mismatch counts for nothing
    assert torch.equal(results[:, 1:], tokens)
    assert bonus.tolist() == [7, 4, 2, 9] and next_starts.tolist() == [14, 21, 32, 44]
    capped, bonus, _ = accept_round_reference(tokens, starts, drafts, torch.tensor([1, 3, 0, 2]))
    assert capped[:, 0].tolist() == [1, 0, 0, 2] and bonus.tolist() == [5, 4, 1, 9]
    ar, bonus, next_starts = accept_round_reference(tokens[:, :1], starts)  # k = 0: no drafts
    assert ar[:, 0].tolist() == [0] * 4 and bonus.tolist() == [4, 4, 1, 9] and next_starts.tolist() == [11, 21, 31, 41]


def test_accept_round_says_which_shapes_it_takes():
    from dflash_serve.kernels.accept import accept_round

    tokens, starts = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="drafts \\(2, 2\\)"):
        accept_round(tokens, starts, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="drafts \\(2, 0\\)"):
        accept_round(tokens, starts)  # k = 3 without drafts


@runs_triton
@pytest.mark.parametrize("k", [0, 1, 3, 7, 15])
@pytest.mark.parametrize("limits", [False, True])
def test_accept_round_triton_is_the_reference(k, limits):
    from dflash_serve.kernels.accept import accept_round_reference, accept_round_triton

    for n, strided in ((1, False), (5, True), (33, False)):
        tokens, starts, drafts, caps = _round_case(n, k, seed=31 * k + n, limits=limits, strided=strided)
        expected = accept_round_reference(tokens, starts, drafts, caps)
        on = (lambda t: None if t is None else t.to(DEVICE))
        got = accept_round_triton(on(tokens), on(starts), on(drafts), on(caps))
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == torch.long and torch.equal(g.cpu(), e)
    # Tokens stored column by column, starts and limits every other element of a buffer: copied to unit steps.
    tokens, starts, drafts, caps = _round_case(4, k, seed=k, limits=limits)
    expected = accept_round_reference(tokens, starts, drafts, caps)
    spaced = (lambda t: None if t is None else t.repeat_interleave(2)[::2].to(DEVICE))
    got = accept_round_triton(tokens.t().contiguous().t().to(DEVICE), spaced(starts), on(drafts), spaced(caps))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g.cpu(), e)


# -- sampling (the seeded exponential race) -------------------------------------------------------

SAMPLE_SHAPES = [(1, 1, 7), (3, 2, 4097), (2, 4, 1000), (4, 1, 9000)]  # N, S, V: V past a chunk, partial chunks


def race_inputs(n, s, v, dtype, *, greedy_rows, threshold, seed=0):
    """Random logits (with -inf entries and a tied maximum), temperatures (0 = greedy) and seeds
    over the whole int64 range, positions given as an expanded (stride-0) view, and thresholds at
    each row's 20th largest score (some rows -inf: no truncation)."""
    g = torch.Generator().manual_seed(seed + n * 1000 + s * 100 + v)
    logits = torch.randn(n, s, v, generator=g) * 3
    logits[..., v // 3] = -math.inf
    logits[0, 0, [0, v - 1]] = 20.0  # a tie: a greedy row takes index 0
    logits = logits.to(dtype)
    temperature = torch.rand(n, generator=g) * 1.5 + 0.2
    if greedy_rows:
        temperature[::2] = 0
    seed_ = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    positions = torch.randint(0, 2**40, (n, 1), generator=g).expand(n, s) + torch.arange(s)
    thresholds = None
    if threshold:
        scores = logits.float() / torch.where(temperature == 0, 1, temperature)[:, None, None]
        thresholds = scores.topk(min(20, v), dim=-1).values[..., -1]
        thresholds[:, ::2] = -math.inf
    return logits, temperature, seed_, positions, thresholds


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SAMPLE_SHAPES)
@pytest.mark.parametrize("greedy_rows,threshold", [(False, False), (True, False), (True, True)])
def test_sample_race_triton_matches_reference(dtype, shape, greedy_rows, threshold):
    """Token for token. bfloat16 runs under the interpreter too: the kernel only converts it."""
    from dflash_serve.kernels.sampling import sample_race_reference, sample_race_triton

    inputs = race_inputs(*shape, dtype, greedy_rows=greedy_rows, threshold=threshold)
    expected = sample_race_reference(*[t.to(DEVICE) if t is not None else None for t in inputs])
    got = sample_race_triton(*[t.to(DEVICE) if t is not None else None for t in inputs])
    assert got.shape == shape[:2] and got.dtype == torch.long
    assert torch.equal(got.cpu(), expected.cpu())
    temperature, thresholds = inputs[1], inputs[4]
    if greedy_rows:
        assert got[0, 0] == 0  # the first of the tied maxima
        assert torch.equal(got[temperature == 0].cpu(), inputs[0][temperature == 0].argmax(-1))
    if threshold:  # the truncated rows drew among their 20 largest scores
        scores = inputs[0].float() / torch.where(temperature == 0, 1, temperature)[:, None, None]
        drawn = scores.gather(-1, got.cpu()[..., None])[..., 0]
        sampled = (temperature[:, None] > 0) & torch.isfinite(thresholds)
        assert (drawn[sampled] >= thresholds[sampled]).all()


@runs_triton
def test_sample_race_triton_noise_is_the_reference_hash():
    """The kernel's hash equals the reference's bit for bit (uint32 arithmetic); its float32
    log(-log u) equals torch's on CUDA, and within a few ulps under the interpreter (numpy's log)."""
    from dflash_serve.kernels.sampling import log_exponentials, noise_hash, noise_triton, position_keys

    seed = torch.tensor([0, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0], device=DEVICE)
    positions = torch.tensor([[0, 1, 2**32 + 1], [5, 2**31, 2**40]], device=DEVICE).repeat(3, 1)[:5]
    vocab = 2500 if not ON_CUDA else 151_936
    h, log_e = noise_triton(seed, positions, vocab)
    keys = position_keys(seed, positions).reshape(-1)
    assert torch.equal(h.view(-1, vocab), noise_hash(keys, vocab).long() & 0xFFFFFFFF)  # the reference's int32 bits
    expected = log_exponentials(keys, vocab)
    if ON_CUDA:
        assert torch.equal(log_e.view(-1, vocab), expected)
    else:
        torch.testing.assert_close(log_e.view(-1, vocab), expected, rtol=1e-6, atol=1e-6)


@runs_triton
def test_sample_tokens_triton_path_matches_the_torch_path(monkeypatch):
    """`sample_tokens` on a mixed batch (greedy, plain, top-p alone, top-k + top-p) with the kernel,
    against the same call with the race's reference."""
    from dflash_serve.kernels.sampling import sample_race_reference
    from dflash_serve.services.engine import sampling
    from dflash_serve.services.engine.sampling import SamplingBatch, sample_tokens
    from dflash_serve.services.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 3, 3001, generator=g) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, seed=-5), SamplingParams(temperature=0.7, top_k=30, top_p=0.9),
              SamplingParams(temperature=0, top_k=3)]
    batch = SamplingBatch.build(params, [p.seed or 0 for p in params], DEVICE)
    positions = torch.arange(15, device=DEVICE).view(5, 3) + 100
    got = sample_tokens(logits, batch, positions)
    monkeypatch.setattr(sampling, "sample_race", sample_race_reference)
    assert torch.equal(got, sample_tokens(logits, batch, positions))


@runs_triton
def test_warm_sample_race_triton_launches_every_variant(monkeypatch):
    """Start-up launches the race at every (slot count, column block) a batch of up to max_batch
    sequences can meet, so no request's step compiles one. On CUDA the launches run; under the
    interpreter (no compiling to warm) their shapes are recorded instead: running them took 38 s
    of CI's time, and the kernel itself is checked by the tests above."""
    import dflash_serve.kernels.sampling as sampling_module
    from dflash_serve.kernels import warm_sample_race
    from dflash_serve.kernels.sampling import block_cols

    device = torch.device("cuda" if ON_CUDA else "cpu")
    vocab, slot_counts, max_batch = 5000, (1, 2, 16), 32
    shapes = []
    if not ON_CUDA:
        monkeypatch.setattr(sampling_module, "sample_race_triton", lambda logits, *rest: shapes.append(logits.shape))
    launched = warm_sample_race(vocab, torch.float32, device, slot_counts, max_batch)
    expected = {(s, block_cols(n * s, vocab)) for s in slot_counts for n in range(1, max_batch + 1)}
    assert set(launched) == expected and len(launched) == len(expected)
    assert {block for _, block in launched} == {512, 1024, 2048}  # every block the rows can choose
    if not ON_CUDA:  # each variant launched at a shape that chooses it, with and without a threshold
        assert sorted((s, block_cols(n * s, v)) for n, s, v in shapes) == sorted(launched * 2)


def test_sample_race_dispatch(monkeypatch):
    import dflash_serve.kernels.sampling as module

    calls = []
    monkeypatch.setattr(module, "sample_race_triton", lambda *args: calls.append("triton"))
    monkeypatch.setattr(module, "sample_race_reference", lambda *args: calls.append("reference"))
    x, t, seed, positions = torch.randn(1, 1, 8), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module.sample_race(x, t, seed, positions)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module.sample_race(x, t, seed, positions)
    module.sample_race(x.double(), t, seed, positions)
    assert calls == ["reference", "triton" if TRITON_AVAILABLE else "reference", "reference"]


# -- skinny linear --------------------------------------------------------------------------------

SKINNY_CASES = [  # rows, N, K, bias, (block_n, block_k)
    (1, 40, 96, False, (16, 32)),
    (5, 70, 300, True, (32, 64)),  # a partial column tile, K not a multiple of its block
    (16, 33, 257, True, (16, 128)),
    (3, 64, 64, False, (64, 128)),  # one block wider than K
]


@runs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("rows,n,k,bias,settings", SKINNY_CASES)
def test_skinny_linear_triton_matches_f_linear(dtype, rows, n, k, bias, settings):
    """Equal to F.linear in float64; on CUDA also when replayed from a CUDA graph with new inputs."""
    from dflash_serve.kernels.skinny_linear import LaunchSettings, SkinnyLinear

    g = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    layer = SkinnyLinear(weight, b, LaunchSettings(*settings))

    def reference(x):
        return torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())

    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    assert relative_error(layer(x), reference(x)) < TOLERANCE[dtype]
    if ON_CUDA:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(x)
        for _ in range(2):
            x.copy_(torch.randn(rows, k, generator=g).to(dtype))
            graph.replay()
            assert relative_error(static_out, reference(x)) < TOLERANCE[dtype]


def test_skinny_linear_takes_f_linear_off_the_kernel_path(monkeypatch):
    """More than MAX_ROWS rows, a strided input, float32 on CUDA (TF32 products), a CPU tensor
    without the interpreter: exactly F.linear."""
    from dflash_serve.kernels import skinny_linear as module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    layer = module.SkinnyLinear(torch.randn(8, 64, generator=g).to(DEVICE), torch.randn(8, generator=g).to(DEVICE))
    inputs = [torch.randn(module.MAX_ROWS + 1, 64, generator=g), torch.randn(64, 4, generator=g).t(),
              torch.randn(2, 3, 64, generator=g)]
    for x in inputs:
        x = x.to(DEVICE)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_skinny_linear_settings_by_shape():
    """The rule fitted to the H100 measurements (BENCHMARKS.md), at Qwen3-8B's projections and head."""
    from dflash_serve.kernels.skinny_linear import LaunchSettings

    for n, k in [(4096, 4096), (4096, 12288)]:  # Qwen3-8B's O, down
        assert LaunchSettings.for_shape(n, k) == LaunchSettings(32, 256)
    for n, k in [(6144, 4096), (24576, 4096), (151936, 4096)]:  # its QKV, gate-up, LM head
        assert LaunchSettings.for_shape(n, k) == LaunchSettings(64, 256)
    for n, k in [(960, 576), (49152, 576)]:  # SmolLM2's QKV, LM head
        assert LaunchSettings.for_shape(n, k) == LaunchSettings(32, 128)
