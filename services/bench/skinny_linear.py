"""GPU micro-benchmark of the few-row GEMMs: cuBLAS (F.linear) against `dflash_serve.kernels.SkinnyLinear` with the
settings its rule picks for the shape, and the best of a small search over settings (which the
rule should match), at the linear layers of Qwen3-8B and SmolLM2-135M.

    python -m dflash_serve.services.bench.skinny_linear

Each GEMM is timed in a CUDA graph of calls over enough distinct weights (~200 MB) that they stream
from HBM as a forward's layers do, not from L2; µs per call, median of 15 replays. Also lists the
kernels cuBLAS launches for the call (a split-K GEMM brings a reduce kernel).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dflash_serve.kernels.skinny_linear import LaunchSettings, SkinnyLinear

SHAPES = {  # (N, K) of each projection: merged QKV, O, merged gate-up, down, LM head
    "Qwen3-8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)},
    "SmolLM2-135M": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
}
SEARCH = [LaunchSettings(*settings) for settings in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5))]
STREAMED_BYTES = 200e6


def graph_time_us(calls) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def cublas_kernels(x: torch.Tensor, weight: torch.Tensor) -> list[str]:
    F.linear(x, weight)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.linear(x, weight)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def measure(n: int, k: int, rows: int, search: bool) -> dict:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(max(2, min(64, int(STREAMED_BYTES // (n * k * 2)))))]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), weights[0].double())

    def timed(settings: LaunchSettings) -> float:
        layers = [SkinnyLinear(w, None, settings) for w in weights]
        err = ((layers[0](x).double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (n, k, settings, err)
        return graph_time_us([lambda layer=layer: layer(x) for layer in layers])

    rule = LaunchSettings.for_shape(n, k)
    row = {"N": n, "K": k, "rows": rows, "cublas_us": graph_time_us([lambda w=w: F.linear(x, w) for w in weights]),
           "cublas_kernels": len(cublas_kernels(x, weights[0])), "rule": str(rule), "rule_us": timed(rule)}
    if search:
        best = min(((timed(s), s) for s in SEARCH), key=lambda t: t[0])
        row.update(best_us=best[0], best=str(best[1]))
    row["GB/s rule"] = n * k * 2 / row["rule_us"] / 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--no-search", action="store_true", help="time the rule's settings only")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = []
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            for rows in [int(r) for r in args.rows.split(",")]:
                results.append({"model": model, "gemm": name, **measure(n, k, rows, not args.no_search)})
                print(json.dumps(results[-1]), flush=True)
                torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}; µs per call in a CUDA graph, weights streamed from HBM")
    print("| model | GEMM | N × K | rows | cuBLAS µs (kernels) | rule µs | best of search µs | cuBLAS / rule |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        best = f"{r['best_us']:.2f}" if "best_us" in r else "-"
        print(f"| {r['model']} | {r['gemm']} | {r['N']} × {r['K']} | {r['rows']} | {r['cublas_us']:.2f} "
              f"({r['cublas_kernels']}) | {r['rule_us']:.2f} | {best} | {r['cublas_us'] / r['rule_us']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
