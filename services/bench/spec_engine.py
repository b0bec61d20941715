"""GPU benchmark of the engine at real scale: AR vs DFlash tokens/s and a per-step breakdown.

Random-weight targets of real shapes (`--shape`: Qwen3-8B, Gemma-4-31B, Gemma-4-26B-A4B,
Qwen3-30B-A3B) and drafters of their z-lab DFlash checkpoints' shapes are built on the GPU (no
weights to download). Random drafts are never accepted, so DFlash rows use the benchmark-only
SYNTHETIC acceptance (`Engine.synthetic`, synthetic_acceptance.py): every round is forced to
accept a fixed number of drafts. Every DFlash row says so; no default ever turns it on.

    python -m dflash_serve.services.bench.spec_engine --shape qwen3-8b --out BENCH.json

Reported per (target impl, mode, batch):
- tok/s: output tokens per second of the decode phase (prefill excluded), no syncs inside steps;
- step ms: wall time per engine step (one round for every sequence);
- draft / verify / accept / host ms per round: device times of the phases (CUDA events, no syncs)
  and the host's Python time launching and finishing the round (hidden behind the device's work
  when rounds are chained: `EngineConfig.async_scheduling`);
- forward ms: one graph replay of the verify (B tokens per sequence) and of the draft forward on
  the run's own batch (real contexts), after prefill, and a kernel census of each at those contexts.
The memory floor is the time to read the weights one batch-1 decode step touches: every weight but
the input embedding's unread rows (when it is not the LM head too) and, in mixture-of-experts
layers, the experts not routed to (top-k of them are read).
Goals (issues 3 and 61): AR batch-1 decode ≥ 80% of the memory floor (Qwen3-8B), ≥ 75% (Gemma-4-31B),
within 1.3× of it (Gemma-4-26B-A4B); DFlash step ≤ 1.25 × (one 16-token verify + one draft forward).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import (Gemma4ForCausalLM, Gemma4TextConfig, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from dflash_serve.services.bench.timing import cuda_ms_per_call
from dflash_serve.services.config import SPECULATION_MODES, EngineConfig
from dflash_serve.services.engine.draft_runner import DraftRunner
from dflash_serve.services.engine.kv_cache import KVPool, window_slots_for
from dflash_serve.services.engine.loader import assemble_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.synthetic_acceptance import SyntheticAcceptance
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.models import DFlashDraftConfig, DFlashDraftModel, TargetModel

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
QWEN3_8B_DFLASH_B16 = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960, "vocab_size": 151936,
    "block_size": 16, "num_target_layers": 36, "layer_types": ["full_attention"] * 5,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}

# google/gemma-4-31B-it and gemma-4-26B-A4B-it's text configs (five sliding layers of 16 (8) KV heads
# of 256, then a global one of 4 (2) KV heads of 512 whose values are its keys), and the z-lab
# drafters' (dflash-spec §1.8, §2.2): four sliding-window layers (W 2048) and a full one.
_GEMMA4_ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
_GEMMA4_COMMON = dict(vocab_size=262144, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
                      sliding_window=1024, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                      max_position_embeddings=131072, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                      tie_word_embeddings=True, rope_parameters=_GEMMA4_ROPE)
GEMMA4_31B = dict(_GEMMA4_COMMON, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                  num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10)
GEMMA4_26B_A4B = dict(_GEMMA4_COMMON, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                      num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                      enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704)
# Qwen3-30B-A3B: every layer sparse, 128 experts of 768 routed top-8.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1e6,
                     max_position_embeddings=40960, tie_word_embeddings=False, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)


def _zlab_drafter(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, target_layers: int,
                  layer_ids: list[int], mask: int, vocab: int, sliding: bool) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": mlp,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 131072, "vocab_size": vocab,
        "block_size": 16, "num_target_layers": target_layers,
        "layer_types": (["sliding_attention"] * (layers - 1) + ["full_attention"] if sliding
                        else ["full_attention"] * layers),
        "sliding_window": 2048 if sliding else None,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layer_ids},
    }


# name -> (model class, config class, target config, drafter config.json)
SHAPES = {
    "qwen3-8b": (Qwen3ForCausalLM, Qwen3Config, QWEN3_8B, QWEN3_8B_DFLASH_B16),
    "gemma4-31b": (Gemma4ForCausalLM, Gemma4TextConfig, GEMMA4_31B,
                   _zlab_drafter(5376, 10752, 5, 64, 8, 60, [1, 12, 23, 35, 46, 57], 4, 262144, True)),
    "gemma4-26b-a4b": (Gemma4ForCausalLM, Gemma4TextConfig, GEMMA4_26B_A4B,
                       _zlab_drafter(2816, 5632, 5, 32, 8, 30, [1, 6, 11, 17, 22, 27], 4, 262144, True)),
    # z-lab's Qwen3-Coder-30B-A3B-DFlash layout: 8 full layers of 2048.
    "qwen3-30b-a3b": (Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN3_30B_A3B,
                      _zlab_drafter(2048, 6144, 8, 32, 4, 48, [1, 7, 14, 20, 26, 32, 39, 45], 151669, 151936, False)),
}


def build_models(shape: str, device: str) -> tuple[PreTrainedModel, DFlashDraftModel]:
    model_cls, config_cls, target_cfg, drafter_cfg = SHAPES[shape]
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = model_cls(config_cls(**target_cfg)).eval()
            drafter = DFlashDraftModel(DFlashDraftConfig.from_dict(drafter_cfg)).eval()
            for p in drafter.parameters():
                torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    finally:
        torch.set_default_dtype(prev)
    return hf, drafter


def decode_step_bytes(hf: PreTrainedModel) -> int:
    """Bytes of the weights one batch-1 decode step reads (the module docstring's memory floor)."""
    cfg = hf.config
    total = 0
    for name, p in hf.named_parameters():
        size = p.numel() * p.element_size()
        if "experts." in name:  # stacked [experts, ...]: top-k of them are read
            size = size * (getattr(cfg, "top_k_experts", None) or cfg.num_experts_per_tok) // p.shape[0]
        elif p is hf.get_input_embeddings().weight and not cfg.tie_word_embeddings:
            size = p.shape[-1] * p.element_size()  # one row
        total += size
    return total


def sequences_that_fit(layout: list, draft_cfg: DFlashDraftConfig, seq_len: int, budget: int, *, windowed: bool,
                       block_size: int = 16, max_prefill_tokens: int = 2048,
                       dtype: torch.dtype = torch.bfloat16) -> int:
    """How many sequences of `seq_len` tokens the KV pools hold in `budget` bytes, sized as
    `assemble_engine` sizes them: each sequence's blocks (its tokens and two rounds' lookahead) in
    the target's and the drafter's pools, and `windowed`: the sliding-window layers' K/V in window
    slots (`window_slots_for` of that many sequences) instead of in every block."""
    lookahead = draft_cfg.block_size
    d_layers, d_heads, d_dim = DraftRunner.kv_shape(draft_cfg)
    draft_bytes = KVPool.bytes_per_block(d_layers, block_size, d_heads, d_dim, dtype)
    per_sequence = -(-(seq_len + 2 * lookahead) // block_size)
    window = KVPool.window_of(layout)
    if not windowed or window is None:
        return budget // ((KVPool.layout_bytes_per_block(layout, block_size, dtype) + draft_bytes) * per_sequence)
    slot_bytes = KVPool.layout_bytes_per_block(layout, block_size, dtype, windowed=True)
    block_bytes = KVPool.layout_bytes_per_block(layout, block_size, dtype, windowed=False) + draft_bytes

    def needed(n: int) -> int:
        return n * per_sequence * block_bytes + window_slots_for(window, block_size, n, lookahead,
                                                                 max_prefill_tokens) * slot_bytes

    n = 0
    while needed(n + 1) <= budget:
        n += 1
    return n


def kv_capacity(hf: PreTrainedModel, drafter: DFlashDraftModel, seq_len: int) -> dict:
    """Sequences of `seq_len` tokens that fit on this GPU beside the models, with and without window
    slots, in the share of free memory a server's KV pools take (`EngineConfig.kv_memory_fraction`)."""
    free, _ = torch.cuda.mem_get_info()
    budget = int(free * EngineConfig.model_fields["kv_memory_fraction"].default)
    layout = TargetRunner.kv_layout(TargetModel(hf))
    return {"seq_len": seq_len, "free_bytes": free, "kv_budget_bytes": budget,
            "sequences_window_slots": sequences_that_fit(layout, drafter.config, seq_len, budget, windowed=True),
            "sequences_every_block": sequences_that_fit(layout, drafter.config, seq_len, budget, windowed=False)}


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read and written."""
    src = torch.randn(2**30 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 20 * 2 * src.numel() * src.element_size() / (start.elapsed_time(end) / 1e3)


def kernel_census(fn, top: int = 8) -> dict:
    """Kernels launched by one call of `fn` (a graph replay), their summed GPU time, and the `top`
    kernel names by time: when the sum is well under the wall time, launch gaps between many tiny
    kernels are what is left."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:60], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time / 1e3
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"kernels": len(kernels), "kernel_ms": sum(e.device_time for e in kernels) / 1e3,
            "top": [{"name": name, "count": count, "ms": round(ms, 4)} for name, (count, ms) in ranked]}


def run_case(engine, batch: int, prompt_len: int, max_tokens: int, census: bool = False) -> dict:
    g = torch.Generator().manual_seed(batch)
    vocab = engine.vocab_size - 1000
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(s.is_prefilling or not s.output_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and nothing else) until every sequence decodes
    engine.drain()
    torch.cuda.synchronize()
    forwards = {}
    if engine.graphs is not None:
        # One replay of each forward on this batch's real contexts; they write only at the round's
        # lookahead positions (or scratch blocks), which every round rewrites before reading.
        running = engine.scheduler.running
        bucket = engine.graphs.load([s.bonus for s in running], [s.num_cached for s in running],
                                    [s.block_table for s in running])
        k = max(engine.graphs.k_buckets)  # the full block's verify (0 for AR)
        forwards["verify_fwd_ms"] = cuda_ms_per_call(lambda: engine.graphs.verify(bucket, k))
        if census:  # at the run's real contexts: attention's share grows with them
            forwards["verify_census"] = kernel_census(lambda: engine.graphs.verify(bucket, k), top=12)
        if engine.graphs.proposer is not None:  # captured here (not a drafter in another process)
            forwards["draft_fwd_ms"] = cuda_ms_per_call(lambda: engine.graphs.draft(bucket))
            if census:
                forwards["draft_census"] = kernel_census(lambda: engine.graphs.draft(bucket), top=12)
    out0 = sum(len(s.output_ids) for s in engine.scheduler.running)
    engine.timings = type(engine.timings)()
    engine.round_log.clear()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    seqs = list(engine.sequences.values())
    produced = sum(len(s.output_ids) for s in seqs) - out0
    rounds = sum(s.stats.rounds for s in seqs)
    tau = (sum(s.stats.accepted_tokens for s in seqs) + rounds) / rounds if rounds else 1.0
    engine.sequences.clear()
    # Per round: device times of the phases (CUDA events) and the host's time on the round.
    tm = engine.timings
    phases = {k: round(1e3 * getattr(tm, k) / max(tm.rounds, 1), 4) for k in ("draft", "verify", "accept", "host")}
    ks = [r.k for r in engine.round_log]  # drafts verified per round (the adaptive policy's choices)
    return {"tok_s": produced / elapsed, "step_ms": 1e3 * elapsed / max(steps, 1), "steps": steps, "tau": tau,
            "mean_k": sum(ks) / len(ks) if ks else 0.0, "phases_ms": phases, **forwards}


def profile_steps(engine, batch: int, prompt_len: int) -> None:
    """Where the host time of a step goes (cProfile over a short run), printed."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_case(engine, batch, prompt_len, 48)
    profiler.disable()
    print(f"-- host profile, {'DFlash' if engine.proposer else 'AR'} batch {batch}")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def run_batch(results: dict, args: argparse.Namespace, hf: PreTrainedModel, drafter: DFlashDraftModel,
              impl: str, batch: int, taus: list[float], modes: list[str], profile: bool) -> None:
    """The AR row and the DFlash rows (each mode, each SYNTHETIC τ) of one target impl and batch;
    `profile`: a host profile of each engine's steps too."""
    blocks = batch * (-(-(args.prompt_len + args.max_tokens + 32) // 16)) + 64
    base = EngineConfig(target=f"random-{args.shape}", device="cuda", num_kv_blocks=blocks, max_num_seqs=batch,
                        max_prefill_tokens=8192, target_impl=impl,
                        async_scheduling=args.async_scheduling == "on", deterministic=args.deterministic)
    ar = assemble_engine(base, TargetModel(hf), None)
    run_case(ar, batch, args.prompt_len, 8)  # warm-up: first-use compilations and allocations
    row = {"target_impl": impl, "mode": "AR", "batch": batch, "tau": 1.0, "synthetic": False,
           **run_case(ar, batch, args.prompt_len, args.max_tokens, census=True)}
    print(f"AR batch {batch} forward census: {json.dumps(row['verify_census'])}", flush=True)
    if profile:
        profile_steps(ar, batch, args.prompt_len)
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
    del ar
    torch.cuda.empty_cache()

    for mode in modes:
        target = TargetModel(hf, drafter.config.target_layer_ids)
        spec = assemble_engine(base.model_copy(update={"speculation": mode}), target, drafter)
        spec.synthetic = SyntheticAcceptance(taus[0])
        run_case(spec, batch, args.prompt_len, 40)  # warm-up
        for tau in taus:
            spec.synthetic.tau = tau
            row = {"target_impl": impl, "mode": f"DFlash {mode}", "batch": batch, "synthetic": True, "target_tau": tau,
                   **run_case(spec, batch, args.prompt_len, args.max_tokens, census=tau == taus[0])}
            if "verify_census" in row:
                print(f"DFlash {mode} batch {batch} verify census: {json.dumps(row['verify_census'])}\n"
                      f"DFlash {mode} batch {batch} draft census: {json.dumps(row['draft_census'])}", flush=True)
            row["step_over_fwd"] = row["step_ms"] / (row["verify_fwd_ms"] + row["draft_fwd_ms"])
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        if profile:
            profile_steps(spec, batch, args.prompt_len)
        target.close()
        del spec
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES),
                        help="the target's and the drafter's shapes (random weights)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--taus", default="1,4,6.5,10", help="SYNTHETIC acceptance lengths for the DFlash rows")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--profile", action="store_true", help="print a host profile of steps at the largest batch")
    parser.add_argument("--target-impl", default="auto",
                        help="the target's forward (EngineConfig.target_impl: auto, fused, transformers); "
                             "comma-separated: each in turn, on the same models")
    parser.add_argument("--async-scheduling", default="on", choices=["on", "off"],
                        help="chain rounds on the device (EngineConfig.async_scheduling)")
    parser.add_argument("--speculation", default="fixed,adaptive",
                        help="comma-separated EngineConfig.speculation modes of the DFlash rows (fixed: all B-1 "
                             "drafts verified every round; adaptive: the load-adaptive policy); AR rows always run")
    parser.add_argument("--capacity-len", type=int, default=0,
                        help="also report how many sequences of this many tokens the KV pools hold beside the models "
                             "(with and without the sliding-window layers' window slots)")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant target forwards in every row (EngineConfig.deterministic)")
    args = parser.parse_args(argv)
    device = "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    taus = [float(t) for t in args.taus.split(",")]
    modes = args.speculation.split(",")
    if not set(modes) <= set(SPECULATION_MODES):
        parser.error(f"--speculation: choose among {', '.join(SPECULATION_MODES)}")

    impls = args.target_impl.split(",")
    if not set(impls) <= {"auto", "fused", "transformers"}:
        parser.error("--target-impl: choose among auto, fused, transformers")

    hf, drafter = build_models(args.shape, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    step_bytes = decode_step_bytes(hf)
    bandwidth = copy_bandwidth(device)
    floor_ms = 1e3 * step_bytes / bandwidth
    print(f"device {torch.cuda.get_device_name()}; {args.shape} target {weight_bytes / 1e9:.2f} GB bf16, "
          f"{step_bytes / 1e9:.2f} GB read per batch-1 decode step; copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"-> memory floor {floor_ms:.2f} ms per target forward", flush=True)

    results = {"device": torch.cuda.get_device_name(), "shape": args.shape, "target_impl": impls,
               "async_scheduling": args.async_scheduling == "on", "deterministic": args.deterministic,
               "weight_bytes": weight_bytes, "decode_step_bytes": step_bytes,
               "bandwidth": bandwidth, "floor_ms": floor_ms, "rows": []}
    if args.capacity_len:
        results["capacity"] = kv_capacity(hf, drafter, args.capacity_len)
        print(f"KV capacity: {json.dumps(results['capacity'])}", flush=True)
    for impl in impls:
        for batch in batches:
            run_batch(results, args, hf, drafter, impl, batch, taus, modes, args.profile and batch == batches[-1])

    print(markdown_table(results))
    for r in results["rows"]:
        if r["mode"] == "AR":
            c = r["verify_census"]
            print(f"AR batch {r['batch']}: one forward launches {c['kernels']} kernels ({c['kernel_ms']:.2f} ms of kernel "
                  f"time at the run's context); it takes {r['verify_fwd_ms']:.2f} ms and a whole "
                  f"step {r['step_ms']:.2f} ms: the {floor_ms:.2f} ms floor is {100 * floor_ms / r['step_ms']:.0f}% of a step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def markdown_table(results: dict) -> str:
    lines = [
        "| target | mode | batch | τ | mean k | tok/s | step ms | verify fwd ms | draft fwd ms | step / (verify+draft) "
        "| per round: draft / verify / accept (device) / host ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        p = r["phases_ms"]
        phases = f"{p['draft']:.2f} / {p['verify']:.2f} / {p['accept']:.2f} / {p['host']:.2f}"
        if r["mode"] == "AR":
            lines.append(f"| {r['target_impl']} | AR | {r['batch']} | 1 | 0 | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {r['verify_fwd_ms']:.2f} | - | "
                         f"{r['step_ms'] / r['verify_fwd_ms']:.2f} | {phases} |")
        else:
            lines.append(
                f"| {r['target_impl']} | {r['mode']} (SYNTHETIC τ={r['target_tau']:g}) | {r['batch']} | {r['tau']:.2f} | {r['mean_k']:.1f} | "
                f"{r['tok_s']:.1f} | "
                f"{r['step_ms']:.2f} | {r['verify_fwd_ms']:.2f} | {r['draft_fwd_ms']:.2f} | {r['step_over_fwd']:.2f} | "
                f"{phases} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
