"""What a round hands to the server's metrics, in a module without torch: the verifier replica's
process unpickles these from the engine's process, and must not import torch (nor the kernels) to
read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoundRecord:
    """One speculative round, for the server's metrics: the k it verified (0: an AR step), draft
    tokens verified per sequence (k, or less for a request that limits it; 0 when decoding
    target-only), accepted drafts per sequence that the round committed (fewer than accepted
    where a stop token or max_tokens ended the request inside the round), and the draft and
    verify phase times."""

    k: int
    draft_tokens: list[int]
    accepted: list[int]
    draft_seconds: float
    verify_seconds: float
