"""A request's state inside the engine, and what the engine hands back after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_serve.services.engine.stopping import FinishReason, StopChecker

if TYPE_CHECKING:  # annotations only: the router's and the replica's processes need no torch for these
    from dflash_serve.services.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be prefilled again
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Per-request speculation counters over the rounds that verified drafts (not the prefill's
    first token, not AR steps); `accepted_tokens` counts the accepted drafts a round committed,
    the bonus token excluded (it is not a draft)."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """τ: tokens a round commits, the bonus token included, averaged over the rounds counted
        (vLLM's mean_acceptance_length, the z-lab reference's acceptance length; spec §3.1)."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop: StopChecker
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V (target) and context rows (drafter) are in the caches: positions 0..num_cached-1.
    num_cached: int = 0
    # Prefix-cache keys of the sequence's full blocks, as far as computed (tokens never change).
    block_keys: list[bytes] = field(default_factory=list)
    # Leading blocks of block_table, full of committed tokens, already offered to the prefix cache.
    num_offered_blocks: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    first_token_time: float | None = None
    scheduled_time: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Positions to prefill before decoding: the prompt, or after a preemption everything but
        the last token, which is the bonus token of the next round."""
        return len(self.prompt_ids) if not self.output_ids else self.num_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def bonus(self) -> int:
        """The last token: sampled by the target, not yet in its cache; at position num_cached."""
        return self.tokens[-1]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (new tokens and text since the last output)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats
    error: str | None = None
