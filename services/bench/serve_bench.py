"""`dflash bench`: a load generator against the gRPC server, an OpenAI-compatible HTTP server
(ours or vLLM's), or the embedded engine, like `vllm bench serve`.

For each load and prompt set: `warmup` unmeasured requests, then every prompt of the set, each
response streamed. A load is closed-loop (`concurrency` clients each send their next request as
soon as their last one ends) or open-loop (requests arrive as a Poisson process of `request_rate`
per second, inf: all at once, with at most `concurrency` in flight when given), as vLLM's bench
sends them. Reported per run (see `summarize`), under our keys and under vLLM bench's:

- output tok/s: completion tokens of successful requests / wall time of the run;
- TTFT (request sent -> first token), TPOT ((last token - first token) / (tokens - 1), per request),
  ITL (inter-token latency: a message's gap since the previous one, spread over its tokens, as the
  server's own metric does; the tokens of one speculative round arrive together; over HTTP, where a
  chunk does not say how many tokens it holds, one gap per chunk, as vLLM's bench measures it) and
  end-to-end latency: mean, median, std and p99, in ms;
- τ (1 + accepted drafts / rounds, pooled over the run's rounds; includes the bonus token),
  acceptance rate (accepted / drafted tokens), acceptance per draft position (fraction of rounds
  whose draft at that position was accepted): from each request's final spec_stats (gRPC,
  embedded), or over HTTP from the server's Prometheus counters before and after the run
  (`--metrics-url`, as vLLM's bench reads its server's /metrics);
- failed requests, by status code;
- for conversations (`sharegpt-2turn`: each turn sent once the answer to the one before has
  arrived, with the conversation so far), the same latencies per turn, and the prefix cache's hit
  rate over the run's prompt tokens (the embedded engine's own counters, or the server's
  Prometheus counters with `--metrics-url`);
- embedded: the engine's rounds and their phases per round (`round_times_ms`).

Results go to DIR/results.json, DIR/results.md and DIR/results.png.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

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


# -- statistics ---------------------------------------------------------------------------------


def distribution_ms(seconds: Sequence[float]) -> dict:
    if not seconds:
        return {"mean": None, "median": None, "std": None, "p99": None}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p99": float(np.percentile(ms, 99))}


@dataclass(frozen=True)
class SpecCounters:
    """Speculative-decoding counts of a run: rounds with drafts, drafted and accepted tokens, and
    accepted tokens by draft position."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        positions = max(len(self.per_position), len(before.per_position))

        def at(counts, j):
            return counts[j] if j < len(counts) else 0.0

        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(at(self.per_position, j) - at(before.per_position, j) for j in range(positions)))


def _peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (tokens arrived in the busiest whole second of the run) and
    max_concurrent_requests (most requests in flight at once)."""
    if not records:
        return 0.0, 0
    origin = min(r.start for r in records)
    per_second = Counter()
    for r in records:
        for at, count in r.arrivals:
            per_second[int(at - origin)] += count
    edges = sorted([(r.start, 1) for r in records if r.end is not None] +
                   [(r.end, -1) for r in records if r.end is not None])
    in_flight = most = 0
    for _, step in edges:
        in_flight += step
        most = max(most, in_flight)
    return float(max(per_second.values(), default=0)), most


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Prompt tokens looked up in the prefix cache, and of those the ones found (vLLM's counts)."""

    queries: float = 0.0
    hits: float = 0.0

    def __sub__(self, before: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(self.queries - before.queries, self.hits - before.hits)


def turn_summaries(records: Sequence[RequestRecord]) -> list[dict]:
    """Per turn of the conversations: its requests' latencies (failed ones left out)."""
    turns = []
    for turn in sorted({r.turn for r in records}):
        mine = [r for r in records if r.turn == turn]
        ok = [r for r in mine if r.error is None]
        turns.append({
            "turn": turn,
            "requests": len(mine),
            "completed": len(ok),
            "mean_input_tokens": statistics.fmean(r.input_tokens for r in ok) if ok else None,
            "output_tokens": sum(r.output_tokens for r in ok),
            "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
            "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
            "e2el_ms": distribution_ms([r.latency for r in ok if r.latency is not None]),
        })
    return turns


def summarize(records: Sequence[RequestRecord], duration: float, server_spec: SpecCounters | None = None,
              prefix_cache: PrefixCacheCounters | None = None) -> dict:
    """The run's metrics, under our keys and vLLM bench's. Speculation counters are pooled over the
    successful requests' rounds, or are the server's (`server_spec`) where requests carry none;
    `prefix_cache`: the run's prefix-cache counts, where the backend knows them."""
    ok = [r for r in records if r.error is None]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    if server_spec is None:
        per_position = [0] * max((len(r.accepted_per_position) for r in ok), default=0)
        for r in ok:
            for j, count in enumerate(r.accepted_per_position):
                per_position[j] += count
        spec = SpecCounters(sum(r.rounds for r in ok), sum(r.draft_tokens for r in ok),
                            sum(r.accepted_tokens for r in ok), tuple(per_position))
        per_request = [1 + r.accepted_tokens / r.rounds for r in ok if r.rounds]
    else:
        spec, per_request = server_spec, []
    rounds, drafted, accepted = spec.drafts, spec.draft_tokens, spec.accepted
    per_second = (lambda total: total / duration) if duration > 0 else (lambda total: 0.0)
    latencies = {
        "ttft": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution_ms([gap for r in ok for gap in r.itls()]),
        "e2el": distribution_ms([r.latency for r in ok if r.latency is not None]),
    }
    tau = 1 + accepted / rounds if rounds else None
    acceptance_rate = accepted / drafted if drafted else None
    acceptance_per_position = [c / rounds for c in spec.per_position] if rounds else []
    max_tokens_per_s, max_in_flight = _peaks(records)
    vllm = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_in_flight,
        **{f"{stat}_{name}_ms": dist[stat] for name, dist in latencies.items()
           for stat in ("mean", "median", "std", "p99")},
        "input_lens": [r.input_tokens for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft for r in ok],
        # Target-only serving has no rounds with drafts: the speculation keys do not apply (None).
        "spec_decode_acceptance_rate": None if acceptance_rate is None else 100 * acceptance_rate,  # %, as vLLM
        "spec_decode_acceptance_length": tau,
        "spec_decode_num_drafts": rounds,
        "spec_decode_draft_tokens": drafted,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_per_position_acceptance_rates": acceptance_per_position,
    }
    return {
        "requests": len(records),
        "error_codes": dict(Counter(r.error for r in records if r.error is not None)),
        "duration_s": duration,
        "output_tokens": output_tokens,
        "output_tok_s": per_second(output_tokens),
        **{f"{name}_ms": dist for name, dist in latencies.items()},
        "rounds": rounds,
        "tau": tau,
        # DFlash's own benchmark script (spec §3.1) averages each request's τ instead; short answers
        # weigh as much as long ones, so it reads higher where they accept more.
        "tau_per_request": statistics.fmean(per_request) if per_request else None,
        "acceptance_rate": acceptance_rate,
        "accepted_per_position": list(spec.per_position),
        "acceptance_per_position": acceptance_per_position,
        # Per turn of the conversations (one entry, turn 1, for single requests).
        "turns": turn_summaries(records),
        "prefix_cache_queries": None if prefix_cache is None else prefix_cache.queries,
        "prefix_cache_hits": None if prefix_cache is None else prefix_cache.hits,
        "prefix_cache_hit_rate": (prefix_cache.hits / prefix_cache.queries
                                  if prefix_cache is not None and prefix_cache.queries else None),
        **vllm,
    }


# -- load generators ----------------------------------------------------------------------------

Progress = Callable[[], None]


class EmbeddedBackend:
    """The in-process engine, stepped by this thread: requests join between steps, as on a server."""

    def __init__(self, engine):
        if engine.tokenizer is None:
            raise ValueError("the target has no tokenizer; dflash bench needs one to render the prompts")
        self.engine = engine

    def describe(self) -> dict:
        cfg = self.engine.config
        return {"backend": "embedded", "target": cfg.target, "drafter": cfg.drafter or "",
                "speculation": cfg.speculation if cfg.drafter else "none (AR)",
                "block_size": self.engine.block_size, "device": str(self.engine.device),
                "vocab_size": self.engine.vocab_size, "prefix_caching": cfg.enable_prefix_caching}

    def prefix_cache_counters(self) -> PrefixCacheCounters:
        scheduler = self.engine.scheduler
        return PrefixCacheCounters(scheduler.prefix_cache_queries, scheduler.prefix_cache_hits)

    def step_timings(self):
        """The engine's phase times so far (`StepTimings`, a copy): a run's are the difference."""
        return self.engine.timings.copy()

    def policy_estimates(self, n: int, context: float | None) -> dict | None:
        """The adaptive policy's view of a batch of n (at most the engine's largest) at mean position
        `context` now (`SpeculationPolicy.estimates`); None where no adaptive choice runs."""
        policy = self.engine.speculation
        if not policy.adapts or policy.costs is None:
            return None
        return policy.estimates(min(n, self.engine.config.max_num_seqs), context)

    def clear_prefix_cache(self) -> None:
        """Forget what earlier runs cached (nothing is running between runs), so that a run finds
        only what its own requests left: not its warm-up's prompts, nor an earlier load's."""
        self.engine.allocator.reset_prefix_cache()

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        tok = self.engine.tokenizer
        if tok.chat_template:
            return list(tok.apply_chat_template(prompt.messages(), add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
        if prompt.history:
            raise ValueError("the target's tokenizer has no chat template to render a conversation with")
        return tok.encode(prompt.text)

    def run(self, items: Sequence[Item], sampling: BenchSampling, load: Load,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        from dflash_serve.services.engine.sampling import SamplingParams
        from dflash_serve.services.engine.stopping import FinishReason

        engine, records = self.engine, []
        active: dict[str, tuple[RequestRecord, int, Prompt]] = {}  # request id -> (record, item index, prompt)
        follow_ups: list[tuple[int, Prompt]] = []  # next turns whose previous answer has arrived
        due = load.arrival_offsets(len(items)) if load.request_rate is not None else [0.0] * len(items)
        cap = load.concurrency or len(items)
        start, sent, open_items = time.perf_counter(), 0, 0

        def submit(index: int, prompt: Prompt) -> None:
            nonlocal open_items
            params = SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens_for(prompt),
                                    seed=sampling.request_seed(index), ignore_eos=sampling.ignore_eos)
            record = RequestRecord(start=time.perf_counter(), turn=prompt.turn)
            records.append(record)
            try:
                active[engine.add_request(self._prompt_ids(prompt), params)] = (record, index, prompt)
            except ValueError:  # what the server answers with INVALID_ARGUMENT; the item ends here
                record.error = "INVALID_ARGUMENT"
                open_items -= 1
                progress()

        while sent < len(items) or active or follow_ups:
            for index, prompt in follow_ups:  # first: their clients are waiting already
                submit(index, prompt)
            follow_ups.clear()
            now = time.perf_counter()
            while sent < len(items) and open_items < cap and start + due[sent] <= now:
                open_items += 1
                sent += 1
                submit(sent - 1, first_prompt(items[sent - 1]))
            if not active:
                if sent < len(items):  # open loop, idle until the next arrival
                    time.sleep(max(0.0, start + due[sent] - time.perf_counter()))
                continue
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id not in active:
                    continue
                record, index, prompt = active[out.request_id]
                record.tokens_arrived(now, len(out.new_token_ids))
                record.text.append(out.new_text)
                if not out.finished:
                    continue
                del active[out.request_id]
                engine.release(out.request_id)
                record.end = now
                record.input_tokens, record.output_tokens = out.num_prompt_tokens, out.num_output_tokens
                if out.finish_reason is FinishReason.ERROR:
                    record.error = "INTERNAL"
                _take_stats(record, out.stats.rounds, out.stats.draft_tokens, out.stats.accepted_tokens,
                            out.stats.accepted_per_position)
                following = None if record.error else next_prompt(items[index], prompt, record.answer)
                if following is not None:
                    follow_ups.append((index, following))
                else:
                    open_items -= 1
                    progress()
        return records


async def _drive(items: Sequence[Item], load: Load, send: Callable[[int, Prompt], Awaitable[RequestRecord]],
                 progress: Progress) -> list[RequestRecord]:
    """Sends every item through `send` (which streams one request and returns its record; a
    conversation's turns one after the other, each once the answer before it has arrived) under the
    load: closed-loop clients, or Poisson arrivals with at most `concurrency` items in flight."""
    records: list[RequestRecord] = []

    async def one(index: int, item: Item) -> None:
        prompt = first_prompt(item)
        while prompt is not None:
            record = await send(index, prompt)
            record.turn = prompt.turn
            records.append(record)
            prompt = None if record.error else next_prompt(item, prompt, record.answer)
        progress()

    if load.request_rate is None:
        queue = list(enumerate(items))[::-1]  # popped from the end: in order

        async def client() -> None:
            while queue:
                await one(*queue.pop())

        await asyncio.gather(*(client() for _ in range(load.concurrency)))
        return records
    in_flight = asyncio.Semaphore(load.concurrency or len(items) or 1)

    async def bounded(index: int, item: Item) -> None:
        async with in_flight:  # the request's clock starts when it is sent, as in vLLM's bench
            await one(index, item)

    start, tasks = time.perf_counter(), []
    for index, (item, due) in enumerate(zip(items, load.arrival_offsets(len(items)))):
        await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        tasks.append(asyncio.create_task(bounded(index, item)))
    await asyncio.gather(*tasks)
    return records


class GrpcBackend:
    """Streams `dflash.v1.Generation/Generate` calls over one channel."""

    def __init__(self, address: str, timeout: float = 600.0, api_key: str | None = None):
        self.address = address
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def describe(self) -> dict:
        from dflash_serve.services.client import model_info

        info = model_info(self.address, timeout=10, metadata=self.metadata)
        return {"backend": "grpc", "address": self.address, "target": info.target, "drafter": info.drafter,
                "target_revision": info.target_revision, "drafter_revision": info.drafter_revision,
                "block_size": info.block_size, "topology": info.topology, "vocab_size": info.vocab_size}

    def run(self, items: Sequence[Item], sampling: BenchSampling, load: Load,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        return asyncio.run(self._run(items, sampling, load, progress))

    async def _run(self, items, sampling, load, progress) -> list[RequestRecord]:
        import grpc

        from dflash_serve.services.api.dflash.v1 import generation_pb2_grpc
        from dflash_serve.services.client import build_request

        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def send(index: int, prompt: Prompt) -> RequestRecord:
                params = {"max_tokens": sampling.max_tokens_for(prompt), "temperature": sampling.temperature,
                          "ignore_eos": sampling.ignore_eos}
                if sampling.seed is not None:
                    params["seed"] = sampling.request_seed(index)
                if prompt.token_ids is not None:
                    request = build_request(token_ids=prompt.token_ids, sampling=params)
                else:
                    request = build_request(chat=prompt.messages(), sampling=params)
                record = RequestRecord(start=time.perf_counter())
                await self._one(stub, request, record)
                return record

            return await _drive(items, load, send, progress)

    async def _one(self, stub, request, record: RequestRecord) -> None:
        import grpc

        last = None
        try:
            async for response in stub.Generate(request, timeout=self.timeout, metadata=self.metadata):
                record.tokens_arrived(time.perf_counter(), len(response.token_ids))
                record.text.append(response.text)
                last = response
        except grpc.aio.AioRpcError as err:
            record.error = err.code().name
        record.end = time.perf_counter()
        if record.error is None and (last is None or not last.HasField("usage")):
            record.error = "INCOMPLETE"  # the stream ended without its final message
        if record.error is None:
            stats = last.spec_stats
            record.input_tokens, record.output_tokens = last.usage.prompt_tokens, last.usage.completion_tokens
            _take_stats(record, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                        stats.accepted_per_position)


# Speculative-decoding counters in a Prometheus scrape: vLLM's names, or ours as Ray exports them.
SPEC_COUNTER_NAMES = {
    "drafts": ("vllm:spec_decode_num_drafts_total", "ray_dflash_spec_decode_num_drafts_total"),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "ray_dflash_spec_decode_num_draft_tokens_total"),
    "accepted": ("vllm:spec_decode_num_accepted_tokens_total", "ray_dflash_spec_decode_num_accepted_tokens_total"),
    "per_position": ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     "ray_dflash_spec_decode_num_accepted_tokens_per_pos_total"),
}


# Prefix-cache counters (prompt tokens looked up, and found): vLLM's names, or ours as Ray exports them.
PREFIX_CACHE_COUNTER_NAMES = {
    "queries": ("vllm:prefix_cache_queries_total", "ray_dflash_prefix_cache_queries_total"),
    "hits": ("vllm:prefix_cache_hits_total", "ray_dflash_prefix_cache_hits_total"),
}


def parse_prefix_cache_counters(text: str) -> PrefixCacheCounters:
    """The prefix-cache counters of a Prometheus text scrape, summed over every series."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"queries": 0.0, "hits": 0.0}
    key_of = {name: key for key, names in PREFIX_CACHE_COUNTER_NAMES.items() for name in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in key_of:
                totals[key_of[sample.name]] += sample.value
    return PrefixCacheCounters(totals["queries"], totals["hits"])


def parse_spec_counters(text: str) -> SpecCounters:
    """The speculative-decoding counters of a Prometheus text scrape, summed over every series
    (replicas, models); per-position counts by their `position` label."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {key: 0.0 for key in ("drafts", "draft_tokens", "accepted")}
    per_position: dict[int, float] = {}
    key_of = {name: key for key, names in SPEC_COUNTER_NAMES.items() for name in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = key_of.get(sample.name)
            if key == "per_position":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            elif key is not None:
                totals[key] += sample.value
    positions = tuple(per_position.get(j, 0.0) for j in range(max(per_position, default=-1) + 1))
    return SpecCounters(totals["drafts"], totals["draft_tokens"], totals["accepted"], positions)


class OpenAIBackend:
    """Streams OpenAI completions or chat completions over HTTP (SSE), as `vllm bench serve
    --backend openai` / `openai-chat` does: against our server's HTTP API or vLLM's own."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, base_url: str, endpoint: str = "/v1/completions", model: str | None = None,
                 api_key: str | None = None, metrics_url: str | None = None, tokenizer=None,
                 timeout: float = 600.0):
        if endpoint not in self.ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(self.ENDPOINTS)}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.endpoint, self.model, self.metrics_url = endpoint, model, metrics_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer  # optional: the random set's vocabulary, and its text for chat
        self.timeout = timeout

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    def describe(self) -> dict:
        import httpx

        # Asked even with --model: a wrong address or API key fails here, not in every request.
        reply = httpx.get(f"{self.base_url}/v1/models", headers=self.headers, timeout=10)
        reply.raise_for_status()
        if self.model is None:  # the server's first model, as vLLM's bench takes it
            models = reply.json().get("data") or []
            if not models:
                raise ValueError(f"{self.base_url}/v1/models lists no model; give --model")
            self.model = models[0]["id"]
        setup = {"backend": "openai", "base_url": self.base_url, "endpoint": self.endpoint, "target": self.model,
                 "drafter": "", "metrics_url": self.metrics_url}
        if self.tokenizer is not None:
            setup["vocab_size"] = len(self.tokenizer)
        return setup

    def _scrape(self) -> str:
        import httpx

        reply = httpx.get(self.metrics_url, timeout=10)
        reply.raise_for_status()
        return reply.text

    def spec_counters(self) -> SpecCounters | None:
        """The server's speculative-decoding counters now (None without --metrics-url)."""
        return None if self.metrics_url is None else parse_spec_counters(self._scrape())

    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        """The server's prefix-cache counters now (None without --metrics-url)."""
        return None if self.metrics_url is None else parse_prefix_cache_counters(self._scrape())

    def payload(self, index: int, prompt: Prompt, sampling: BenchSampling) -> dict:
        body = {"model": self.model, "temperature": sampling.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.chat:
            if not prompt.text:
                raise ValueError("token prompts go to /v1/completions; for chat, --tokenizer renders them as text")
            body["messages"] = prompt.messages()
            body["max_completion_tokens"] = sampling.max_tokens_for(prompt)
        elif prompt.history:
            raise ValueError("a conversation's later turns need the chat template: use --endpoint /v1/chat/completions")
        else:
            body["prompt"] = list(prompt.token_ids) if prompt.token_ids is not None else prompt.text
            body["max_tokens"] = sampling.max_tokens_for(prompt)
        if sampling.seed is not None:
            body["seed"] = sampling.request_seed(index)
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension to the OpenAI API
        return body

    def run(self, items: Sequence[Item], sampling: BenchSampling, load: Load,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        return asyncio.run(self._run(items, sampling, load, progress))

    async def _run(self, items, sampling, load, progress) -> list[RequestRecord]:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=load.concurrency or len(items))
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, limits=limits,
                                     timeout=httpx.Timeout(self.timeout, connect=10.0)) as client:

            async def send(index: int, prompt: Prompt) -> RequestRecord:
                body = self.payload(index, prompt, sampling)
                record = RequestRecord(start=time.perf_counter())
                try:
                    await self._one(client, body, record)
                except httpx.HTTPError as err:
                    record.error = type(err).__name__  # ConnectError, ReadTimeout, ...
                record.end = time.perf_counter()
                return record

            return await _drive(items, load, send, progress)

    async def _one(self, client, body: dict, record: RequestRecord) -> None:
        async with client.stream("POST", self.endpoint, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP_{response.status_code}"
                return
            usage, done = None, False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and fields
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream began (vLLM sends one as data)
                    record.error = "STREAM_ERROR"
                    return
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                    if text:
                        record.tokens_arrived(time.perf_counter(), 1)  # a chunk does not say its tokens
                        record.text.append(text)
                usage = chunk.get("usage") or usage
        if not done or usage is None:
            record.error = "INCOMPLETE"  # no [DONE], or no usage although include_usage asked for it
            return
        record.input_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]


def _take_stats(record: RequestRecord, rounds: int, drafted: int, accepted: int, per_position) -> None:
    record.rounds, record.draft_tokens, record.accepted_tokens = rounds, drafted, accepted
    record.accepted_per_position = list(per_position)


# -- the benchmark ------------------------------------------------------------------------------


def run_bench(backend, prompt_sets: dict[str, list[Prompt]], loads: Sequence[Load], sampling: BenchSampling,
              warmup: int = 1, show_progress: bool = True) -> list[dict]:
    """One run per (load, prompt set): `warmup` unmeasured requests (closed loop), then every
    prompt of the set under the load. Returns the runs' metrics. Where the backend can (embedded),
    each run starts from an empty prefix cache; a server keeps what the warm-up and earlier runs
    sent, so their prompts hit it again."""
    from tqdm import tqdm

    runs = []
    for load in loads:
        for name, prompts in prompt_sets.items():
            _warm_up(backend, prompts, sampling, load, warmup)
            before = _counters(backend)
            with tqdm(total=len(prompts), desc=f"{name} {load.describe()}", unit="req",
                      disable=not show_progress) as bar:
                start = time.perf_counter()
                records = backend.run(prompts, sampling, load, bar.update)
                duration = time.perf_counter() - start
            runs.append(_run_metrics(name, load, len(prompts), records, duration, before, backend))
    return runs


# Pass p (1, 2, …): request i gets seed + (p − 1) · PASS_SEED_STRIDE + i; no two passes share a seed
# below a million prompts.
PASS_SEED_STRIDE = 1_000_000


def run_interleaved(backends: dict[str, EmbeddedBackend], prompt_sets: dict[str, list[Prompt]],
                    loads: Sequence[Load], sampling: BenchSampling, warmup: int = 1, slices: int | None = None,
                    show_progress: bool = True, passes: int = 1) -> list[dict]:
    """Engines compared in one process (`dflash bench --compare`): each (load, prompt set)'s prompts
    are cut into `slices` consecutive slices (None: `default_slices`; fewer where a slice would hold
    fewer prompts than the load's concurrency), and every slice runs on each engine back to back,
    the engines' order changing from slice to slice through every permutation (`slice_orders`). A
    host whose speed drifts over minutes (a shared CPU ran the same AR work 86 to 113 ms a round
    from one 20-second run to the next) then slows every engine alike, where separate processes
    minutes apart cannot resolve a few per cent. Per engine, one run's metrics over all its slices
    (output tok/s: its tokens over its slices' summed durations; its prefix cache is emptied once,
    after the warm-up, as `run_bench` does), with `engine` and each slice's `slice_output_tok_s`.
    With `passes` > 1 all of it runs that many times on the same engines, whose policies carry what
    they learnt from pass to pass as a server's do, each pass with other seeds; each run has its
    `pass` (1, 2, …)."""
    names = list(backends)
    orders = slice_orders(names)
    slices = slices or default_slices(len(names))
    runs = []
    for pass_index in range(1, passes + 1):
        pass_sampling = sampling if sampling.seed is None else replace(
            sampling, seed=sampling.seed + PASS_SEED_STRIDE * (pass_index - 1))
        tag = f"pass {pass_index}/{passes} " if passes > 1 else ""
        pass_runs = _interleaved_pass(backends, prompt_sets, loads, pass_sampling, warmup, orders, slices,
                                      show_progress, tag)
        runs += [{**run, "pass": pass_index} for run in pass_runs] if passes > 1 else pass_runs
    return runs


def _interleaved_pass(backends: dict[str, EmbeddedBackend], prompt_sets: dict[str, list[Prompt]],
                      loads: Sequence[Load], sampling: BenchSampling, warmup: int, orders: list[tuple[str, ...]],
                      slices: int, show_progress: bool, tag: str) -> list[dict]:
    """One pass of `run_interleaved` over every load and prompt set (`tag` heads its progress bars)."""
    from tqdm import tqdm

    names = list(backends)
    runs = []
    for load in loads:
        for set_name, prompts in prompt_sets.items():
            count = max(1, min(slices, len(prompts) // (load.concurrency or 1)))
            bounds = [len(prompts) * i // count for i in range(count + 1)]
            parts = [prompts[a:b] for a, b in itertools.pairwise(bounds)]
            for backend in backends.values():
                _warm_up(backend, prompts, sampling, load, warmup)
            before = {name: _counters(backend) for name, backend in backends.items()}
            records: dict[str, list[RequestRecord]] = {name: [] for name in names}
            durations: dict[str, list[float]] = {name: [] for name in names}
            slice_tok_s: dict[str, list[float]] = {name: [] for name in names}
            with tqdm(total=len(prompts) * len(names), desc=f"{tag}{set_name} {load.describe()}", unit="req",
                      disable=not show_progress) as bar:
                for j, part in enumerate(parts):
                    for name in orders[j % len(orders)]:
                        start = time.perf_counter()
                        part_records = backends[name].run(part, sampling, load, bar.update)
                        duration = time.perf_counter() - start
                        records[name] += part_records
                        durations[name].append(duration)
                        slice_tok_s[name].append(summarize(part_records, duration)["output_tok_s"])
            for name, backend in backends.items():
                run = _run_metrics(set_name, load, len(prompts), records[name], sum(durations[name]), before[name],
                                   backend)
                runs.append({"engine": name, **run, "slice_output_tok_s": slice_tok_s[name]})
    return runs


def default_slices(num_engines: int) -> int:
    """Slices a run by default: every order of the engines once (`slice_orders`), at least 4."""
    return max(4, math.factorial(num_engines))


def slice_orders(names: Sequence[str]) -> list[tuple[str, ...]]:
    """The engines' order in successive slices: every permutation, so that over n! slices each
    engine runs first, second, … equally often and follows each other engine equally often — a
    rotation made each one follow the same neighbour, and a slice's first run may pay for the
    engine run before it (caches, clocks)."""
    return list(itertools.permutations(names))


def _warm_up(backend, prompts: list[Prompt], sampling: BenchSampling, load: Load, warmup: int) -> None:
    """`warmup` unmeasured requests, closed loop; then the embedded engine's prefix cache is emptied."""
    if warmup:
        backend.run(prompts[:warmup], sampling, Load(concurrency=min(warmup, load.concurrency or warmup)))
    getattr(backend, "clear_prefix_cache", lambda: None)()


def _counters(backend) -> tuple:
    """What a run's metrics are differences of, where the backend has them: the server's spec
    counters (a server whose requests carry none), the prefix cache's, the embedded engine's phases."""
    return tuple(getattr(backend, name, lambda: None)()
                 for name in ("spec_counters", "prefix_cache_counters", "step_timings"))


def _run_metrics(name: str, load: Load, num_prompts: int, records: list[RequestRecord], duration: float,
                 before: tuple, backend) -> dict:
    """A run's report from its records and what the backend's counters moved since `before`; an
    embedded adaptive engine adds its policy's estimates at the run's end, at the run's fullest batch and
    its rounds' mean context (at the costs' own, k = 7 read cheaper than k = 3 where the policy, pricing
    each round at its own, never did: BENCHMARKS, thirty-fifth session)."""
    after = _counters(backend)
    server_spec, prefix_cache, timings = (None if b is None else a - b for a, b in zip(after, before, strict=True))
    # vLLM's keys: a closed loop of c clients is its infinite rate with at most c in flight.
    rate = load.request_rate if load.request_rate not in (None, math.inf) else "inf"
    batch = min(load.concurrency or num_prompts, num_prompts)  # the most sequences the run held at once
    rounds = sum(timings.period_rounds_by_k.values()) if timings is not None else 0
    context = timings.period_context / rounds if rounds else None
    policy = getattr(backend, "policy_estimates", lambda n, context: None)(batch, context)
    return {"dataset": name, "concurrency": load.concurrency, "request_rate": rate,
            "max_concurrency": load.concurrency, "burstiness": 1.0, "num_prompts": num_prompts,
            **summarize(records, duration, server_spec, prefix_cache), "engine_ms_per_round": round_times_ms(timings),
            **({"policy": policy} if policy else {})}


def round_times_ms(timings) -> dict | None:
    """An embedded run's engine phases per round, in ms (`StepTimings`: host is the Python time of
    launching and finishing rounds; draft, verify, accept are device times on a GPU). The same
    work's host time differs between processes on a shared host: it tells the machine's drift
    from the engine's choices when runs of one cell spread. By k, [rounds, mean ms] of the rounds' periods
    (`StepTimings.period_by_k`): what the adaptive policy weighs."""
    if timings is None or not timings.rounds:
        return None
    per_round = {name: 1e3 * getattr(timings, name) / timings.rounds for name in ("host", "draft", "verify", "accept")}

    def periods(rounds: dict[int, int], seconds: dict[int, float]) -> dict[int, list]:
        return {k: [n, round(1e3 * seconds[k] / n, 4)] for k, n in sorted(rounds.items()) if n}

    return {"rounds": timings.rounds, **per_round, "rounds_by_k": timings.rounds_by_k,
            "period_ms_by_k": periods(timings.period_rounds_by_k, timings.period_by_k)}


def write_report(out_dir: str | Path, setup: dict, runs: list[dict]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "results.png"]
    paths[0].write_text(json.dumps({"setup": setup, "runs": runs}, indent=2) + "\n")
    paths[1].write_text(markdown_report(setup, runs))
    plot(runs, paths[2])
    return paths


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def load_label(run: dict) -> str:
    """c=N for N clients (closed loop); R/s (at most N in flight) for Poisson arrivals."""
    if run["request_rate"] == "inf":
        return f"c={run['concurrency']}" if run["concurrency"] else "all at once"
    return f"{run['request_rate']:g}/s" + (f" ≤{run['concurrency']}" if run["concurrency"] else "")


def run_label(run: dict) -> str:
    """The prompt set, and the engine where `--compare` ran several (and the pass, where it ran several)."""
    if "engine" not in run:
        return run["dataset"]
    return f"{set_label(run)} ({run['engine']})"


def set_label(run: dict) -> str:
    """The prompt set, and the pass where `--compare --passes` ran several."""
    return f"{run['dataset']}, pass {run['pass']}" if "pass" in run else run["dataset"]


def comparison_lines(runs: list[dict]) -> list[str]:
    """`--compare`'s table: each engine's output tok/s per (prompt set, load), and every other
    engine's ratio to the first one named: pooled (tokens over summed durations), and the median
    (min–max) of its slices' ratios — the slices ran back to back, so their range is what the
    host's drift left of the comparison, and the median is not moved by one slice that a stall
    on the host slowed."""
    engines = list(dict.fromkeys(r["engine"] for r in runs))
    first, others = engines[0], engines[1:]
    lines = [f"Engines compared in one process, slices interleaved (ratios to {first}; by slice: median (min–max)):",
             "", "| dataset | load | " + " | ".join(f"{e} tok/s" for e in engines) + " | "
             + " | ".join(f"{e} / {first} | by slice" for e in others) + " |",
             "|---|---|" + "---:|" * len(engines) + "---:|---|" * len(others)]
    cells = {(set_label(r), load_label(r), r["engine"]): r for r in runs}
    for dataset, load in dict.fromkeys((set_label(r), load_label(r)) for r in runs):
        base = cells[dataset, load, first]
        row = [f"{cells[dataset, load, e]['output_tok_s']:.1f}" for e in engines]
        for e in others:
            run = cells[dataset, load, e]
            ratios = [a / b for a, b in zip(run["slice_output_tok_s"], base["slice_output_tok_s"], strict=True) if b]
            pooled = run["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else None
            spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})" if ratios else "-"
            row += [_fmt(pooled, ".3f"), spread]
        lines.append(f"| {dataset} | {load} | " + " | ".join(row) + " |")
    return lines


def markdown_report(setup: dict, runs: list[dict]) -> str:
    drafter = setup.get("drafter") or "none (target-only)"
    lines = [
        "# dflash bench",
        "",
        f"target `{setup.get('target')}`, drafter `{drafter}`, backend {setup.get('backend')}; max_tokens "
        f"{setup['max_tokens']}, temperature {setup['temperature']}, {setup['warmup']} warm-up request(s) per run"
        + (f"; engines compared in one process: {', '.join(setup['engines'])}, {setup['slices']} slices a run"
           + (f", {setup['passes']} passes on the same engines. " if setup.get("passes", 1) > 1 else ". ")
           if "engines" in setup else ". ") +
        "Latencies in ms (mean / median / p99).",
        "",
        "| dataset | load | ok | failed | output tok/s | TTFT | TPOT | ITL | τ | τ per request | acceptance |",
        "|---|---|---:|---|---:|---|---|---|---:|---:|---:|",
    ]
    for r in runs:
        failed = str(r["failed"])
        if r["error_codes"]:
            failed += " (" + ", ".join(f"{code}: {n}" for code, n in r["error_codes"].items()) + ")"
        latency = ["/".join(_fmt(r[key][stat]) for stat in ("mean", "median", "p99"))
                   for key in ("ttft_ms", "tpot_ms", "itl_ms")]
        lines.append(f"| {run_label(r)} | {load_label(r)} | {r['completed']} | {failed} | {r['output_tok_s']:.1f} | "
                     f"{' | '.join(latency)} | {_fmt(r['tau'], '.2f')} | {_fmt(r['tau_per_request'], '.2f')} | "
                     f"{_fmt(r['acceptance_rate'], '.1%')} |")
    positions = max((len(r["acceptance_per_position"]) for r in runs), default=0)
    if positions:
        lines += ["", "Acceptance per draft position (fraction of rounds):", "",
                  "| dataset | load | " + " | ".join(str(j + 1) for j in range(positions)) + " |",
                  "|---|---|" + "---:|" * positions]
        for r in runs:
            cells = [f"{a:.2f}" for a in r["acceptance_per_position"]]
            cells += ["-"] * (positions - len(cells))
            lines.append(f"| {run_label(r)} | {load_label(r)} | " + " | ".join(cells) + " |")
    timed = [r for r in runs if r.get("engine_ms_per_round")]
    if timed:
        lines += ["", "The engine's rounds (embedded; ms per round: host, the Python time of launching and finishing "
                  "them; draft, verify, accept: device times on a GPU):", "",
                  "| dataset | load | rounds | host | draft | verify | accept |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in timed:
            t = r["engine_ms_per_round"]
            lines.append(f"| {run_label(r)} | {load_label(r)} | {t['rounds']} | "
                         + " | ".join(f"{t[k]:.3f}" for k in ("host", "draft", "verify", "accept")) + " |")
        lines += ["", "Each k's rounds read in the step loop, and their mean period (ms: from the later of the "
                  "round's launch and the last read to its read; what the adaptive policy weighs):",
                  "", "| dataset | load | k | rounds | ms |", "|---|---|---:|---:|---:|"]
        for r in timed:
            t = r["engine_ms_per_round"]
            for k, (n, ms) in t["period_ms_by_k"].items():
                lines.append(f"| {run_label(r)} | {load_label(r)} | {k} | {n} | {ms:.3f} |")
    conversational = [r for r in runs if len(r["turns"]) > 1]
    if conversational:
        lines += ["", "Per turn of the conversations (each turn sent once the answer to the one before arrived; "
                  "prefix-cache hits: the run's prompt tokens found cached, all turns):", "",
                  "| dataset | load | turn | ok | mean prompt tokens | TTFT | TPOT | E2E | prefix-cache hits |",
                  "|---|---|---:|---:|---:|---|---|---|---:|"]
        for r in conversational:
            for t in r["turns"]:
                latency = ["/".join(_fmt(t[key][stat]) for stat in ("mean", "median", "p99"))
                           for key in ("ttft_ms", "tpot_ms", "e2el_ms")]
                lines.append(f"| {run_label(r)} | {load_label(r)} | {t['turn']} | {t['completed']} | "
                             f"{_fmt(t['mean_input_tokens'], '.0f')} | {' | '.join(latency)} | "
                             f"{_fmt(r['prefix_cache_hit_rate'], '.1%')} |")
    if any("engine" in r for r in runs):
        lines += ["", *comparison_lines(runs)]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """Left: acceptance per draft position, per prompt set (pooled over the loads: greedy
    acceptance does not depend on the batch). Right: output tok/s at each load."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    fig, (acc_ax, tps_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    speculated = False
    loads = list(dict.fromkeys(load_label(r) for r in runs))
    for name in dict.fromkeys(map(run_label, runs)):
        mine = [r for r in runs if run_label(r) == name]
        rounds = sum(r["rounds"] for r in mine)
        positions = max(len(r["accepted_per_position"]) for r in mine)
        if rounds and positions:
            pooled = [sum(r["accepted_per_position"][j] for r in mine if j < len(r["accepted_per_position"])) / rounds
                      for j in range(positions)]
            acc_ax.plot(range(1, positions + 1), pooled, marker="o", label=name)
            speculated = True
        tps_ax.plot([loads.index(load_label(r)) for r in mine], [r["output_tok_s"] for r in mine], marker="o",
                    label=name)
    acc_ax.set(title="acceptance per draft position", xlabel="draft position", ylabel="fraction of rounds",
               ylim=(0, 1.02))
    if not speculated:
        acc_ax.text(0.5, 0.5, "no drafts: target-only", ha="center", transform=acc_ax.transAxes)
    tps_ax.set(title="output throughput", xlabel="load", ylabel="output tok/s")
    tps_ax.set_xticks(range(len(loads)), labels=loads)
    for ax in (acc_ax, tps_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
