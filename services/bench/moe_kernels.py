"""GPU micro-benchmark of a mixture-of-experts block's routing and experts (`dflash_serve.kernels.moe`):
the Triton path against the torch path (sort + grouped_mm), at Gemma-4-26B-A4B's and Qwen3-30B-A3B's
expert shapes, bfloat16, random weights and router logits.

    python -m dflash_serve.services.bench.moe_kernels [--tokens 1,4,16,32,128,512] [--search] [--out r.json]

Each variant is timed in a CUDA graph of calls over LAYERS layers' distinct weights (each layer's
experts 0.75-1.5 GB, so the routed ones stream from HBM as a forward's do); µs per call, median of
15 replays. Per tokens count T:

- `route_torch`: softmax, sort, gather, renormalize (the torch path, `moe_route_reference`);
  `route_triton`: `moe_route_triton`.
- `experts_torch`: `moe_experts_grouped` (sort, searchsorted, gather, two grouped_mm, activation,
  scatter, weighted sum); `grouped_mm`: its two grouped_mm calls and the activation alone, on rows
  already sorted; `experts_triton`: `moe_experts_triton` with the default settings (and with
  `--search`, the best of a small search over settings, for T ≤ 16).
- `floor_us`: the distinct routed experts' bytes at 4.2 TB/s (what the H200 streams in practice).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.runtime.errors import OutOfResources

from dflash_serve.kernels import gelu_tanh_mul, silu_mul
from dflash_serve.kernels.moe import (
    LaunchSettings,
    grouped_expert_ffn_grouped_mm,
    moe_experts_grouped,
    moe_experts_triton,
    moe_route_reference,
    moe_route_triton,
)
from dflash_serve.services.bench.skinny_linear import graph_time_us

SHAPES = {  # experts, hidden, intermediate, top k, activation, Gemma-4 (float32 weights, per-expert scale)
    "Gemma-4-26B-A4B": dict(experts=128, hidden=2816, width=704, top_k=8, activation=gelu_tanh_mul, gemma=True),
    "Qwen3-30B-A3B": dict(experts=128, hidden=2048, width=768, top_k=8, activation=silu_mul, gemma=False),
}
LAYERS = 4
BANDWIDTH = 4.2e12  # bytes/s an H200 streams in practice
SEARCH = [LaunchSettings(*s) for s in itertools.product((16, 32, 64), (128, 256), (16, 32), (128, 256), (4,), (3, 4))]
SEARCH_MAX_TOKENS = 16


class Layer:
    """One layer's experts, router logits and input for T tokens, routed by the torch path."""

    def __init__(self, shape: dict, tokens: int, generator: torch.Generator):
        e, h, i, k = shape["experts"], shape["hidden"], shape["width"], shape["top_k"]
        self.top_k = k
        self.gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=generator) * h**-0.5
        self.down = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=generator) * i**-0.5
        self.x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=generator)
        self.logits = torch.randn(tokens, e, device="cuda", dtype=torch.bfloat16, generator=generator)
        self.scale = torch.rand(e, device="cuda", generator=generator).bfloat16() + 0.5 if shape["gemma"] else None
        self.weights_dtype = torch.float32 if shape["gemma"] else torch.bfloat16
        self.weights, self.ids = self.route(triton=False)
        sorted_ids, by_expert = torch.sort(self.ids.reshape(-1), stable=True)
        self.sorted_rows = self.x[by_expert // k]
        self.ends = torch.searchsorted(sorted_ids, torch.arange(1, e + 1, device="cuda")).to(torch.int32)

    def route(self, triton: bool):
        route = moe_route_triton if triton else moe_route_reference
        return route(self.logits, self.top_k, True, self.scale, self.weights_dtype)

    def routed_bytes(self) -> int:
        per_expert = (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()
        return int(self.ids.unique().numel()) * per_expert


def measure(shape: dict, tokens: int, search: bool) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    layers = [Layer(shape, tokens, generator) for _ in range(LAYERS)]
    act, gelu_tanh = shape["activation"], shape["gemma"]

    def experts_triton(settings: LaunchSettings) -> float:
        first = layers[0]
        got = moe_experts_triton(first.x, first.ids, first.weights, first.gate_up, first.down, gelu_tanh=gelu_tanh,
                                 settings=settings)
        want = moe_experts_grouped(first.x, first.ids, first.weights, first.gate_up, first.down, act)
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-2, (tokens, settings, err)
        return graph_time_us([lambda layer=layer: moe_experts_triton(
            layer.x, layer.ids, layer.weights, layer.gate_up, layer.down, gelu_tanh=gelu_tanh, settings=settings)
            for layer in layers])

    triton_ids = layers[0].route(triton=True)[1]
    assert torch.equal(triton_ids, layers[0].ids), "Triton routing picked other experts"
    row = {
        "tokens": tokens,
        "floor_us": sum(layer.routed_bytes() for layer in layers) / LAYERS / BANDWIDTH * 1e6,
        "route_torch_us": graph_time_us([lambda layer=layer: layer.route(triton=False) for layer in layers]),
        "route_triton_us": graph_time_us([lambda layer=layer: layer.route(triton=True) for layer in layers]),
        "experts_torch_us": graph_time_us([lambda layer=layer: moe_experts_grouped(
            layer.x, layer.ids, layer.weights, layer.gate_up, layer.down, act) for layer in layers]),
        "grouped_mm_us": graph_time_us([lambda layer=layer: grouped_expert_ffn_grouped_mm(
            layer.sorted_rows, layer.ends, layer.gate_up, layer.down, act) for layer in layers]),
        "experts_triton_us": experts_triton(LaunchSettings()),
    }
    if search and tokens <= SEARCH_MAX_TOKENS:
        timed = []
        for settings in SEARCH:
            try:
                timed.append((experts_triton(settings), settings))
            except OutOfResources:  # the larger tiles at more stages exceed shared memory
                continue
        best = min(timed, key=lambda t: t[0])
        row.update(best_us=best[0], best=str(best[1]))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,32,128,512")
    parser.add_argument("--search", action="store_true", help=f"search launch settings (T ≤ {SEARCH_MAX_TOKENS})")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = []
    for model, shape in SHAPES.items():
        for tokens in [int(t) for t in args.tokens.split(",")]:
            results.append({"model": model, **measure(shape, tokens, args.search)})
            print(json.dumps(results[-1]), flush=True)
            torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}; µs per layer in a CUDA graph, weights streamed from HBM")
    print("| model | T | floor | route torch | route Triton | experts torch | grouped_mm alone | experts Triton "
          "| best of search | torch / Triton (route + experts) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        best = f"{r['best_us']:.1f} ({r['best']})" if "best_us" in r else "-"
        speedup = (r["route_torch_us"] + r["experts_torch_us"]) / (r["route_triton_us"] + r["experts_triton_us"])
        print(f"| {r['model']} | {r['tokens']} | {r['floor_us']:.1f} | {r['route_torch_us']:.1f} "
              f"| {r['route_triton_us']:.1f} | {r['experts_torch_us']:.1f} | {r['grouped_mm_us']:.1f} "
              f"| {r['experts_triton_us']:.1f} | {best} | {speedup:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
