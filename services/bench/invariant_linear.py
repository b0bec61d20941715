"""GPU micro-benchmark of `engine.deterministic`'s GEMM: `InvariantLinear` under a search of launch
settings at the Qwen3-8B and SmolLM2-135M projections, against cuBLAS (F.linear) and `SkinnyLinear`.

    python -m dflash_serve.services.bench.invariant_linear --out invariant_linear.json

A setting may depend on the weight's shape, never on the row count M (that is what keeps a row's
bits the same in any batch), so each candidate is timed at every M and checked invariant: row 0's
bits at M = 1 equal row 0's at the largest M. Per shape, the chosen setting minimizes the sum over M
of its time over cuBLAS's. Then tiles for launches of MANY_ROWS rows or more (`many_rows`) under the
rule's reduction order, each checked to give every row of the largest M the rule's own bits. Timing
as `skinny_linear`'s (CUDA graphs over ~200 MB of weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch
import torch.nn.functional as F

from dflash_serve.kernels.invariant_linear import MANY_ROWS, InvariantLinear, InvariantSettings, Tile
from dflash_serve.kernels.skinny_linear import SkinnyLinear
from dflash_serve.services.bench.skinny_linear import SHAPES, STREAMED_BYTES, graph_time_us

# block_m 16 wastes fewer rows of a decode's tile (mma.sync rather than Hopper's warp-group MMA);
# split_k spreads a narrow layer's few column tiles over more programs.
# Tiles for launches of many rows (a batch's verify): the reduction order stays the rule's.
MANY_ROWS_SEARCH = [Tile(block_m=m, block_n=n, num_warps=w, num_stages=s)
                    for m, n, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))]
SEARCH = [InvariantSettings(block_m=m, block_n=n, block_k=128, group_m=8, num_warps=w, num_stages=s, split_k=split)
          for m, n, w, s, split in itertools.product((16, 64), (64, 128), (4, 8), (3, 5), (1, 2, 4, 8))]


def measure(n: int, k: int, rows: list[int], search: list[InvariantSettings]) -> dict:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(max(2, min(64, int(STREAMED_BYTES // (n * k * 2)))))]
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows}
    xs = {m: torch.cat([xs[rows[0]][:1], x[1:]]) for m, x in xs.items()}  # row 0 the same in every M
    base = {m: graph_time_us([lambda w=w, x=x: F.linear(x, w) for w in weights]) for m, x in xs.items()}
    skinny = {m: graph_time_us([lambda layer=SkinnyLinear(w), x=x: layer(x) for w in weights]) for m, x in xs.items()}
    candidates = []
    for settings in [InvariantSettings.for_shape(n, k), *search]:
        layers = [InvariantLinear(w, None, settings) for w in weights]
        first = {m: layers[0](x)[0] for m, x in xs.items()}
        invariant = all(torch.equal(first[rows[0]], row) for row in first.values())
        times = {m: graph_time_us([lambda layer=layer, x=x: layer(x) for layer in layers]) for m, x in xs.items()}
        candidates.append({"settings": str(settings), "invariant": invariant, "us": times,
                           "cost": sum(times[m] / base[m] for m in rows)})
    rule, *searched = candidates
    best = min((c for c in searched if c["invariant"]), key=lambda c: c["cost"], default=rule)
    many = [m for m in rows if m >= MANY_ROWS]
    tiles = []
    if many:
        rule_settings = InvariantSettings.for_shape(n, k)
        rule_bits = InvariantLinear(weights[0], None, rule_settings)(xs[many[-1]])  # every tile's reference
        tiles = [many_rows_candidate(rule_settings, rule_bits, tile, weights, xs, many, base) for tile in MANY_ROWS_SEARCH]
    runnable = [c for c in tiles if "error" not in c]
    best_tile = min((c for c in runnable if c["invariant"]), key=lambda c: c["cost"], default=None)
    return {"N": n, "K": k, "cublas_us": base, "skinny_us": skinny, "rule": rule, "best": best,
            "not_invariant": [c["settings"] for c in candidates + runnable if not c["invariant"]],
            "many_rows_best": best_tile, "many_rows_failed": [c for c in tiles if "error" in c]}


def many_rows_candidate(rule: InvariantSettings, rule_bits: torch.Tensor, tile: Tile, weights, xs: dict,
                        many: list[int], base: dict) -> dict:
    """The rule with `tile` for launches of MANY_ROWS rows or more: invariant if every row of the
    largest M has the bits the rule's own tile gives it (`rule_bits`, and so the bits it has alone)."""
    settings = dataclasses.replace(rule, many_rows=tile)
    layers = [InvariantLinear(w, None, settings) for w in weights]
    try:
        invariant = torch.equal(layers[0](xs[many[-1]]), rule_bits)
    except Exception as err:  # noqa: BLE001 - a tile too large for shared memory, say: reported, not fatal
        return {"tile": str(tile), "error": f"{type(err).__name__}: {str(err)[:200]}"}
    times = {m: graph_time_us([lambda layer=layer, x=xs[m]: layer(x) for layer in layers]) for m in many}
    return {"settings": str(settings), "tile": str(tile), "invariant": invariant, "us": times,
            "cost": sum(times[m] / base[m] for m in many)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,256,512", help="row counts M, the first the one every M's row 0 is")
    parser.add_argument("--models", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--no-search", dest="search", action="store_false",
                        help="time the rule alone (and the many-row tiles), not the other settings")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    results = []
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            results.append({"model": model, "gemm": name, **measure(n, k, rows, SEARCH if args.search else [])})
            print(json.dumps(results[-1]), flush=True)
            torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}; µs per call at M = {rows} (CUDA graphs, weights from HBM)")
    print("| model | GEMM | N × K | cuBLAS | SkinnyLinear | InvariantLinear now | best invariant setting | its µs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        fmt = lambda times: " / ".join(f"{times[m]:.1f}" for m in rows)  # noqa: E731
        print(f"| {r['model']} | {r['gemm']} | {r['N']} × {r['K']} | {fmt(r['cublas_us'])} | {fmt(r['skinny_us'])} | "
              f"{fmt(r['rule']['us'])} | {r['best']['settings']} | {fmt(r['best']['us'])} |")
    many = [m for m in rows if m >= MANY_ROWS]
    if many:
        print(f"\nmany-row tiles (M = {many}): the best invariant one against cuBLAS")
        print("| model | GEMM | cuBLAS | rule's tile | best many-row tile | its µs |")
        print("|---|---|---|---|---|---|")
        fmt = lambda times: " / ".join(f"{times[m]:.1f}" for m in many)  # noqa: E731
        for r in results:
            best = r["many_rows_best"]
            print(f"| {r['model']} | {r['gemm']} | {fmt(r['cublas_us'])} | {fmt(r['rule']['us'])} | "
                  f"{best['tile'] if best else 'none invariant'} | {fmt(best['us']) if best else ''} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
