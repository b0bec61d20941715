"""A request's sampling and stopping parameters: what routers validate and engines run, in a
module without torch (a router replica imports it and nothing of the engine's device code)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
