"""BENCHMARKS ONLY: rounds that accept as if the drafts were the target's own tokens, to a set mean length.

A drafter with random weights proposes drafts the target never accepts, so a random-weight pair of
a real model's shapes (a Qwen3-8B-DFlash-shaped one, say) would time rounds that commit one token.
With `EngineConfig.synthetic_acceptance_length` (or `Engine.synthetic` set by a benchmark) every
round that verifies drafts accepts as many as keep the mean acceptance length τ at the value given,
whatever the drafter proposed: a realistic τ on random weights. Outputs are then NOT the target's.
The engine imports this module only when asked for it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class SyntheticAcceptance:
    """The acceptance of every drafting round, forced to a mean length of `tau` (accepted drafts + 1)."""

    def __init__(self, tau: float):
        log.warning("SYNTHETIC acceptance (benchmarks only): every drafting round accepts to a mean length of %g; "
                    "outputs are not the target's", tau)
        self.tau = tau  # a benchmark may change it between runs: the rounds' running mean goes on from there
        self._debt = 0.0

    def drafts_and_limits(self, target_tokens: torch.Tensor, verified: list[int], k: int,
                          block_size: int) -> tuple[torch.Tensor, list[int]]:
        """For a round verifying k > 0 drafts whose target tokens are `target_tokens` [n, k+1]: every
        draft as the target's own token, and each sequence's limit cut to the synthetic length."""
        length = self._accept_length(k, block_size)
        return target_tokens[:, :-1], [min(v, length) for v in verified]

    def _accept_length(self, k: int, block_size: int) -> int:
        """Accepted drafts of a round verifying k: the drafter's whole block matches the target up
        to a length whose running mean plus one tracks tau (over every drafting round, whatever its
        k), and the round accepts the part it verified — as with real drafts, what a smaller k
        leaves unverified is lost, not owed to later rounds."""
        self._debt += self.tau - 1
        a = min(int(self._debt + 0.5), block_size - 1)
        self._debt -= a
        return min(a, k)
