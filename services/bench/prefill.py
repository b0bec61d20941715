"""GPU benchmark of prefill, eager against CUDA graphs, on a SmolLM2-135M-shaped target (random bf16 weights)
with the default drafter (its committed weights), AR and DFlash.

    python -m dflash_serve.services.bench.prefill --out prefill.json

For each pairing and `engine.prefill_graph_tokens` 0 (eager) and 2048 (graphs): the median wall
time of an engine step that prefills one prompt of 20, 150, 600 and 1,500 tokens and samples its
first token (15 prompts each, the first 3 dropped), the build time of the engine (model load, KV
pools, graph capture; Triton's compile cache is cold on the first build), the decode step of one
request (200 steps; a random target accepts no drafts, so the DFlash row's step is not a
DFlash speed), and, for AR with graphs, the kernel census of one decode forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_serve.services.bench.spec_engine import kernel_census
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import assemble_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models import TargetModel, load_drafter
from dflash_serve.services.models.default_pair import default_drafter

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
            rope_theta=100000.0)


def build(prefill_tokens: int, drafter: bool, max_num_seqs: int = 32):
    """(engine, seconds to assemble it) over a fresh random target."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**SMOL)).to(torch.bfloat16).eval()
    d = load_drafter(default_drafter(), dtype=torch.bfloat16, device=torch.device("cuda")) if drafter else None
    target = TargetModel(hf, d.config.target_layer_ids if d else ())
    cfg = EngineConfig(target="x", device="cuda", max_num_seqs=max_num_seqs, prefill_graph_tokens=prefill_tokens,
                       max_model_len=4096)
    t = time.perf_counter()
    e = assemble_engine(cfg, target, d)
    return e, time.perf_counter() - t


def prefill_ms(engine, n: int, reps: int = 15) -> float:
    """Median ms of a step that prefills one n-token prompt and samples its only token."""
    g = torch.Generator().manual_seed(n)
    times = []
    for _ in range(reps):
        p = torch.randint(0, 40000, (n,), generator=g).tolist()
        rid = engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()  # prefill + first token (finishes the request)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        engine.drain()
        engine.release(rid)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairings", default="ar,dflash", help="ar (target-only), dflash (the default drafter)")
    parser.add_argument("--prefill-graph-tokens", default="0,2048", help="engine.prefill_graph_tokens values")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    out = {}
    for drafter in [p == "dflash" for p in args.pairings.split(",")]:
        for pt in [int(t) for t in args.prefill_graph_tokens.split(",")]:
            eng, build_s = build(pt, drafter)
            key = f"{'dflash' if drafter else 'ar'}_prefill_graph_tokens={pt}"
            res = {"build_s": round(build_s, 2)}
            for n in (20, 150, 600, 1500):
                res[f"prefill_step_ms_{n}"] = round(prefill_ms(eng, n), 3)
            # AR/DFlash decode of one request: ms per step and the step's census
            p = list(range(100, 250))
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
            for _ in range(20):
                eng.step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                eng.step()
            torch.cuda.synchronize()
            res["decode_step_ms"] = round((time.perf_counter() - t) / 200 * 1e3, 4)
            if not drafter and pt:
                running = eng.scheduler.running
                b = eng.graphs.load([s.bonus for s in running], [s.num_cached for s in running],
                                    [s.block_table for s in running])
                res["ar_census"] = kernel_census(lambda: eng.graphs.verify(b, 0), top=14)
            while eng.has_unfinished():
                eng.step()
            out[key] = res
            print(key, json.dumps(res), flush=True)
            eng = None  # its GPU memory goes back before the next build
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
