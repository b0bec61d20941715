"""Target sampling (spec §3.2); a round's acceptance of drafts is `dflash_serve.kernels.accept_round`.

The target samples every block slot; a draft is accepted while it equals the target's sample at
that position, so every emitted token is a target sample and the output is distributed exactly as
target-only decoding. Beyond that, a seeded request *reproduces* target-only decoding: the draw for
a request at absolute position p is a pure function of (seed, p, logits row). Its noise comes from
a counter-based integer hash instead of a device RNG (`dflash_serve.kernels.sampling`, which also
holds the race itself), so neither batch composition, nor the block size, nor how many drafts were
accepted changes what is sampled.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_serve.kernels import row_argmax, sample_race
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.transfer import to_device

def resolve_seed(params: SamplingParams, rng: random.Random) -> int:
    """The request's seed, or one drawn from the engine's generator so that unseeded requests are
    still reproducible within a run (same engine seed, same arrival order)."""
    return params.seed if params.seed is not None else rng.getrandbits(63)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-request sampling parameters of one batch as device tensors, built once per step."""

    # None when every request is greedy (all_greedy).
    temperature: Tensor | None  # [N] float32; 0 for greedy requests (the kernel's greedy rows)
    seed: Tensor | None  # [N] int64
    # The truncating requests (sampling, with top-k or top-p): their parameters, and which they are.
    # None when no request truncates.
    top_p: Tensor | None  # [N] float32
    top_k: Tensor | None  # [N] int64; 0 = off
    truncated_requests: Tensor | None  # [Nt] int64; None when all requests truncate (or none does)
    all_greedy: bool
    any_top_k: bool  # among truncating requests
    any_top_p: bool
    max_top_k: int
    # A truncating request uses top-p without top-k; or, batch-invariantly, top-p at all: then every
    # top-p row takes its softmax and cumulative sum over the whole sorted vocabulary, one width
    # whatever the other requests' top-k (else the batch's largest top-k, whose width changes the
    # sums' rounding and so, at a near-tie, the nucleus).
    needs_full_sort: bool

    @property
    def truncates(self) -> bool:
        return self.any_top_k or self.any_top_p

    @classmethod
    def greedy(cls) -> SamplingBatch:
        """Every request greedy: argmax needs none of the per-request tensors."""
        return cls(temperature=None, seed=None, top_p=None, top_k=None, truncated_requests=None, all_greedy=True,
                   any_top_k=False, any_top_p=False, max_top_k=0, needs_full_sort=False)

    @classmethod
    def untruncated(cls, temperature: Tensor, seed: Tensor) -> SamplingBatch:
        """Requests that sample without top-k or top-p (greedy ones: temperature 0) from these tensors:
        a CUDA graph's, whose shapes do not depend on the parameters (`RoundGraphs.accept`)."""
        return cls(temperature=temperature, seed=seed, top_p=None, top_k=None, truncated_requests=None,
                   all_greedy=False, any_top_k=False, any_top_p=False, max_top_k=0, needs_full_sort=False)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str, *,
              batch_invariant: bool = False) -> SamplingBatch:
        """`batch_invariant` (`EngineConfig.deterministic`): a request's draws do not depend on the
        other requests' parameters (see `needs_full_sort`)."""
        if len(params) != len(seeds):
            raise ValueError(f"{len(params)} sampling params but {len(seeds)} seeds")
        if all(p.greedy for p in params):  # no copies
            return cls.greedy()
        truncated = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1)]
        top_ks = [params[i].top_k for i in truncated if params[i].top_k > 0]
        return cls(
            temperature=to_device([p.temperature for p in params], torch.float32, device),
            seed=to_device(list(seeds), torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device) if truncated else None,
            top_k=to_device([p.top_k for p in params], torch.long, device) if truncated else None,
            truncated_requests=None if len(truncated) in (0, len(params)) else to_device(truncated, torch.long, device),
            all_greedy=False,
            any_top_k=bool(top_ks),
            any_top_p=any(params[i].top_p < 1 for i in truncated),
            max_top_k=max(top_ks, default=0),
            needs_full_sort=any(params[i].top_p < 1 and (params[i].top_k == 0 or batch_invariant) for i in truncated),
        )


# Rows per chunk of the top-k / top-p thresholds are chosen so that each [rows, V] temporary holds at
# most this many elements: truncating 512 rows of a 152k vocabulary must not need gigabytes of scratch.
_CHUNK_ELEMENTS = 1 << 24


def sample_tokens(logits: Tensor, batch: SamplingBatch, positions: Tensor) -> Tensor:
    """logits [N, S, V], positions [N, S] -> tokens [N, S] (int64).

    positions[n, s] is the absolute position the sampled token will occupy in request n; it keys
    the request's noise, so target-only decoding (S = 1) and a speculative round (S = B) draw the
    same token at the same position from the same logits.
    Greedy requests take the argmax. Others: logits / T, keep the top-k, keep the top-p nucleus
    (always at least the top token), then an exponential race with the request's seeded noise
    (`dflash_serve.kernels.sample_race`: on CUDA two launches for the whole batch, greedy rows
    included, plus the thresholds' sort or top-k when a request truncates).
    """
    if batch.all_greedy:
        return row_argmax(logits)
    threshold = _thresholds(logits, batch) if batch.truncates else None
    return sample_race(logits, batch.temperature, batch.seed, positions, threshold)


def _thresholds(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[N, S] the smallest score logits / T each row keeps after top-k and top-p (-inf where a row
    keeps everything: requests that do not truncate, greedy ones included)."""
    n, s, v = logits.shape
    flat_logits = logits.reshape(n * s, v)
    temperature, top_p, top_k = batch.temperature, batch.top_p, batch.top_k
    index = batch.truncated_requests
    rows = None  # rows of flat_logits that truncate; None = all of them
    if index is not None:
        rows = (index[:, None] * s + torch.arange(s, device=index.device)).reshape(-1)
        temperature, top_p, top_k = (t.index_select(0, index) for t in (temperature, top_p, top_k))
    temperature, top_p, top_k = (t.repeat_interleave(s) for t in (temperature, top_p, top_k))
    thresholds = torch.empty(temperature.shape[0], dtype=torch.float32, device=logits.device)
    chunk = max(1, _CHUNK_ELEMENTS // v)
    for start in range(0, thresholds.shape[0], chunk):
        part = slice(start, start + chunk)
        part_logits = flat_logits[part] if rows is None else flat_logits.index_select(0, rows[part])
        # float32: the [R, 1] float32 divisor promotes bf16 rows; the race divides alike (correctly
        # rounded), so it compares the very values the threshold was taken from.
        scores = part_logits / temperature[part, None]
        thresholds[part] = _truncation_threshold(scores, top_p[part], top_k[part], batch)
    if rows is None:
        return thresholds.view(n, s)
    every_row = torch.full((n * s,), -math.inf, dtype=torch.float32, device=logits.device)
    return every_row.index_copy_(0, rows, thresholds).view(n, s)


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
