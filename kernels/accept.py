"""A round's acceptance and the results it leaves, in one launch.

Once the target has sampled every slot of a round (tokens [N, k+1]), each sequence accepts its
drafts while they equal those samples, up to its own limit, and the round leaves: the row the
host reads ([a, the k+1 tokens]), and on the device, for a round chained after this one before
the host has read it, the next bonus token (the target's token at slot a) and start (start + a + 1).
In torch that is 5–8 small ops a round (compare, cumprod, sum, minimum, cat, gather, two adds),
each a launch and host time where the round is the host's (the default pair at c = 32 on the
H100). On the H100's host a call takes 26–28 µs here against 78–82 for the torch ops at k = 15
and 48–51 at k = 0 (BENCHMARKS).

Semantics (the reference): a = the number of leading drafts equal to the target's tokens at the
slots before them (0 without drafts), then min(a, limits); results = [a, tokens], next bonus =
tokens[a], next start = start + a + 1.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None


def accept_round(tokens: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor | None = None,
                 limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [N, k+1] int64 (the target's per slot), starts [N] int64, drafts [N, k] (None: k = 0),
    limits [N] int64 (None: k) -> results [N, k+2], next bonus [N], next starts [N]. Triton on CUDA
    (or under TRITON_INTERPRET=1), else the reference."""
    _check(tokens, starts, drafts, limits)
    if triton is not None and (tokens.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return accept_round_triton(tokens, starts, drafts, limits)
    return accept_round_reference(tokens, starts, drafts, limits)


def _check(tokens, starts, drafts, limits) -> None:
    n, width = tokens.shape
    draft_shape = (n, 0) if drafts is None else tuple(drafts.shape)
    if draft_shape != (n, width - 1) or starts.shape != (n,) or (limits is not None and limits.shape != (n,)):
        raise ValueError(f"expected tokens [N, k+1], drafts [N, k] (None: k = 0), starts and limits [N]; got tokens "
                         f"{tuple(tokens.shape)}, drafts {draft_shape}, starts {tuple(starts.shape)}, limits "
                         f"{None if limits is None else tuple(limits.shape)}")


def accept_round_reference(tokens: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor | None = None,
                           limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if drafts is None:
        accepted = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    else:
        accepted = (drafts == tokens[:, :-1]).cumprod(dim=1).sum(dim=1)
    if limits is not None:
        accepted = accepted.minimum(limits)
    results = torch.cat([accepted[:, None], tokens], dim=1)
    return results, tokens.gather(1, accepted[:, None])[:, 0], starts + accepted + 1


def accept_round_triton(tokens: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor | None = None,
                        limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, drafts, starts, limits = (_unit_steps(t) for t in (tokens, drafts, starts, limits))
    n, width = tokens.shape
    results = torch.empty(n, width + 1, dtype=torch.long, device=tokens.device)
    bonus = torch.empty(n, dtype=torch.long, device=tokens.device)
    next_starts = torch.empty(n, dtype=torch.long, device=tokens.device)
    if n:
        no_drafts = drafts is None  # k = 0: no columns to read; any pointer does
        _accept_round_kernel[(n,)](
            tokens, tokens if no_drafts else drafts, starts, starts if limits is None else limits,
            results, bonus, next_starts, width, tokens.stride(0), 0 if no_drafts else drafts.stride(0),
            HAS_LIMITS=limits is not None, BLOCK=triton.next_power_of_2(width), num_warps=1,
        )
    return results, bonus, next_starts


def _unit_steps(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel steps along a row (or along starts and limits) one element at a time, and from
    row to row by the row's stride: a graph buffer's drafts ([n, :k] of a wider row) go as they are."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def warm_accept_round(device: torch.device, ks) -> int:
    """Compile every variant a server meets (per k bucket's block of columns, with and without
    limits) at start-up, not in a request's first round. Returns the launches made."""
    launched = 0
    for k in sorted(set(ks)):
        tokens = torch.zeros(1, k + 1, dtype=torch.long, device=device)
        drafts = tokens[:, :k].clone() if k else None
        starts = torch.zeros(1, dtype=torch.long, device=device)
        for limits in (None, starts):
            accept_round_triton(tokens, starts, drafts, limits)
            launched += 1
    return launched


if triton is not None:

    @triton.jit(do_not_specialize=["width", "tokens_stride", "drafts_stride"])
    def _accept_round_kernel(tokens_ptr, drafts_ptr, starts_ptr, limits_ptr, results_ptr, bonus_ptr, next_starts_ptr,
                             width, tokens_stride, drafts_stride, HAS_LIMITS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        tokens = tl.load(tokens_ptr + row * tokens_stride + cols, mask=cols < width, other=0)
        is_draft = cols < width - 1
        drafts = tl.load(drafts_ptr + row * drafts_stride + cols, mask=is_draft, other=0)
        # The first slot whose draft differs, or the one past the drafts: the drafts accepted.
        stops = (drafts != tokens) | (cols >= width - 1)
        accepted = tl.min(tl.where(stops, cols, BLOCK), 0).to(tl.int64)
        if HAS_LIMITS:
            accepted = tl.minimum(accepted, tl.load(limits_ptr + row))
        out = results_ptr + row * (width + 1)
        tl.store(out, accepted)
        tl.store(out + 1 + cols, tokens, mask=cols < width)
        tl.store(bonus_ptr + row, tl.sum(tl.where(cols == accepted, tokens, 0), 0))
        tl.store(next_starts_ptr + row, tl.load(starts_ptr + row) + accepted + 1)
