"""GPU micro-benchmark of seeded sampling: `sample_tokens` with the race's plain-torch reference
(the int64 hash chain over [rows, V], the path before the kernel) against the fused kernel
(`dflash_serve.kernels.sample_race`), with greedy `row_argmax` as the floor.

    python -m dflash_serve.services.bench.sampling [--rows 1,8,16,128,512] [--vocab 49152,151936] [--out FILE]

bf16 logits, temperature 1, every request sampling; rows of 16 or more are rows/16 requests of a
16-slot speculative block, fewer rows are that many requests of one slot (target-only decoding). One
case per vocabulary adds top-p 0.9 (its sort stays in torch; the kernel applies the threshold).
µs per call from CUDA events, median of --iters calls after warm-up; the tokens of both paths are
compared (a mismatch is only possible at a near-tie of race scores, an ulp of float32 log apart).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dflash_serve.kernels import row_argmax, sample_race_reference
from dflash_serve.services.engine import sampling
from dflash_serve.services.engine.sampling import SamplingBatch, SamplingParams, sample_tokens

TOP_P_ROWS = (16, 512)


def cuda_time_us(call, iters: int) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(rows: int, vocab: int, top_p: float, iters: int) -> dict:
    slots = 16 if rows >= 16 else 1
    n = rows // slots
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = (torch.randn(n, slots, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=1000 + i) for i in range(n)]
    batch = SamplingBatch.build(params, [p.seed for p in params], "cuda")
    positions = torch.arange(n * slots, device="cuda").view(n, slots) + 500

    kernel = lambda: sample_tokens(logits, batch, positions)  # noqa: E731

    def reference():
        original = sampling.sample_race
        sampling.sample_race = sample_race_reference
        try:
            return sample_tokens(logits, batch, positions)
        finally:
            sampling.sample_race = original

    mismatches = int((kernel() != reference()).sum())
    return {"rows": rows, "vocab": vocab, "requests": n, "slots": slots, "top_p": top_p,
            "reference_us": cuda_time_us(reference, iters), "kernel_us": cuda_time_us(kernel, iters),
            "argmax_us": cuda_time_us(lambda: row_argmax(logits), iters), "mismatches": mismatches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,128,512", help="comma-separated row counts (N × S)")
    parser.add_argument("--vocab", default="49152,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    vocabs = [int(v) for v in args.vocab.split(",")]
    if not torch.cuda.is_available():
        print("sampling benchmark: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    results = []
    for vocab in vocabs:
        cases = [(rows, 1.0) for rows in rows_list] + [(rows, 0.9) for rows in TOP_P_ROWS if rows in rows_list]
        for rows, top_p in cases:
            results.append(measure(rows, vocab, top_p, args.iters))
            print(json.dumps(results[-1]), flush=True)
            torch.cuda.empty_cache()
    print(f"\ndevice {torch.cuda.get_device_name()}; bf16 logits, temperature 1; µs per sample_tokens call "
          f"(CUDA events, median of {args.iters})")
    print("| rows (N × S) | V | top-p | torch reference µs | kernel µs | speed-up | row_argmax µs | mismatches |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} ({r['requests']} × {r['slots']}) | {r['vocab']} | {r['top_p']:g} | "
              f"{r['reference_us']:.1f} | {r['kernel_us']:.1f} | {r['reference_us'] / r['kernel_us']:.1f}× | "
              f"{r['argmax_us']:.1f} | {r['mismatches']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
