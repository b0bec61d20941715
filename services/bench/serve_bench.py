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

Results go to DIR/results.json, DIR/results.md and DIR/results.png. Here: the runs (`run_bench`,
`run_interleaved`); what requests are sent and recorded: workload.py; who sends them:
load_generators.py; a run's metrics: summary.py; the report: report.py and plots.py.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from dflash_serve.services.bench.load_generators import EmbeddedBackend
from dflash_serve.services.bench.plots import plot
from dflash_serve.services.bench.prompts import Prompt
from dflash_serve.services.bench.report import markdown_report
from dflash_serve.services.bench.summary import round_times_ms, summarize
from dflash_serve.services.bench.workload import BenchSampling, Load, RequestRecord


def run_bench(backend, prompt_sets: dict[str, list[Prompt]], loads: Sequence[Load], sampling: BenchSampling,
              warmup: int = 1, show_progress: bool = True, min_seconds: float = 0.0) -> list[dict]:
    """One run per (load, prompt set): `warmup` unmeasured requests (closed loop), then every
    prompt of the set under the load. Returns the runs' metrics. Where the backend can (embedded),
    each run starts from an empty prefix cache; a server keeps what the warm-up and earlier runs
    sent, so their prompts hit it again. A run that took under `min_seconds` sends the set again
    (the embedded cache emptied first) until they add up to that, and reports them pooled with their
    `repeats`: a second-long run at c 32 resolves no better than ±20 % from one run to the next."""
    from tqdm import tqdm

    runs = []
    for load in loads:
        for name, prompts in prompt_sets.items():
            _warm_up(backend, prompts, sampling, load, warmup)
            before = _counters(backend)
            with tqdm(total=len(prompts), desc=f"{name} {load.describe()}", unit="req",
                      disable=not show_progress) as bar:
                start, repeats = time.perf_counter(), 1
                records = backend.run(prompts, sampling, load, bar.update)
                while time.perf_counter() - start < min_seconds:
                    _clear_prefix_cache(backend)
                    bar.total += len(prompts)
                    records += backend.run(prompts, sampling, load, bar.update)
                    repeats += 1
                duration = time.perf_counter() - start
            runs.append({**_run_metrics(name, load, len(prompts) * repeats, records, duration, before, backend),
                         "repeats": repeats})
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
    _clear_prefix_cache(backend)


def _clear_prefix_cache(backend) -> None:
    """The embedded engine's prefix cache emptied; a server's is out of the bench's reach."""
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


def write_report(out_dir: str | Path, setup: dict, runs: list[dict]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "results.png"]
    paths[0].write_text(json.dumps({"setup": setup, "runs": runs}, indent=2) + "\n")
    paths[1].write_text(markdown_report(setup, runs))
    plot(runs, paths[2])
    return paths
