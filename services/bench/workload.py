"""What `dflash bench` sends and what it records of each request: prompts or conversations, the
sampling every request gets, the load (closed loop or Poisson arrivals), and each request's record
(its tokens' arrival times, latencies, speculation counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dflash_serve.services.bench.prompts import Conversation, Prompt

# What a run sends: single requests, or conversations of several turns (counted as one item; the
# load's concurrency counts conversations in flight, as a chat client holds one open).
Item = Prompt | Conversation


def first_prompt(item: Item) -> Prompt:
    return item.first() if isinstance(item, Conversation) else item


def next_prompt(item: Item, sent: Prompt, answer: str) -> Prompt | None:
    """The request that follows `sent` once its answer arrived (None: the item is done)."""
    return item.after(sent, answer) if isinstance(item, Conversation) else None


@dataclass(frozen=True)
class BenchSampling:
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None  # request i gets seed + i: reproducible, yet not one stream for all
    ignore_eos: bool = False

    def request_seed(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index

    def max_tokens_for(self, prompt: Prompt) -> int:
        return prompt.max_tokens or self.max_tokens


@dataclass(frozen=True)
class Load:
    """Closed loop (request_rate None): `concurrency` clients, each sending its next request when
    its last one ends. Open loop: Poisson arrivals at `request_rate` per second (inf: all at once),
    at most `concurrency` requests in flight (None: no bound), as vLLM's --max-concurrency."""

    concurrency: int | None = 1
    request_rate: float | None = None
    seed: int = 0  # of the arrival times

    def __post_init__(self):
        if self.request_rate is None and not self.concurrency:
            raise ValueError("a closed-loop load needs a concurrency")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive (inf: all at once), got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {self.concurrency}")

    def arrival_offsets(self, count: int) -> list[float]:
        """Seconds from the run's start at which each request is due (the first at once)."""
        if self.request_rate == math.inf:
            return [0.0] * count
        gaps = np.random.default_rng(self.seed).exponential(1.0 / self.request_rate, size=count)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist() if count else []

    def describe(self) -> str:
        if self.request_rate is None:
            return f"c={self.concurrency}"
        cap = f", max {self.concurrency} in flight" if self.concurrency else ""
        return f"rate={self.request_rate:g}/s{cap}"


@dataclass
class RequestRecord:
    """One request as the client saw it (perf_counter seconds)."""

    start: float
    # (arrival time, token count) of each streamed message that carried tokens.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None  # the stream ended
    input_tokens: int = 0
    output_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    error: str | None = None  # the status code's name when the request failed
    turn: int = 1  # of its conversation
    text: list[str] = field(default_factory=list)  # the answer's pieces, as streamed

    @property
    def answer(self) -> str:
        return "".join(self.text)

    def tokens_arrived(self, now: float, count: int) -> None:
        if count:
            self.arrivals.append((now, count))

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.start if self.arrivals else None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.arrivals:
            return None
        return (self.arrivals[-1][0] - self.arrivals[0][0]) / (self.output_tokens - 1)

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def itls(self) -> list[float]:
        gaps = []
        for (before, _), (now, count) in zip(self.arrivals, self.arrivals[1:]):
            gaps.extend([(now - before) / count] * count)
        return gaps
