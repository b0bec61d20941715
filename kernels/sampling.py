"""Seeded sampling in one fused pass over the logits: the exponential race with counter-based noise.

For each row (request n, slot s) of logits [N, S, V] this picks

    argmax_v  logits[v] / T_n  -  log(-log u_v)      (greedy rows, T_n = 0: argmax_v logits[v])

where u_v in (0, 1) comes from an integer hash of (seed_n, positions[n, s], v), and scores below
the row's threshold (top-k / top-p, computed by the caller) are excluded. argmax_v p_v / E_v with
E_v = -log u_v ~ Exp(1) picks v with probability p_v = softmax(logits / T)_v; in log space no
softmax is needed. Ties go to the first index, as torch.argmax.

The noise (the contract of `dflash_serve.services.engine.sampling`): per (seed, position) a 32-bit
key (`position_keys`), per vocabulary index a 32-bit code (`vocab_codes`), h = mix32(code ^ key),
u = ((h >> 9) + 0.5) * 2^-23 (exact in float32, never 0 or 1), noise = log(-log u) in float32. The
hash is uint32 arithmetic (the reference keeps uint32 values in int64 lanes and masks after each
multiply; Triton's uint32 multiply wraps mod 2^32), so h is bit-identical on every device and in
both paths. The scores are logits.float() / T correctly rounded (`div_rn` in the kernel, as torch's
division), so a caller's top-k / top-p threshold computed in torch from the same division compares
against the very same values.

What may differ between the paths is the float32 `log`: torch's (on CPU, SLEEF or glibc; on CUDA,
CUDA's logf) and Triton's (on CUDA libdevice's __nv_logf, under the interpreter numpy's, which is
several ulps off torch's CPU log on ~20% of inputs) need not round alike. A noise value off by an
ulp or a few changes the drawn token only where two candidates' race scores are within those ulps
of each other: a near-tie, of negligible probability, and the draw is still an exact sample of the
distribution. Seeded reproducibility (the same token at the same position whether decoded alone,
target-only, or in a speculative round of any size and batch) holds because every call on one
device takes the same path: the kernel on CUDA, the reference on CPU.

Kernel design: two passes, as `row_argmax`. Pass 1 has one program per (row, chunk of BLOCK
columns): it loads the chunk, computes the row's key from (seed, position) in scalar registers,
hashes each column, and reduces to the chunk's best score and its first index; greedy rows branch
around the hash and the logs. Pass 2 (`row_argmax`'s pick kernel) takes, per row, the first chunk
holding the row's maximum. So a sampling call is two launches whatever the mix of greedy and
sampling rows, with no [R, V] temporary; a single 152k row spreads over 297 programs (`block_cols`).

Measured on an H100 (`python -m dflash_serve.services.bench.sampling`, bf16 logits, T = 1, device
time in a CUDA graph): 1 × 49152 in 4.0 µs against 111 for the torch reference (its int64 hash of
then), 512 × 151936 (a batch-32 round of Qwen) in 301 µs against 8.1 ms; 17–28× throughout, where
`row_argmax` takes 3.5 and 57 µs. The race is arithmetic-bound at large batches, not memory-bound
like the argmax.

`sample_race_reference` is the plain-torch version (the CPU path and the test oracle); it works on
chunks of rows that fit a core's L2 cache (`CHUNK_ELEMENTS`), so 512 rows of a 152k vocabulary
never need gigabytes of scratch either.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from dflash_serve.kernels.argmax import _pick_chunk_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9

# The reference's rows per chunk are chosen so that each [rows, V] temporary holds at most this many
# elements (1 MiB as int32): its dozen passes over a chunk then run in a core's L2 cache. On this
# repository's 2-core box, 128 rows of a 49k vocabulary took 104 ms in chunks of 2^24 elements with an
# int64 hash, and 24 ms in chunks of 2^18 with the int32 hash and one argmax a row (BENCHMARKS.md).
CHUNK_ELEMENTS = 1 << 18


def sample_race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [N, S, V] (fp32/fp16/bf16), temperature [N] float32 (0 = greedy request), seed [N]
    int64, positions [N, S] int64 (the absolute position each row's token will occupy),
    threshold [N, S] float32 or None (scores logits / T below it are excluded; -inf keeps all)
    -> tokens [N, S] int64.

    Triton on CUDA (or under TRITON_INTERPRET=1) for floating logits, else the reference."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is not None and (logits.is_cuda or interpret) and logits.dtype in (torch.float16, torch.bfloat16,
                                                                                 torch.float32):
        return sample_race_triton(logits, temperature, seed, positions, threshold)
    return sample_race_reference(logits, temperature, seed, positions, threshold)


def sample_race_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    n, s, v = logits.shape
    flat = logits.reshape(n * s, v)
    keys = position_keys(seed, positions).reshape(-1)
    temperature = temperature.repeat_interleave(s)
    greedy = temperature == 0
    divisor = torch.where(greedy, 1.0, temperature)  # a greedy row's race is computed, then replaced
    rows_threshold = None if threshold is None else threshold.reshape(-1)
    tokens = torch.empty(n * s, dtype=torch.long, device=logits.device)
    chunk = max(1, CHUNK_ELEMENTS // max(v, 1))
    for start in range(0, n * s, chunk):
        part = slice(start, start + chunk)
        rows = flat[part]
        scores = rows / divisor[part, None]  # float32: the [R, 1] float32 divisor promotes bf16 rows
        if rows_threshold is not None:
            scores.masked_fill_(scores < rows_threshold[part, None], -math.inf)
        scores -= log_exponentials(keys[part], v)
        tokens[part] = scores.max(dim=1).indices  # the first maximum, as argmax, and faster on CPU
    greedy_rows = greedy.nonzero()[:, 0]
    if greedy_rows.numel():
        tokens[greedy_rows] = flat[greedy_rows].argmax(dim=1)
    return tokens.view(n, s)


# --- counter-based noise (the reference) ---------------------------------------------------------
# Keys are uint32 values in int64 lanes, masked after every multiply. The [R, V] hash, the reference's
# bulk, runs on their bit patterns in int32 lanes: torch's int32 multiply wraps mod 2^32 (two's
# complement, on CPU and CUDA) as uint32's does, and right shifts are masked to be logical. Both give
# the hash bit for bit (`test_sampling.py` checks them against plain Python integers); int32 halves
# the bytes each pass moves, which makes the CPU path's hash twice as fast.


def _shift_right(h: torch.Tensor, bits: int) -> torch.Tensor:
    """h >> bits of uint32 values: int64 lanes shift in zeros; int32 lanes are masked."""
    shifted = h >> bits
    return shifted if h.dtype == torch.int64 else shifted.bitwise_and_((1 << (32 - bits)) - 1)


def mix32_(h: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) with full avalanche, in place on int64 lanes (uint32 values) or int32
    lanes (their bit patterns): xorshift-multiply with constants [16 604baa5d 15 43d6ce97 15] from
    hash-prospector (lower bias than MurmurHash3's finaliser). Both multipliers are < 2^31, so in
    int64 lanes h * c < 2^63 never overflows."""
    wide = h.dtype == torch.int64
    for bits, multiplier in ((16, 0x604BAA5D), (15, 0x43D6CE97)):
        h ^= _shift_right(h, bits)
        h *= multiplier
        if wide:
            h &= MASK32
    h ^= _shift_right(h, 15)
    return h


def position_keys(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seed [N] int64, positions [N, S] -> one 32-bit key per (request, position), int64.
    For a fixed seed, distinct positions get distinct keys."""
    key = mix32_((seed & MASK32) ^ GOLDEN32)
    key = mix32_(key ^ ((seed >> 32) & MASK32))
    return mix32_(key[:, None] ^ (positions & MASK32))


@functools.lru_cache(maxsize=8)
def vocab_codes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] distinct pseudo-random 32-bit codes of the vocabulary indices (a Weyl step, then mixed), as
    int32 bit patterns."""
    codes = mix32_(torch.arange(vocab_size, dtype=torch.long, device=device) * GOLDEN32 & MASK32)
    return _bit_patterns(codes)


def _bit_patterns(values: torch.Tensor) -> torch.Tensor:
    """uint32 values in int64 lanes -> the same 32 bits in int32 lanes."""
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def noise_hash(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R] keys (int64) -> [R, V] int32: the bit patterns of the 32-bit hash h of (key, v)."""
    return mix32_(vocab_codes(vocab_size, keys.device)[None, :] ^ _bit_patterns(keys)[:, None])


def log_exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R] keys -> [R, V] float32 log E, E = -log u, u uniform in (0, 1) from hash(key, v)."""
    # 23 bits: (k + 0.5) / 2^23 is exact in float32 and lies in [2^-24, 1 - 2^-24], so u is never
    # 0 or 1 (E never 0 or inf).
    h = _shift_right(noise_hash(keys, vocab_size), 9)
    return h.float().add_(0.5).mul_(2.0**-23).log_().neg_().log_()


# --- Triton ---------------------------------------------------------------------------------------


def block_cols(rows: int, vocab: int) -> int:
    """Columns per pass-1 program. The race is bound by its arithmetic (two hashes, a division and two
    logs per element), not by the logits' bytes: on an H100 2048 beat 4096 by 15% at 512 rows and
    1024 / 512 keep a few rows spread over many SMs (1 × 49152: 3.7 µs at 512, 7.4 at 4096)."""
    for block in (2048, 1024):
        if rows * triton.cdiv(vocab, block) >= 1024:
            return block
    return 512


def sample_race_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    n, s, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    assert temperature.shape == (n,) and seed.shape == (n,) and positions.shape == (n, s)
    assert temperature.dtype == torch.float32 and seed.dtype == torch.long and positions.dtype == torch.long
    if threshold is not None:
        assert threshold.shape == (n, s) and threshold.dtype == torch.float32
        threshold = threshold.contiguous()
    out = torch.empty(n * s, dtype=torch.long, device=logits.device)
    if n * s and vocab:
        block = block_cols(n * s, vocab)
        chunks = triton.cdiv(vocab, block)
        chunk_max = torch.empty(n * s, chunks, dtype=torch.float32, device=logits.device)
        chunk_index = torch.empty(n * s, chunks, dtype=torch.long, device=logits.device)
        _chunk_race_kernel[(n * s, chunks)](
            logits, temperature, seed, positions, threshold if threshold is not None else temperature,
            chunk_max, chunk_index, vocab, s, logits.stride(0), logits.stride(1), positions.stride(0),
            positions.stride(1), HAS_THRESHOLD=threshold is not None, NUM_CHUNKS=chunks, BLOCK=block, num_warps=4,
        )
        _pick_chunk_kernel[(n * s,)](
            chunk_max, chunk_index, out, NUM_CHUNKS=chunks, BLOCK_CHUNKS=triton.next_power_of_2(chunks), num_warps=1,
        )
    return out.view(n, s)


def warm_sample_race(vocab: int, dtype: torch.dtype, device: torch.device, slot_counts, max_batch: int) -> list:
    """Launch the race once for every variant a server can meet, so that Triton compiles them at
    start-up and not in a request's first sampled step (~0.3 s each on the H100, measured as a
    TTFT stall in BENCHMARKS.md). A variant is a slot count S (1: prefill and target-only steps;
    k + 1: a round of k drafts), the column block its row count N × S chooses (`block_cols`), and
    with or without a truncation threshold. Returns the (S, block) pairs launched."""
    launched = []
    for s in sorted(set(slot_counts)):
        for n in range(1, max_batch + 1):
            variant = (s, block_cols(n * s, vocab))
            if variant in launched:
                continue
            launched.append(variant)
            logits = torch.zeros(n, s, vocab, dtype=dtype, device=device)
            temperature = torch.ones(n, dtype=torch.float32, device=device)
            seed = torch.zeros(n, dtype=torch.long, device=device)
            positions = torch.zeros(n, s, dtype=torch.long, device=device)
            for threshold in (None, torch.full((n, s), -math.inf, dtype=torch.float32, device=device)):
                sample_race_triton(logits, temperature, seed, positions, threshold)
    return launched


def noise_triton(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's noise, written out (for tests): seed [N], positions [N, S] -> the hash h [N, S, V]
    int64 and log E [N, S, V] float32, as `noise_hash` and `log_exponentials` of `position_keys`."""
    n, s = positions.shape
    h = torch.empty(n, s, vocab, dtype=torch.long, device=positions.device)
    log_e = torch.empty(n, s, vocab, dtype=torch.float32, device=positions.device)
    if n * s and vocab:
        _noise_kernel[(n * s, triton.cdiv(vocab, 1024))](
            seed, positions, h, log_e, vocab, s, positions.stride(0), positions.stride(1), BLOCK=1024,
        )
    return h, log_e


if triton is not None:

    @triton.jit
    def _mix32(h):
        # uint32 in, uint32 out: the shifts are logical and the multiplies wrap mod 2^32.
        h ^= h >> 16
        h *= 0x604BAA5D
        h ^= h >> 15
        h *= 0x43D6CE97
        h ^= h >> 15
        return h

    @triton.jit
    def _row_key(seed_ptr, positions_ptr, request, slot, stride_pos_request, stride_pos_slot):
        seed = tl.load(seed_ptr + request)
        position = tl.load(positions_ptr + request * stride_pos_request + slot * stride_pos_slot)
        key = _mix32(seed.to(tl.uint32) ^ 0x9E3779B9)  # int64 -> uint32 keeps the low 32 bits
        key = _mix32(key ^ (seed >> 32).to(tl.uint32))
        return _mix32(key ^ position.to(tl.uint32))

    @triton.jit
    def _hash(cols, key):
        return _mix32(_mix32(cols.to(tl.uint32) * 0x9E3779B9) ^ key)

    @triton.jit
    def _log_exponential(h):
        u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23: exact
        return tl.log(-tl.log(u))

    @triton.jit
    def _chunk_race_kernel(logits_ptr, temperature_ptr, seed_ptr, positions_ptr, threshold_ptr,
                           chunk_max_ptr, chunk_index_ptr, vocab, slots, stride_request, stride_slot,
                           stride_pos_request, stride_pos_slot,
                           HAS_THRESHOLD: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        request = row // slots
        slot = row % slots
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        scores = tl.load(logits_ptr + request * stride_request + slot * stride_slot + cols, mask=cols < vocab,
                         other=float("-inf")).to(tl.float32)
        temperature = tl.load(temperature_ptr + request)
        if temperature != 0:  # greedy rows (T = 0) take the plain argmax
            key = _row_key(seed_ptr, positions_ptr, request, slot, stride_pos_request, stride_pos_slot)
            scores = tl.math.div_rn(scores, temperature)  # correctly rounded, as torch's division
            if HAS_THRESHOLD:
                scores = tl.where(scores < tl.load(threshold_ptr + row), float("-inf"), scores)
            scores = scores - _log_exponential(_hash(cols, key))
        best, index = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(chunk_max_ptr + row * NUM_CHUNKS + chunk, best)
        tl.store(chunk_index_ptr + row * NUM_CHUNKS + chunk, chunk * BLOCK + index)

    @triton.jit
    def _noise_kernel(seed_ptr, positions_ptr, h_ptr, log_e_ptr, vocab, slots, stride_pos_request,
                      stride_pos_slot, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        h = _hash(cols, _row_key(seed_ptr, positions_ptr, row // slots, row % slots, stride_pos_request,
                                 stride_pos_slot))
        tl.store(h_ptr + row * vocab + cols, h.to(tl.int64), mask=cols < vocab)
        tl.store(log_e_ptr + row * vocab + cols, _log_exponential(h), mask=cols < vocab)
