"""GPU micro-benchmark of the fused decoder-layer ops: our Triton kernels against the same plain-torch
references run eagerly and compiled by torch.compile (inductor), at Qwen3-8B shapes.

    python -m dflash_serve.services.bench.layer_kernels

Each op is timed by CUDA graph replays (the way the engine runs them), median of `triton.testing.do_bench`
over fresh random inputs, for 1, 16, 512 and 8192 tokens (decode, a batch-1 verify, a batch-32 verify,
a prefill chunk); the argmax takes that many rows of Qwen3's 151,936-token vocabulary. The result says which implementation the fused forward should use.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from dflash_serve.kernels import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rope_kv_write_reference,
    rope_kv_write_triton,
    row_argmax_reference,
    row_argmax_triton,
    silu_mul_reference,
    silu_mul_triton,
)

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 12288, 32, 8, 128, 151936
PAGE, BLOCKS, MAX_POS = 16, 2048, 40960


def cases(tokens: int, device: str) -> dict:
    """op name -> (callable taking no arguments for each implementation)."""
    dtype = torch.bfloat16
    x = torch.randn(tokens, HIDDEN, dtype=dtype, device=device)
    res = torch.randn(tokens, HIDDEN, dtype=dtype, device=device)
    w = 1 + 0.1 * torch.randn(HIDDEN, dtype=dtype, device=device)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype, device=device)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, device=device)
    positions = torch.randint(0, MAX_POS, (tokens,), device=device)
    cos = torch.randn(MAX_POS, HEAD_DIM // 2, dtype=dtype, device=device)
    sin = torch.randn(MAX_POS, HEAD_DIM // 2, dtype=dtype, device=device)
    slots = torch.randperm(BLOCKS * PAGE, device=device)[:tokens]
    k_cache = torch.zeros(BLOCKS, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    qn = 1 + 0.1 * torch.randn(HEAD_DIM, dtype=dtype, device=device)
    logits = torch.randn(tokens, VOCAB, dtype=dtype, device=device)
    rope_args = (qkv, positions, cos, sin, slots, k_cache, v_cache)
    rope_kwargs = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, q_norm_weight=qn, k_norm_weight=qn, eps=1e-6)
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in [
        ("add_rms_norm", add_rms_norm_reference), ("silu_mul", silu_mul_reference), ("rope_kv_write", rope_kv_write_reference),
        ("row_argmax", row_argmax_reference)]}
    return {
        "add_rms_norm": {
            "eager torch": lambda: add_rms_norm_reference(x, res, w, 1e-6),
            "torch.compile": lambda: compiled["add_rms_norm"](x, res, w, 1e-6),
            "triton (ours)": lambda: add_rms_norm_triton(x, res, w, 1e-6),
        },
        "silu_mul": {
            "eager torch": lambda: silu_mul_reference(gate_up),
            "torch.compile": lambda: compiled["silu_mul"](gate_up),
            "triton (ours)": lambda: silu_mul_triton(gate_up),
        },
        "qk_norm+rope+kv_write": {
            "eager torch": lambda: rope_kv_write_reference(*rope_args, **rope_kwargs),
            "torch.compile": lambda: compiled["rope_kv_write"](*rope_args, **rope_kwargs),
            "triton (ours)": lambda: rope_kv_write_triton(*rope_args, **rope_kwargs),
        },
        "argmax over the vocabulary": {
            "eager torch": lambda: row_argmax_reference(logits),
            "torch.compile": lambda: compiled["row_argmax"](logits),
            "triton (ours)": lambda: row_argmax_triton(logits),
        },
    }


def graph_time_us(fn) -> float:
    """Median µs of one call replayed in a CUDA graph of 20 calls (launch gaps as in the engine)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,512,8192")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        torch.manual_seed(tokens)
        for op, impls in cases(tokens, "cuda").items():
            for impl, fn in impls.items():
                rows.append({"op": op, "tokens": tokens, "impl": impl, "us": graph_time_us(fn)})
                print(json.dumps(rows[-1]), flush=True)
    print(f"device {torch.cuda.get_device_name()}; µs per call inside a CUDA graph (median)")
    print("| op | tokens | eager torch | torch.compile | triton (ours) |\n|---|---|---|---|---|")
    for key in dict.fromkeys((r["op"], r["tokens"]) for r in rows):
        us = {r["impl"]: r["us"] for r in rows if (r["op"], r["tokens"]) == key}
        print(f"| {key[0]} | {key[1]} | {us['eager torch']:.1f} | {us['torch.compile']:.1f} | {us['triton (ours)']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
