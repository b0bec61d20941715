"""`dflash bench`'s report: results.md's tables, and the labels of runs that results.png shares (plots.py)."""

from __future__ import annotations

import statistics


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
        (f"A run under {setup['min_seconds']:g} s sent its prompts again until its runs lasted that long, "
         "pooled (ok counts every request). " if setup.get("min_seconds") else "") +
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
