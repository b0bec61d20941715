"""`dflash bench`: a closed-loop load generator against the gRPC server or the embedded engine.

For each concurrency level and prompt set, `concurrency` clients each send their next request as
soon as their last one ends (after `warmup` requests that are not measured), streaming every
response. Reported per run (see `summarize`):

- output tok/s: completion tokens of successful requests / wall time of the run;
- TTFT (request sent -> first token), TPOT ((last token - first token) / (tokens - 1), per request)
  and ITL (inter-token latency: a message's gap since the previous one, spread over its tokens,
  as the server's own metric does; the tokens of one speculative round arrive together): mean,
  median and p99, in ms;
- τ (1 + accepted drafts / rounds, pooled over the run's rounds; includes the bonus token),
  acceptance rate (accepted / drafted tokens), acceptance per draft position (fraction of rounds
  whose draft at that position was accepted), from each request's final spec_stats;
- failed requests, by status code.

Results go to DIR/results.json, DIR/results.md and DIR/results.png.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.bench.prompts import Prompt


@dataclass(frozen=True)
class BenchSampling:
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None  # request i gets seed + i: reproducible, yet not one stream for all
    ignore_eos: bool = False

    def request_seed(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index


@dataclass
class RequestRecord:
    """One request as the client saw it (perf_counter seconds)."""

    start: float
    # (arrival time, token count) of each streamed message that carried tokens.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    output_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    error: str | None = None  # the status code's name when the request failed

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

    def itls(self) -> list[float]:
        gaps = []
        for (before, _), (now, count) in zip(self.arrivals, self.arrivals[1:]):
            gaps.extend([(now - before) / count] * count)
        return gaps


# -- statistics ---------------------------------------------------------------------------------


def distribution_ms(seconds: Sequence[float]) -> dict:
    if not seconds:
        return {"mean": None, "median": None, "p99": None}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p99": float(np.percentile(ms, 99))}


def summarize(records: Sequence[RequestRecord], duration: float) -> dict:
    """The run's metrics; speculation counters are pooled over the successful requests' rounds."""
    ok = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    drafted = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    per_request = [1 + r.accepted_tokens / r.rounds for r in ok if r.rounds]
    per_position = [0] * max((len(r.accepted_per_position) for r in ok), default=0)
    for r in ok:
        for j, count in enumerate(r.accepted_per_position):
            per_position[j] += count
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration if duration > 0 else 0.0,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itls()]),
        # Target-only serving has no rounds with drafts: τ and acceptance do not apply (None).
        "rounds": rounds,
        "tau": 1 + accepted / rounds if rounds else None,
        # DFlash's own benchmark script (spec §3.1) averages each request's τ instead; short answers
        # weigh as much as long ones, so it reads higher where they accept more.
        "tau_per_request": statistics.fmean(per_request) if per_request else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_position": per_position,
        "acceptance_per_position": [c / rounds for c in per_position] if rounds else [],
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
                "block_size": self.engine.block_size, "device": str(self.engine.device)}

    def _prompt_ids(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok.chat_template:
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        return tok.encode(text)

    def run(self, prompts: Sequence[Prompt], sampling: BenchSampling, concurrency: int,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        from services.engine.sampling import SamplingParams
        from services.engine.stopping import FinishReason

        engine, records, active = self.engine, [], {}
        queue = list(enumerate(prompts))[::-1]  # popped from the end: in order
        while queue or active:
            while queue and len(active) < concurrency:
                index, prompt = queue.pop()
                params = SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                                        seed=sampling.request_seed(index), ignore_eos=sampling.ignore_eos)
                record = RequestRecord(start=time.perf_counter())
                records.append(record)
                try:
                    active[engine.add_request(self._prompt_ids(prompt.text), params)] = record
                except ValueError:  # what the server answers with INVALID_ARGUMENT
                    record.error = "INVALID_ARGUMENT"
                    progress()
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                record = active.get(out.request_id)
                if record is None:
                    continue
                record.tokens_arrived(now, len(out.new_token_ids))
                if out.finished:
                    del active[out.request_id]
                    engine.release(out.request_id)
                    record.output_tokens = out.num_output_tokens
                    if out.finish_reason is FinishReason.ERROR:
                        record.error = "INTERNAL"
                    _take_stats(record, out.stats.rounds, out.stats.draft_tokens, out.stats.accepted_tokens,
                                out.stats.accepted_per_position)
                    progress()
        return records


class GrpcBackend:
    """Streams `dflash.v1.Generation/Generate` calls over one channel, `concurrency` at a time."""

    def __init__(self, address: str, timeout: float = 600.0):
        self.address = address
        self.timeout = timeout

    def describe(self) -> dict:
        from services.client import model_info

        info = model_info(self.address, timeout=10)
        return {"backend": "grpc", "address": self.address, "target": info.target, "drafter": info.drafter,
                "block_size": info.block_size, "topology": info.topology}

    def run(self, prompts: Sequence[Prompt], sampling: BenchSampling, concurrency: int,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        return asyncio.run(self._run(prompts, sampling, concurrency, progress))

    async def _run(self, prompts, sampling, concurrency, progress) -> list[RequestRecord]:
        import grpc

        from services.api.dflash.v1 import generation_pb2_grpc
        from services.client import build_request

        records: list[RequestRecord] = []
        queue = list(enumerate(prompts))[::-1]
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def client() -> None:
                while queue:
                    index, prompt = queue.pop()
                    params = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                              "ignore_eos": sampling.ignore_eos}
                    if sampling.seed is not None:
                        params["seed"] = sampling.request_seed(index)
                    request = build_request(chat=[{"role": "user", "content": prompt.text}], sampling=params)
                    record = RequestRecord(start=time.perf_counter())
                    records.append(record)
                    await self._one(stub, request, record)
                    progress()

            await asyncio.gather(*(client() for _ in range(concurrency)))
        return records

    async def _one(self, stub, request, record: RequestRecord) -> None:
        import grpc

        last = None
        try:
            async for response in stub.Generate(request, timeout=self.timeout):
                record.tokens_arrived(time.perf_counter(), len(response.token_ids))
                last = response
        except grpc.aio.AioRpcError as err:
            record.error = err.code().name
        if record.error is None and (last is None or not last.HasField("usage")):
            record.error = "INCOMPLETE"  # the stream ended without its final message
        if record.error is None:
            stats = last.spec_stats
            record.output_tokens = last.usage.completion_tokens
            _take_stats(record, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                        stats.accepted_per_position)


def _take_stats(record: RequestRecord, rounds: int, drafted: int, accepted: int, per_position) -> None:
    record.rounds, record.draft_tokens, record.accepted_tokens = rounds, drafted, accepted
    record.accepted_per_position = list(per_position)


# -- the benchmark ------------------------------------------------------------------------------


def run_bench(backend, prompt_sets: dict[str, list[Prompt]], concurrencies: Sequence[int], sampling: BenchSampling,
              warmup: int = 1, show_progress: bool = True) -> list[dict]:
    """One run per (concurrency, prompt set): `warmup` unmeasured requests at that concurrency,
    then every prompt of the set. Returns the runs' metrics."""
    from tqdm import tqdm

    runs = []
    for concurrency in concurrencies:
        for name, prompts in prompt_sets.items():
            if warmup:
                backend.run(prompts[:warmup], sampling, concurrency)
            with tqdm(total=len(prompts), desc=f"{name} c={concurrency}", unit="req", disable=not show_progress) as bar:
                start = time.perf_counter()
                records = backend.run(prompts, sampling, concurrency, bar.update)
                duration = time.perf_counter() - start
            runs.append({"dataset": name, "concurrency": concurrency, **summarize(records, duration)})
    return runs


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


def markdown_report(setup: dict, runs: list[dict]) -> str:
    drafter = setup.get("drafter") or "none (target-only)"
    lines = [
        "# dflash bench",
        "",
        f"target `{setup.get('target')}`, drafter `{drafter}`, backend {setup.get('backend')}; max_tokens "
        f"{setup['max_tokens']}, temperature {setup['temperature']}, {setup['warmup']} warm-up request(s) per run. "
        "Latencies in ms (mean / median / p99).",
        "",
        "| dataset | concurrency | ok | failed | output tok/s | TTFT | TPOT | ITL | τ | τ per request | acceptance |",
        "|---|---:|---:|---|---:|---|---|---|---:|---:|---:|",
    ]
    for r in runs:
        failed = str(r["failed"])
        if r["errors"]:
            failed += " (" + ", ".join(f"{code}: {n}" for code, n in r["errors"].items()) + ")"
        latency = ["/".join(_fmt(r[key][stat]) for stat in ("mean", "median", "p99"))
                   for key in ("ttft_ms", "tpot_ms", "itl_ms")]
        lines.append(f"| {r['dataset']} | {r['concurrency']} | {r['completed']} | {failed} | {r['output_tok_s']:.1f} | "
                     f"{' | '.join(latency)} | {_fmt(r['tau'], '.2f')} | {_fmt(r['tau_per_request'], '.2f')} | "
                     f"{_fmt(r['acceptance_rate'], '.1%')} |")
    positions = max((len(r["acceptance_per_position"]) for r in runs), default=0)
    if positions:
        lines += ["", "Acceptance per draft position (fraction of rounds):", "",
                  "| dataset | concurrency | " + " | ".join(str(j + 1) for j in range(positions)) + " |",
                  "|---|---:|" + "---:|" * positions]
        for r in runs:
            cells = [f"{a:.2f}" for a in r["acceptance_per_position"]]
            cells += ["-"] * (positions - len(cells))
            lines.append(f"| {r['dataset']} | {r['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """Left: acceptance per draft position, per prompt set (pooled over concurrency levels: greedy
    acceptance does not depend on the batch). Right: output tok/s against concurrency."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    fig, (acc_ax, tps_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    speculated = False
    for name in dict.fromkeys(r["dataset"] for r in runs):
        mine = [r for r in runs if r["dataset"] == name]
        rounds = sum(r["rounds"] for r in mine)
        positions = max(len(r["accepted_per_position"]) for r in mine)
        if rounds and positions:
            pooled = [sum(r["accepted_per_position"][j] for r in mine if j < len(r["accepted_per_position"])) / rounds
                      for j in range(positions)]
            acc_ax.plot(range(1, positions + 1), pooled, marker="o", label=name)
            speculated = True
        tps_ax.plot([r["concurrency"] for r in mine], [r["output_tok_s"] for r in mine], marker="o", label=name)
    acc_ax.set(title="acceptance per draft position", xlabel="draft position", ylabel="fraction of rounds",
               ylim=(0, 1.02))
    if not speculated:
        acc_ax.text(0.5, 0.5, "no drafts: target-only", ha="center", transform=acc_ax.transAxes)
    levels = sorted({r["concurrency"] for r in runs})
    tps_ax.set(title="output throughput", xlabel="concurrency", ylabel="output tok/s")
    tps_ax.set_xscale("log", base=2)
    tps_ax.set_xticks(levels, labels=[str(c) for c in levels])
    tps_ax.minorticks_off()
    for ax in (acc_ax, tps_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
