"""Host time of the speculation policy per round, as the engine spends it: `SpeculationPolicy.choose`
before a round's launch, and after its read `observe_round` (acceptance) and `observe_round_time`
(wall time). No model: round costs are a synthetic table at the engine's measured batch sizes.

    python -m dflash_serve.services.bench.policy [--batch-sizes 1,8,32] [--rounds 3000] [--reps 7] [--out FILE]

Where the target is small, a round at high concurrency is bound by the host (on the H100 with the
default pair at 32 sequences, ~1.7–2.3 ms of Python and launches a round while the device idles), so
every µs the policy takes is a µs of every round. µs per round, the choice and the observations
apart: the minimum over `--reps` of the mean over `--rounds` rounds (on a shared machine other
processes only ever add time). The accepted drafts come from a seeded generator, drawn before the
timing, so every run and mode sees the same rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.round_costs import RoundCosts
from dflash_serve.services.engine.speculation import SpeculationPolicy, k_buckets

BLOCK = 16
SIZES = (1, 2, 4, 8, 16, 32)  # the batch sizes `Engine.measure_round_costs` times on a GPU
CONTEXT = 256


def synthetic_costs() -> RoundCosts:
    """A verify that grows with k and the batch, a draft that grows with the batch, ms-scale."""
    ks = k_buckets(BLOCK)
    verify = {k: [1e-3 * (1 + 0.02 * k + 0.03 * i) for i in range(len(SIZES))] for k in ks}
    return RoundCosts(SIZES, verify, [2e-4 * (1 + 0.1 * i) for i in range(len(SIZES))], context=CONTEXT,
                      verify_slope=[1e-7] * len(SIZES), draft_slope=[1e-8] * len(SIZES))


def time_rounds(mode: str, n: int, rounds: int, reps: int) -> dict[str, float]:
    """µs per round of `choose` and of the observations after the round, at batch n."""
    policy = SpeculationPolicy(EngineConfig(target="t", drafter="d", speculation=mode), BLOCK, synthetic_costs())
    caps = [None] * n
    rng = random.Random(0)
    draws = [[rng.randint(0, 5) for _ in range(n)] for _ in range(256)]  # drafts each sequence would have accepted
    best = {"choose_us": float("inf"), "observe_us": float("inf")}
    clock = time.perf_counter
    for _ in range(reps):
        choose = observe = 0.0
        for i in range(rounds):
            context = CONTEXT + i % 64
            t0 = clock()
            k = policy.choose(caps, context)
            t1 = clock()
            accepted = [min(k, a) for a in draws[i % len(draws)]]
            t2 = clock()
            policy.observe_round(k, [k] * n, accepted)
            policy.observe_round_time(n, k, 1.1e-3, context, 0.9e-3)
            observe += clock() - t2
            choose += t1 - t0
        best["choose_us"] = min(best["choose_us"], 1e6 * choose / rounds)
        best["observe_us"] = min(best["observe_us"], 1e6 * observe / rounds)
    return best


def _sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes as integers, e.g. 1,8,32") from None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=_sizes, default=[1, 8, 32], help="comma-separated, e.g. 1,8,32")
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    sizes = args.batch_sizes
    if args.rounds < 1 or args.reps < 1 or any(n < 1 for n in sizes):
        parser.error("--rounds, --reps and every batch size must be ≥ 1")
    rows = [{"mode": mode, "batch": n, **time_rounds(mode, n, args.rounds, args.reps)}
            for mode in ("fixed", "adaptive") for n in sizes]
    print("| policy | batch | choose µs/round | observe µs/round |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['mode']} | {row['batch']} | {row['choose_us']:.1f} | {row['observe_us']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
