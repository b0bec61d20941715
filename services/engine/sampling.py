"""Target sampling and draft acceptance (spec §3.2).

The target samples every block slot; a draft is accepted while it equals the target's sample at
that position, so every emitted token is a target sample and the output is distributed exactly as
target-only decoding. Beyond that, a seeded request *reproduces* target-only decoding: the draw for
a request at absolute position p is a pure function of (seed, p, logits row). Its noise comes from
a counter-based integer hash instead of a device RNG, so neither batch composition, nor the block
size, nor how many drafts were accepted changes what is sampled.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_serve.kernels import row_argmax
from dflash_serve.services.engine.transfer import to_device

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping parameters (OpenAI / vLLM names)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings
    ignore_eos: bool = False
    # At most this many draft tokens of each round verified for this request (0: no speculation,
    # as target-only decoding; None: as many as the engine chooses). The output is the same.
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        # Requests arrive as JSON: lists become tuples (hashable), and a bare string is one stop
        # string, not a tuple of characters.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, *, max_tokens_limit: int | None = None) -> None:
        """Raises ValueError saying which field is wrong and what values it accepts."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens must be <= {max_tokens_limit}, got {self.max_tokens}")
        for i, text in enumerate(self.stop):
            if not text:
                raise ValueError(f"stop strings must be non-empty, but stop[{i}] is empty")
        for token_id in self.stop_token_ids:
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token_id}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 (0 = no speculation), got {self.num_speculative_tokens}")


def resolve_seed(params: SamplingParams, rng: random.Random) -> int:
    """The request's seed, or one drawn from the engine's generator so that unseeded requests are
    still reproducible within a run (same engine seed, same arrival order)."""
    return params.seed if params.seed is not None else rng.getrandbits(63)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-request sampling parameters of one batch as device tensors, built once per step."""

    # The four per-request tensors are None when every request is greedy (all_greedy).
    temperature: Tensor | None  # [N] float32; 0 for greedy requests
    top_p: Tensor | None  # [N] float32
    top_k: Tensor | None  # [N] int64; 0 = off
    seed: Tensor | None  # [N] int64
    sampled_requests: Tensor | None  # [Ns] int64: the non-greedy requests; None when all of them sample
    all_greedy: bool
    any_top_k: bool  # among sampling requests
    any_top_p: bool
    max_top_k: int
    needs_full_sort: bool  # a sampling request uses top-p without top-k

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str) -> SamplingBatch:
        if len(params) != len(seeds):
            raise ValueError(f"{len(params)} sampling params but {len(seeds)} seeds")
        sampling = [i for i, p in enumerate(params) if not p.greedy]
        if not sampling:  # argmax needs none of the per-request tensors: no host-to-device copies
            return cls(temperature=None, top_p=None, top_k=None, seed=None, sampled_requests=None, all_greedy=True,
                       any_top_k=False, any_top_p=False, max_top_k=0, needs_full_sort=False)
        top_ks = [params[i].top_k for i in sampling if params[i].top_k > 0]
        return cls(
            temperature=to_device([p.temperature for p in params], torch.float32, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.long, device),
            seed=to_device(list(seeds), torch.long, device),
            sampled_requests=None if len(sampling) == len(params) else to_device(sampling, torch.long, device),
            all_greedy=not sampling,
            any_top_k=bool(top_ks),
            any_top_p=any(params[i].top_p < 1 for i in sampling),
            max_top_k=max(top_ks, default=0),
            needs_full_sort=any(params[i].top_p < 1 and params[i].top_k == 0 for i in sampling),
        )


# Rows per chunk are chosen so that each [rows, V] temporary holds at most this many elements
# (128 MiB as int64): sampling 512 rows of a 152k vocabulary must not need gigabytes of scratch.
_CHUNK_ELEMENTS = 1 << 24


def sample_tokens(logits: Tensor, batch: SamplingBatch, positions: Tensor) -> Tensor:
    """logits [N, S, V], positions [N, S] -> tokens [N, S] (int64).

    positions[n, s] is the absolute position the sampled token will occupy in request n; it keys
    the request's noise, so target-only decoding (S = 1) and a speculative round (S = B) draw the
    same token at the same position from the same logits.
    Greedy requests take the argmax. Others: logits / T, keep the top-k, keep the top-p nucleus
    (always at least the top token), then an exponential race with the request's seeded noise.
    """
    if batch.all_greedy:
        return row_argmax(logits)
    n, s, v = logits.shape
    flat_logits = logits.reshape(n * s, v)
    temperature, top_p, top_k, seed = batch.temperature, batch.top_p, batch.top_k, batch.seed
    index = batch.sampled_requests
    sampled_rows = None  # rows of flat_logits that sample; None = all of them
    if index is not None:
        sampled_rows = (index[:, None] * s + torch.arange(s, device=index.device)).reshape(-1)
        positions = positions.index_select(0, index)
        temperature, top_p, top_k, seed = (t.index_select(0, index) for t in (temperature, top_p, top_k, seed))
    temperature, top_p, top_k = (t.repeat_interleave(s) for t in (temperature, top_p, top_k))
    keys = _position_keys(seed, positions).reshape(-1)
    tokens = torch.empty(keys.shape[0], dtype=torch.long, device=logits.device)
    chunk = max(1, _CHUNK_ELEMENTS // v)
    for start in range(0, keys.shape[0], chunk):
        part = slice(start, start + chunk)
        rows = flat_logits[part] if sampled_rows is None else flat_logits.index_select(0, sampled_rows[part])
        tokens[part] = _sample_rows(rows, temperature[part], top_p[part], top_k[part], keys[part], batch)
    if index is None:
        return tokens.view(n, s)
    return row_argmax(logits).index_copy_(0, index, tokens.view(-1, s))


def accept_drafts(draft_tokens: Tensor, target_tokens: Tensor) -> Tensor:
    """draft_tokens [N, B-1], target_tokens [N, B] -> accepted draft count a [N] in 0..B-1.

    Draft j+1 sits at the position the target sampled at block slot j, so it is accepted while it
    equals target_tokens[:, j]. The round emits target_tokens[:, :a+1]: the accepted drafts (equal
    to the target's samples) plus the target's own token at the first mismatch (or the bonus).
    """
    if draft_tokens.shape[1] + 1 != target_tokens.shape[1]:
        shapes = f"drafts {tuple(draft_tokens.shape)}, targets {tuple(target_tokens.shape)}"
        raise ValueError(f"expected drafts [N, B-1] and target tokens [N, B], got {shapes}")
    matches = draft_tokens == target_tokens[:, :-1]
    return matches.long().cumprod(dim=1).sum(dim=1)


def _sample_rows(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, keys: Tensor, batch: SamplingBatch
) -> Tensor:
    """[R, V] logits of sampling rows -> [R] tokens."""
    scores = logits / temperature[:, None]  # float32: the [R, 1] float32 divisor promotes bf16 rows
    if batch.any_top_k or batch.any_top_p:
        threshold = _truncation_threshold(scores, top_p, top_k, batch)
        scores.masked_fill_(scores < threshold[:, None], -math.inf)
    # Exponential race: argmax_v p_v / E_v with E_v ~ Exp(1) picks v with probability p_v. In log
    # space that is argmax(scores - log E): no softmax needed (normalising shifts every score of
    # the row alike), and tokens with tiny probabilities do not underflow to 0.
    scores -= _log_exponentials(keys, scores.shape[1])
    return row_argmax(scores)


def _truncation_threshold(scores: Tensor, top_p: Tensor, top_k: Tensor, batch: SamplingBatch) -> Tensor:
    """[R] smallest score each row keeps after top-k, then top-p on the renormalised remainder
    (-inf where a row keeps everything). Tokens tied with the threshold are all kept."""
    v = scores.shape[1]
    keep_k = torch.where(top_k > 0, top_k.clamp(max=v), v)
    # Top-p after top-k only sees what top-k kept, so the max_top_k largest scores suffice unless
    # some request uses top-p alone; only then is the whole row sorted.
    if batch.needs_full_sort:
        ordered = scores.sort(dim=1, descending=True).values
    else:
        ordered = scores.topk(min(batch.max_top_k, v), dim=1).values
    keep = keep_k
    if batch.any_top_p:
        if batch.any_top_k:
            ranks = torch.arange(ordered.shape[1], device=scores.device)
            ordered.masked_fill_(ranks >= keep_k[:, None], -math.inf)
        probs = ordered.softmax(dim=1)
        mass_before = probs.cumsum(dim=1).sub_(probs)
        # The smallest prefix reaching top_p: every token whose predecessors hold less than top_p.
        keep_p = (mass_before < top_p[:, None]).sum(dim=1)
        # top_p = 1 keeps what top-k kept (a float cumsum can reach 1.0 before the tail).
        keep = torch.where(top_p < 1, keep_p.minimum(keep_k), keep_k)
    threshold = ordered.gather(1, (keep.clamp(max=ordered.shape[1]) - 1)[:, None]).squeeze(1)
    return torch.where(keep < v, threshold, -math.inf)


# --- counter-based noise -------------------------------------------------------------------------
# uint32 values in int64 lanes, masked after every multiply: nothing relies on integer overflow, so
# CPU and CUDA give bit-identical draws.

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mix32_(h: Tensor) -> Tensor:
    """A bijection of [0, 2^32) with full avalanche, in place: xorshift-multiply with constants
    [16 604baa5d 15 43d6ce97 15] from hash-prospector (lower bias than MurmurHash3's finaliser).
    Both multipliers are < 2^31, so h * c < 2^63 never overflows int64."""
    h ^= h >> 16
    h *= 0x604BAA5D
    h &= _MASK32
    h ^= h >> 15
    h *= 0x43D6CE97
    h &= _MASK32
    h ^= h >> 15
    return h


def _position_keys(seed: Tensor, positions: Tensor) -> Tensor:
    """seed [N] int64, positions [N, S] -> one 32-bit key per (request, position).
    For a fixed seed, distinct positions get distinct keys."""
    key = _mix32_((seed & _MASK32) ^ _GOLDEN32)
    key = _mix32_(key ^ ((seed >> 32) & _MASK32))
    return _mix32_(key[:, None] ^ (positions & _MASK32))


@functools.lru_cache(maxsize=8)
def _vocab_codes(vocab_size: int, device: torch.device) -> Tensor:
    """[V] distinct pseudo-random 32-bit codes of the vocabulary indices (a Weyl step, then mixed)."""
    return _mix32_(torch.arange(vocab_size, dtype=torch.long, device=device) * _GOLDEN32 & _MASK32)


def _log_exponentials(keys: Tensor, vocab_size: int) -> Tensor:
    """[R] keys -> [R, V] float32 log E, E = -log u, u uniform in (0, 1) from hash(key, v)."""
    h = _mix32_(_vocab_codes(vocab_size, keys.device)[None, :] ^ keys[:, None])
    # 23 bits: (k + 0.5) / 2^23 is exact in float32 and lies in [2^-24, 1 - 2^-24], so u is never
    # 0 or 1 (E never 0 or inf).
    h >>= 9
    return h.float().add_(0.5).mul_(2.0**-23).log_().neg_().log_()
