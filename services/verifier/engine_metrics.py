"""The verifier's metrics: events from the engine's process, recorded by the replica's.

The engine's process (`engine_process`) has no Ray: it only keeps what a step produced — its
rounds, each request's token gap, each finished request's times, a few counter deltas — as
`MetricEvents`, and sends them to the replica every tenth of a second. The replica's
`EngineMetrics` records them from a thread of its own, counters summed over a period first (one
Ray metric call a series, not one an event: a call costs 2-4 µs of Python).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from dflash_serve.services.engine.round_record import RoundRecord
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.metrics import FINISHED_REASONS

log = logging.getLogger(__name__)
RECORD_PERIOD_S = 0.1  # Ray exports every few seconds: a tenth of a second late is never seen

Counts = collections.Counter  # (name, tags as a tuple of pairs) -> the sum over a period
Event = tuple[str, object]  # (what it records, its payload)


class MetricEvents:
    """The engine process's metric events since they were last taken (each a list append)."""

    def __init__(self):
        self.events: list[Event] = []

    def rounds(self, records: list[RoundRecord], *, speculative: bool) -> None:
        """speculative: a drafter serves (an AR round's k = 0 is observed only then)."""
        self.events.append(("rounds", (records, speculative)))

    def token_gaps(self, gaps: list[tuple[float, int]]) -> None:
        """(seconds per token, tokens) for each request that got tokens at a step: a round's tokens
        arrive together, so its gap is spread over them."""
        self.events.append(("token_gaps", gaps))

    def count(self, name: str, value: float) -> None:
        if value:
            self.events.append(("count", (name, value)))

    def request_finished(self, reason: FinishReason, timings: RequestTimings | None = None) -> None:
        self.events.append(("request", (reason, timings)))

    def phase_seconds(self, phase: str, seconds: Iterable[float]) -> None:
        self.events.append(("phase", (phase, list(seconds))))

    def gauges(self, values: dict[str, float]) -> None:
        self.events.append(("gauges", values))

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class EngineMetrics:
    """Records `MetricEvents`' events into `metrics` (a `ReplicaMetrics`) from its own thread."""

    def __init__(self, metrics, *, period_s: float = RECORD_PERIOD_S):
        self.metrics = metrics
        self.period_s = period_s
        self._recorders = {"rounds": self._record_rounds, "token_gaps": self._record_token_gaps,
                           "count": self._record_count, "request": self._record_request,
                           "phase": self._record_phase, "gauges": self._record_gauges}
        self._events: collections.deque[Event] = collections.deque()  # thread-safe ends
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-metrics", daemon=True)
        self._thread.start()

    def add(self, events: Iterable[Event]) -> None:
        self._events.extend(events)

    # -- the recording thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.record_pending()
        self.record_pending()

    def record_pending(self) -> None:
        """Records every queued event (the thread does, each period; tests call it directly)."""
        counts: Counts = Counts()
        while self._events:
            kind, payload = self._events.popleft()
            try:
                self._recorders[kind](payload, counts)
            except Exception:  # noqa: BLE001 - a metric must never stop the others (nor the replica)
                log.exception("recording a metric failed")
        for (name, tags), value in counts.items():
            self.metrics.inc(name, value, **dict(tags))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _record_count(self, payload: tuple[str, float], counts: Counts) -> None:
        name, value = payload
        counts[(name, ())] += value

    def _record_rounds(self, payload: tuple[list[RoundRecord], bool], counts: Counts) -> None:
        records, speculative = payload
        observe = self.metrics.observe
        for record in records:
            observe("dflash_step_phase_seconds", record.verify_seconds, phase="verify")
            if speculative or record.k:
                observe("dflash_spec_decode_tokens_per_round", record.k)
            if not record.k:
                continue
            observe("dflash_step_phase_seconds", record.draft_seconds, phase="draft")
            # Verified drafts only: a request that limits them (or opts out) counts what it verified.
            counted = [(d, a) for d, a in zip(record.draft_tokens, record.accepted, strict=True) if d]
            counts[("dflash_spec_decode_num_drafts", ())] += len(counted)
            counts[("dflash_spec_decode_num_draft_tokens", ())] += sum(d for d, _ in counted)
            counts[("dflash_spec_decode_num_accepted_tokens", ())] += sum(a for _, a in counted)
            for _, accepted in counted:
                observe("dflash_acceptance_length", accepted + 1)
                for position in range(accepted):
                    counts[("dflash_spec_decode_num_accepted_tokens_per_pos", (("position", str(position)),))] += 1

    def _record_token_gaps(self, gaps: list[tuple[float, int]], counts: Counts) -> None:
        observe = self.metrics.observe
        for seconds, tokens in gaps:
            for _ in range(tokens):
                observe("dflash_inter_token_latency_seconds", seconds)

    def _record_phase(self, payload: tuple[str, list[float]], counts: Counts) -> None:
        phase, seconds = payload
        for s in seconds:
            self.metrics.observe("dflash_step_phase_seconds", s, phase=phase)

    def _record_request(self, payload: tuple[FinishReason, RequestTimings | None], counts: Counts) -> None:
        reason, t = payload
        counts[("dflash_request_success", (("finished_reason", FINISHED_REASONS[reason]),))] += 1
        if t is None:
            return
        counts[("dflash_prompt_tokens", ())] += t.prompt_tokens
        counts[("dflash_generation_tokens", ())] += t.output_tokens
        observe = self.metrics.observe
        observe("dflash_e2e_request_latency_seconds", t.e2e)
        if t.queue is not None:
            observe("dflash_request_queue_time_seconds", t.queue)
        if t.ttft is not None:
            observe("dflash_time_to_first_token_seconds", t.ttft)
        if t.tpot is not None:
            observe("dflash_request_time_per_output_token_seconds", t.tpot)

    def _record_gauges(self, values: dict[str, float], counts: Counts) -> None:
        for name, value in values.items():
            self.metrics.set(name, value)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """A finished request's token counts and latencies (seconds; None where it never got there)."""

    prompt_tokens: int
    output_tokens: int
    e2e: float
    queue: float | None
    ttft: float | None
    tpot: float | None
