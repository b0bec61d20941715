"""GPU micro-benchmark of seeded sampling: `sample_tokens` with the race's plain-torch reference
(the hash chain over [rows, V]: the CPU path, and the path before the kernel) against the fused kernel
(`dflash_serve.kernels.sample_race`), with greedy `row_argmax` as the floor.

    python -m dflash_serve.services.bench.sampling [--rows 1,8,16,128,512] [--vocab 49152,151936] [--out FILE]

bf16 logits, temperature 1, every request sampling; rows of 16 or more are rows/16 requests of a
16-slot speculative block, fewer rows are that many requests of one slot (target-only decoding). One
case per vocabulary adds top-p 0.9 (its sort stays in torch; the kernel applies the threshold).
µs per call: the device time (--iters calls captured in one CUDA graph, median of 7 replays) and,
in parentheses, eager calls launched back to back (host launch overhead included: the reference is
dozens of small launches, the kernel 2). The tokens of both paths are compared (a mismatch is only possible at a
near-tie of race scores, were the float32 logs to round apart).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dflash_serve.kernels import row_argmax, sample_race_reference
from dflash_serve.services.bench.timing import cuda_ms_per_call
from dflash_serve.services.engine import sampling
from dflash_serve.services.engine.sampling import SamplingBatch, sample_tokens
from dflash_serve.services.engine.sampling_params import SamplingParams

TOP_P_ROWS = (16, 512)


def graph_time_us(call, iters: int) -> float | None:
    """µs per call of the device work alone: `iters` calls captured in one CUDA graph, median of 7
    replays. None if the call cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                call()
    except RuntimeError as err:
        print(f"not captured in a CUDA graph: {err}", file=sys.stderr)
        return None
    graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def measure(rows: int, vocab: int, top_p: float, iters: int) -> dict:
    slots = 16 if rows >= 16 else 1
    n = rows // slots
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = (torch.randn(n, slots, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=1000 + i) for i in range(n)]
    batch = SamplingBatch.build(params, [p.seed for p in params], "cuda")
    positions = torch.arange(n * slots, device="cuda").view(n, slots) + 500

    def kernel():
        return sample_tokens(logits, batch, positions)

    def reference():
        original = sampling.sample_race
        sampling.sample_race = sample_race_reference
        try:
            return sample_tokens(logits, batch, positions)
        finally:
            sampling.sample_race = original

    def argmax():
        return row_argmax(logits)

    row = {"rows": rows, "vocab": vocab, "requests": n, "slots": slots, "top_p": top_p,
           "mismatches": int((kernel() != reference()).sum())}
    for name, call in (("reference", reference), ("kernel", kernel), ("argmax", argmax)):
        row[f"{name}_us"] = graph_time_us(call, iters)
        row[f"{name}_eager_us"] = 1e3 * cuda_ms_per_call(call, iters)
    return row


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
    print(f"\ndevice {torch.cuda.get_device_name()}; bf16 logits, temperature 1; µs per sample_tokens call: "
          f"device time in a CUDA graph of {args.iters} calls (eager, launched back to back, in parentheses)")
    print("| rows (N × S) | V | top-p | torch reference µs | kernel µs | speed-up | row_argmax µs | mismatches |")
    print("|---|---|---|---|---|---|---|---|")

    def us(r, name):
        graph = "-" if r[f"{name}_us"] is None else f"{r[f'{name}_us']:.1f}"
        return f"{graph} ({r[f'{name}_eager_us']:.1f})"

    for r in results:
        speedup = "-" if None in (r["reference_us"], r["kernel_us"]) else f"{r['reference_us'] / r['kernel_us']:.1f}×"
        print(f"| {r['rows']} ({r['requests']} × {r['slots']}) | {r['vocab']} | {r['top_p']:g} | "
              f"{us(r, 'reference')} | {us(r, 'kernel')} | {speedup} | {us(r, 'argmax')} | {r['mismatches']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
