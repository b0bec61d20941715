"""The batch-invariant kernels of `engine.deterministic`: a row's bits do not depend on the rows beside it.

GEMM: a row computed alone and inside batches of 1, 16 and 512 rows (at every place in them).
Attention: a query row computed in a decode (1 query), a verify (16), a prefill chunk (the whole
prompt), alone and beside other sequences, with the keys split over 1, 2 or 4 programs; with keys
derived from the cached values (Gemma-4's k_eq_v layers, in their geometry), and with the table
entries before every window stale (window slots given up). Both the
torch references (the CPU path) and the Triton kernels (on CUDA, else under the interpreter in a
child pytest, as tests/unit/test_kernels.py does) are held to the same bits, and to the float64
definitions within the usual tolerances.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_serve.kernels.invariant_attention import (
    choose_num_splits,
    paged_attention_invariant,
    paged_attention_invariant_reference,
    paged_attention_invariant_triton,
)
from dflash_serve.kernels.invariant_linear import InvariantLinear, InvariantSettings, Tile, invariant_linear_reference
from dflash_serve.kernels.paged_attention import derive_keys, paged_attention_reference
from tests.interpreter import use_row_invariant_dot
from tests.unit.test_kernels import (
    DEVICE,
    ON_CUDA,
    TOLERANCE,
    TRITON_AVAILABLE,
    TRITON_DTYPES,
    TRITON_RUNS_HERE,
    paged_kv,
    relative_error,
    runs_triton,
)

use_row_invariant_dot()

invariant_attention = importlib.import_module("dflash_serve.kernels.invariant_attention")
REFERENCE_DTYPES = [torch.float32, torch.bfloat16]


# -- GEMM -----------------------------------------------------------------------------------------


def batch_starts(row: int, size: int, n: int) -> list[int]:
    """Where batches of `size` of n rows begin that hold `row` first, last, and at row % size."""
    return sorted({row - place for place in (0, size - 1, row % size) if 0 <= row - place <= n - size})


def assert_rows_have_the_same_bits(linear, x: torch.Tensor, rows=(0, 5, 63, 64, 200, 511)) -> None:
    """Each row alone (a batch of 1) equals the same row in batches of 16 and 512, bit for bit."""
    for row in rows:
        alone = linear(x[row : row + 1])[0]
        for size in (16, 512):
            for start in batch_starts(row, size, x.shape[0]):
                place = row - start
                assert torch.equal(linear(x[start : start + size])[place], alone), f"row {row}, place {place} of {size}"


def linear_case(dtype, *, n=70, k=300, bias=True, device="cpu", seed=0):
    """A weight whose N and K are not multiples of any tile, and 512 rows of input."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    x = torch.randn(512, k, generator=g).to(dtype).to(device)
    return weight, b, x


def float64_linear(x, weight, bias):
    return torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("dtype", REFERENCE_DTYPES, ids=str)
def test_invariant_linear_reference_gives_a_row_the_same_bits_alone_and_in_batches_of_1_16_512(dtype):
    weight, bias, x = linear_case(dtype)

    def reference(rows):
        return invariant_linear_reference(rows, weight, bias)

    assert_rows_have_the_same_bits(reference, x)
    assert relative_error(reference(x), float64_linear(x, weight, bias)) < TOLERANCE[dtype]
    assert reference(x.view(2, 256, -1)).shape == (2, 256, weight.shape[0])


# Every dtype with and without a bias, K in one chain and in three ranges, in two of the four pairings
# (the interpreter takes ~5 s a case).
# The ranges' case also gives launches of MANY_ROWS rows or more other tiles, each program walking every range.
LINEAR_CASES = [(dtype, bias, split_k) for dtype in TRITON_DTYPES for bias, split_k in ((False, 1), (True, 3))]


@runs_triton
@pytest.mark.parametrize("dtype,bias,split_k", LINEAR_CASES, ids=str)
def test_invariant_linear_triton_gives_a_row_the_same_bits_alone_and_in_batches_of_1_16_512(dtype, bias, split_k):
    """K in one chain, and in three ranges (the last one shorter) added in order: by programs of
    their own and a second launch at 1 and 16 rows, by each program in turn at 512."""
    weight, b, x = linear_case(dtype, bias=bias, device=DEVICE)
    many_rows = Tile(block_m=128, block_n=64) if split_k > 1 else None
    layer = InvariantLinear(weight, b, InvariantSettings(block_m=64, block_n=32, block_k=32, split_k=split_k,
                                                         many_rows=many_rows))
    assert_rows_have_the_same_bits(layer, x)
    assert relative_error(layer(x), float64_linear(x, weight, b)) < TOLERANCE[dtype]
    strided = x.t().contiguous().t()  # the same values, not contiguous along K
    assert torch.equal(layer(strided), layer(x))


def test_invariant_linear_takes_the_reference_off_the_kernel_path(monkeypatch):
    """A CPU tensor without the interpreter (or float64 anywhere): the per-row reference."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for dtype, device in [(torch.float32, "cpu"), (torch.float64, DEVICE)]:
        weight, bias, x = linear_case(dtype, device=device)
        assert torch.equal(InvariantLinear(weight, bias)(x[:20]), invariant_linear_reference(x[:20], weight, bias))


def test_invariant_linear_settings_follow_the_weight_shape_only():
    """Qwen3-8B's projections: O and QKV (K 4096) split K in 4, down (K 12288) in 8, gate-up and the
    LM head (wide) not at all; SmolLM2's (K ≤ 1536) take small row tiles and no split."""
    split = {name: InvariantSettings.for_shape(n, k).split_k
             for name, (n, k) in {"o": (4096, 4096), "down": (4096, 12288), "qkv": (6144, 4096),
                                  "gate_up": (24576, 4096), "lm_head": (151936, 4096)}.items()}
    assert split == {"o": 4, "down": 8, "qkv": 4, "gate_up": 1, "lm_head": 1}
    small = InvariantSettings.for_shape(960, 576)
    assert (small.block_m, small.split_k) == (32, 1) and InvariantSettings.for_shape(49152, 576).split_k == 1


# -- attention ------------------------------------------------------------------------------------

# Sequences of one paged cache: A is the sequence under test (its queries appear in every call),
# B and C sit beside it in some calls. A spans several chunks when KEYS_PER_CHUNK is 128.
SEQ_LENS = {"A": 300, "B": 70, "C": 460}
NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 4, 32, 16
WINDOWS = [(True, None), (False, None), (True, 100), (False, 70)]


class Sequences:
    """Paged K/V for sequences of `lengths` and a query per position of each, so that the same
    position's query is the same tensor in a decode, a verify and a prefill call.

    `derived_keys`: the cache holds values only (k_cache None) and `keys_from_values` derives the
    keys (a key norm weight and a RoPE table of the head size); `written_k_cache` holds the keys
    that writing each derived key at its position would have stored."""

    def __init__(self, dtype, device, *, lengths=SEQ_LENS, num_kv_heads=NUM_KV_HEADS, group=GROUP,
                 head_dim=HEAD_DIM, derived_keys=False):
        g = torch.Generator().manual_seed(0)
        k_cache, v_cache, block_tables = paged_kv(list(lengths.values()), num_kv_heads=num_kv_heads,
                                                  head_dim=head_dim, block_size=BLOCK_SIZE, generator=g)
        self.lengths = lengths
        self.index = {name: i for i, name in enumerate(lengths)}
        self.k_cache, self.v_cache = k_cache.to(dtype).to(device), v_cache.to(dtype).to(device)
        self.block_tables = block_tables.to(device)
        self.queries = {name: torch.randn(n, num_kv_heads * group, head_dim, generator=g, dtype=torch.float64)
                        .to(dtype).to(device) for name, n in lengths.items()}
        self.keys_from_values = None
        if derived_keys:
            weight = 1 + 0.3 * torch.randn(head_dim, generator=g)
            inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            freqs = torch.arange(max(lengths.values())).float()[:, None] * inv_freq[None]
            self.keys_from_values = (weight.to(device), freqs.cos().to(dtype).to(device),
                                     freqs.sin().to(dtype).to(device))
            self.written_k_cache = torch.full_like(self.v_cache, float("nan"))
            for i, n in enumerate(lengths.values()):
                positions = torch.arange(n, device=device)
                slots = self.block_tables[i, positions // BLOCK_SIZE].long(), positions % BLOCK_SIZE
                self.written_k_cache[slots] = derive_keys(self.v_cache[slots], positions, self.keys_from_values)
            self.k_cache = None

    def call(self, parts: list[tuple[str, int]]):
        """Inputs of one attention call over `parts`: (sequence, its last q_len positions as queries)."""
        rows = [self.index[name] for name, _ in parts]
        q = torch.cat([self.queries[name][self.lengths[name] - q_len :] for name, q_len in parts])
        q_lens = torch.tensor([q_len for _, q_len in parts])
        query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
        seq_lens = torch.tensor([self.lengths[name] for name, _ in parts], dtype=torch.int32)
        device = q.device
        return (q, self.k_cache, self.v_cache, self.block_tables[rows], seq_lens.to(device), query_start.to(device))


# Calls that each hold A's last query (position 299), several hold its last 16.
CALLS = {
    "decode-alone": [("A", 1)],
    "decode-beside-others": [("C", 1), ("A", 1), ("B", 1)],
    "verify-alone": [("A", 16)],
    "verify-beside-others": [("B", 16), ("A", 16), ("C", 5)],
    "prefill-whole-prompt": [("A", 300)],
    "prefill-chunk-beside-a-verify": [("C", 16), ("A", 40)],
}


def rows_of_a(out, parts, last: int) -> torch.Tensor:
    """A's output rows of its last `last` positions, from a call's output."""
    begin = 0
    for name, q_len in parts:
        if name == "A":
            return out[begin + q_len - last : begin + q_len]
        begin += q_len
    raise AssertionError("A is not in the call")


def assert_a_rows_agree_across_calls(attend, sequences: Sequences, options: dict, calls=CALLS) -> None:
    """A's last row has the same bits in every call, its last 16 in every call holding them;
    `calls` has a "decode-alone" and a "verify-alone" call."""
    outputs = {name: attend(*sequences.call(parts), **options) for name, parts in calls.items()}
    last_row = {name: rows_of_a(out, calls[name], 1) for name, out in outputs.items()}
    for name, row in last_row.items():
        assert torch.equal(row, last_row["decode-alone"]), name
    last_16 = {name: rows_of_a(out, calls[name], 16) for name, out in outputs.items()
               if min(q_len for seq, q_len in calls[name] if seq == "A") >= 16}
    for name, rows in last_16.items():
        assert torch.equal(rows, last_16["verify-alone"]), name


@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("dtype", REFERENCE_DTYPES, ids=str)
def test_invariant_attention_reference_gives_a_row_the_same_bits_in_decode_verify_and_prefill(dtype, causal, window):
    sequences = Sequences(dtype, "cpu")
    options = dict(scale=HEAD_DIM**-0.5, causal=causal, window=window)
    assert_a_rows_agree_across_calls(paged_attention_invariant_reference, sequences, options)
    inputs = sequences.call(CALLS["verify-beside-others"])
    definition = paged_attention_reference(*(t.double() if t.is_floating_point() else t for t in inputs), **options)
    assert relative_error(paged_attention_invariant_reference(*inputs, **options), definition) < TOLERANCE[dtype]


@runs_triton
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
def test_invariant_attention_triton_gives_a_row_the_same_bits_in_decode_verify_and_prefill(
        monkeypatch, dtype, causal, window):
    """Chunks of 128 keys (A spans three), the split chosen by the shapes and forced to 1, 2 and 4
    programs per query tile: the same bits everywhere, and the float64 definition's values."""
    monkeypatch.setattr(invariant_attention, "KEYS_PER_CHUNK", 128)
    sequences = Sequences(dtype, DEVICE)
    options = dict(scale=HEAD_DIM**-0.5, causal=causal, window=window)
    assert_a_rows_agree_across_calls(paged_attention_invariant_triton, sequences, options)
    inputs = sequences.call(CALLS["verify-beside-others"])
    by_split = [paged_attention_invariant_triton(*inputs, **options, max_query_len=16, num_splits=splits)
                for splits in (1, 2, 4)]
    assert all(torch.equal(out, by_split[0]) for out in by_split[1:])
    definition = paged_attention_reference(*(t.double().cpu() if t.is_floating_point() else t.cpu() for t in inputs),
                                           **options)
    assert relative_error(by_split[0], definition) < TOLERANCE[dtype]


def with_blocks_before_the_window_stale(inputs, window: int):
    """A call's inputs with each sequence's table entries of blocks wholly before its first query's
    window pointed at a block of NaN, as a window slot's entry is once its block gave up the slot
    (`BlockAllocator`): no query sees those keys, and none may read them."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start = inputs
    stale = block_tables.clone()
    nan_block = int(block_tables[0, -1])  # paged_kv's table padding
    bounds = query_start.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first_seen = max(0, seq_len - (bounds[i + 1] - bounds[i]) - window + 1)
        stale[i, : first_seen // BLOCK_SIZE] = nan_block
    return q, k_cache, v_cache, stale, seq_lens, query_start


STALE_CALLS = ["decode-alone", "verify-alone", "verify-beside-others"]


@pytest.mark.parametrize("causal,window", [w for w in WINDOWS if w[1] is not None])
def test_invariant_attention_reference_reads_no_key_before_the_window(causal, window):
    sequences = Sequences(torch.bfloat16, "cpu")
    options = dict(scale=HEAD_DIM**-0.5, causal=causal, window=window)
    for name in STALE_CALLS:
        inputs = sequences.call(CALLS[name])
        stale = paged_attention_invariant_reference(*with_blocks_before_the_window_stale(inputs, window), **options)
        assert torch.equal(stale, paged_attention_invariant_reference(*inputs, **options)), name


@runs_triton
@pytest.mark.parametrize("causal,window", [w for w in WINDOWS if w[1] is not None])
def test_invariant_attention_triton_reads_no_key_before_the_window(monkeypatch, causal, window):
    """Key tiles start at a multiple of 64 keys below the window (A's verify: the window opens at
    185, the tile at 128, three blocks earlier): those keys must not be loaded, not merely masked,
    since 0 · NaN is NaN. Split over 1 and 2 programs."""
    monkeypatch.setattr(invariant_attention, "KEYS_PER_CHUNK", 128)
    sequences = Sequences(torch.float16, DEVICE)
    options = dict(scale=HEAD_DIM**-0.5, causal=causal, window=window)
    for name in STALE_CALLS:
        inputs = sequences.call(CALLS[name])
        for splits in (1, 2):
            stale = paged_attention_invariant_triton(*with_blocks_before_the_window_stale(inputs, window), **options,
                                                     num_splits=splits)
            assert torch.equal(stale, paged_attention_invariant_triton(*inputs, **options, num_splits=splits)), name


# Gemma-4 31B's global layers at toy size (1 KV head of 16 for 4 query heads), and the tests' usual geometry.
DERIVED_KEY_GEOMETRIES = {"one-kv-head-of-16": dict(num_kv_heads=1, group=4, head_dim=16), "two-kv-heads-of-32": {}}


@pytest.mark.parametrize("causal,window", [(True, None), (True, 100)])
@pytest.mark.parametrize("geometry", list(DERIVED_KEY_GEOMETRIES))
def test_invariant_attention_reference_with_keys_derived_from_values(geometry, causal, window):
    """Keys derived from the cached values (k_eq_v): a row has the same bits in every call, and
    they are those of attention over the keys that writing them would have stored."""
    sequences = Sequences(torch.bfloat16, "cpu", derived_keys=True, **DERIVED_KEY_GEOMETRIES[geometry])
    head_dim = sequences.v_cache.shape[-1]
    options = dict(scale=head_dim**-0.5, causal=causal, window=window)
    assert_a_rows_agree_across_calls(paged_attention_invariant_reference, sequences,
                                     dict(options, keys_from_values=sequences.keys_from_values))
    q, _, v_cache, *rest = sequences.call(CALLS["verify-beside-others"])
    derived = paged_attention_invariant_reference(q, None, v_cache, *rest, **options,
                                                  keys_from_values=sequences.keys_from_values)
    assert torch.equal(derived, paged_attention_invariant_reference(q, sequences.written_k_cache, v_cache, *rest,
                                                                    **options))


@runs_triton
@pytest.mark.parametrize("causal,window", [(True, None), (True, 100)])
@pytest.mark.parametrize("geometry", list(DERIVED_KEY_GEOMETRIES))
def test_invariant_attention_triton_with_keys_derived_from_values(monkeypatch, geometry, causal, window):
    """The kernel deriving keys tile by tile: a row's bits the same in every call and over 1, 2
    and 4 programs, and the float64 definition's values over the keys writing would store."""
    monkeypatch.setattr(invariant_attention, "KEYS_PER_CHUNK", 128)
    sequences = Sequences(torch.float16, DEVICE, derived_keys=True, **DERIVED_KEY_GEOMETRIES[geometry])
    head_dim = sequences.v_cache.shape[-1]
    options = dict(scale=head_dim**-0.5, causal=causal, window=window, keys_from_values=sequences.keys_from_values)
    assert_a_rows_agree_across_calls(paged_attention_invariant_triton, sequences, options)
    inputs = sequences.call(CALLS["verify-beside-others"])
    by_split = [paged_attention_invariant_triton(*inputs, **options, num_splits=splits) for splits in (1, 2, 4)]
    assert all(torch.equal(out, by_split[0]) for out in by_split[1:])
    q, _, v_cache, *rest = (None if t is None else t.cpu() for t in inputs)
    definition = paged_attention_reference(q.double(), sequences.written_k_cache.double().cpu(), v_cache.double(),
                                           *rest, scale=options["scale"], causal=causal, window=window)
    assert relative_error(by_split[0], definition) < TOLERANCE[torch.float16]


def test_invariant_attention_dispatch(monkeypatch):
    """The reference on a CPU tensor without the interpreter, and for float64 anywhere."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sequences = Sequences(torch.float64, DEVICE)
    inputs = sequences.call(CALLS["verify-beside-others"])
    options = dict(scale=HEAD_DIM**-0.5, causal=True, window=None)
    assert torch.equal(paged_attention_invariant(*inputs, **options),
                       paged_attention_invariant_reference(*inputs, **options))


def test_invariant_attention_splits_only_where_tiles_are_few_and_partials_fit(monkeypatch):
    """One program per query tile when the tiles fill half a wave, when a context fits one chunk
    or the partials would pass the budget; otherwise a power of two, at most one per chunk."""
    monkeypatch.setattr(invariant_attention, "_num_sms", lambda device: 132)  # an H100's
    slots = invariant_attention.PROGRAMS_PER_SM * 132
    cpu = torch.device("cpu")
    assert choose_num_splits(slots // 2 + 1, 80, 1 << 20, cpu) == 1
    assert choose_num_splits(8, 1, 1 << 20, cpu) == 1
    assert choose_num_splits(8, 80, invariant_attention.PARTIALS_BUDGET + 1, cpu) == 1
    for tiles in range(1, slots // 2 + 1):
        for chunks in (2, 3, 17, 80):
            splits = choose_num_splits(tiles, chunks, 1 << 20, cpu)
            assert splits & (splits - 1) == 0 and splits <= chunks and (splits == 1 or tiles * splits <= slots)


@pytest.mark.skipif(ON_CUDA or TRITON_RUNS_HERE or not TRITON_AVAILABLE,
                    reason="the Triton tests run in this process (CUDA or TRITON_INTERPRET=1), or triton is absent")
def test_interpreted_invariant_kernels_in_a_child_pytest():
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
