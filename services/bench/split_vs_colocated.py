"""GPU benchmark: the drafter in its own process (split, as served) vs in the verifier's (colocated).

The same random-weight Qwen3-8B-shaped target and Qwen3-8B-DFlash-b16-shaped drafter as
`spec_engine`, at a SYNTHETIC acceptance length (random drafts are never accepted; see there).
Modes (`--modes`):
- colocated: draft and verify are both graph replays in one process.
- split: the drafter is a Ray actor on the same GPU (drafter_placement shared, as
  `dflash_serve.services.verifier` spawns it), fed through the shared feature ring and the frame
  channel; the verify forward replays a CUDA graph that reads the drafts the drafter wrote into a
  shared buffer.
- own_gpu: the same with the drafter actor on the second GPU (drafter_placement own_gpu), one
  group in flight.
- own_gpu_2g: as the verifier runs own_gpu: two groups in flight where the measured round costs
  say they pay (`Engine._two_groups_pay`); own_gpu_2g_forced: wherever the batch allows them (to
  judge that gate; batches from 2 × MIN_GROUP_SIZE only).

    python -m dflash_serve.services.bench.split_vs_colocated --out split.json

Per (mode, batch): decode tok/s and step ms. The split modes also report, per draft request, the
drafter's step (from the request to its drafts done on the device, less its wait for the
verifier's device) and the transport overhead (the time to the drafter's reply beyond its host
time on the step and its wait: channel round trip, framing, the drafter's queueing), median and
p90, in µs; and the share of draft requests made for the second group.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import tempfile

import torch

from dflash_serve.services.bench.spec_engine import build_models, run_case
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.cuda_mps import cuda_mps
from dflash_serve.services.engine.loader import assemble_engine
from dflash_serve.services.engine.synthetic_acceptance import SyntheticAcceptance
from dflash_serve.services.engine.two_groups import MIN_GROUP_SIZE
from dflash_serve.services.models import TargetModel, save_drafter


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


MODES = ("colocated", "split", "own_gpu", "own_gpu_2g", "own_gpu_2g_forced")


@contextlib.contextmanager
def drafter_actor(drafter_dir: str, own_gpu: bool):
    """The drafter actor as a verifier replica spawns it, in a Ray session of its own; yields its
    channel's address. This process stands for the verifier, on the first visible GPU. Shared:
    the actor has no GPU and sees the verifier's. Own GPU: Ray's node is given only the second
    visible GPU (CUDA_VISIBLE_DEVICES when it starts; this process's CUDA started long before),
    which the actor gets and computes on (`cuda_visibility`)."""
    import ray

    from dflash_serve.services.drafter.actor import RAY_NOSET_CUDA_VISIBLE_DEVICES, DrafterActor

    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    if own_gpu and len(visible) < 2:
        raise SystemExit("the own_gpu modes need two visible GPUs; run the others with --modes colocated,split")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[1] if own_gpu else visible[0]
    try:
        ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    try:
        actor = ray.remote(DrafterActor).options(
            num_cpus=0.5, num_gpus=1 if own_gpu else 0,
            runtime_env={"env_vars": {RAY_NOSET_CUDA_VISIBLE_DEVICES: "1"}}).remote(
            drafter_dir, "cuda", "bfloat16", verifier_gpu_ids=visible[:1])
        yield ray.get(actor.address.remote(), timeout=600)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--modes", default="colocated,split",
                        help=f"comma-separated, of {', '.join(MODES)} (the own_gpu ones need two GPUs)")
    parser.add_argument("--tau", type=float, default=6.5, help="SYNTHETIC acceptance length")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--cuda-mps", action="store_true",
                        help="every process as a client of an MPS daemon of its own (`dflash serve --cuda-mps`)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    # Before this process makes its CUDA context: a process joins MPS then or never.
    with cuda_mps() if args.cuda_mps else contextlib.nullcontext():
        return _run(args, modes)


def _run(args: argparse.Namespace, modes: list[str]) -> int:
    from dflash_serve.services.verifier.remote_drafter import RemoteProposer

    batches = [int(b) for b in args.batches.split(",")]
    hf, drafter = build_models("qwen3-8b", "cuda")
    layer_ids = drafter.config.target_layer_ids
    drafter_dir = tempfile.mkdtemp(prefix="dflash-bench-drafter-")
    save_drafter(drafter, drafter_dir)
    results = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
               "synthetic_tau": args.tau, "cuda_mps": args.cuda_mps, "rows": []}

    def config(batch: int) -> EngineConfig:
        blocks = batch * (-(-(args.prompt_len + args.max_tokens + 32) // 16)) + 64
        # fixed: every topology verifies every draft, so they differ by the transport alone
        return EngineConfig(target="random-qwen3-8b", device="cuda", num_kv_blocks=blocks, max_num_seqs=batch,
                            max_prefill_tokens=8192, speculation="fixed")

    def measure(engine, mode: str, batch: int) -> dict:
        engine.synthetic = SyntheticAcceptance(args.tau)
        run_case(engine, batch, args.prompt_len, 40)  # warm-up
        row = {"mode": mode, "batch": batch, "synthetic": True,
               **run_case(engine, batch, args.prompt_len, args.max_tokens)}
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
        return row

    if "colocated" in modes:
        for batch in batches:
            target = TargetModel(hf, layer_ids)
            measure(assemble_engine(config(batch), target, drafter), "colocated", batch)
            target.close()
            torch.cuda.empty_cache()

    def measure_split(address, mode: str) -> None:
        for batch in batches:
            if mode == "own_gpu_2g_forced" and batch < 2 * MIN_GROUP_SIZE:
                continue  # no two groups below this: own_gpu_2g's row says it all
            target = TargetModel(hf, layer_ids)
            engine = assemble_engine(config(batch), target, None, remote_drafter=drafter.config)
            shared = []
            proposer = RemoteProposer.connect(address, target=target, block_size=drafter.config.block_size,
                                              kv_block_size=16, num_kv_blocks=engine.runner.pool.num_blocks,
                                              capacity_rows=8192 + batch * 32, max_num_seqs=batch, shared=shared,
                                              graphs=engine.graphs, draft_groups=2 if "_2g" in mode else 1)
            if mode == "own_gpu_2g_forced":
                engine._two_groups_pay = lambda n: True  # what the gate would decline, measured
            engine.attach_proposer(proposer)  # measures the round costs the two-group gate weighs
            groups = collections.Counter()
            request_drafts = proposer.request_drafts

            def counted(*args, group: int = 0):
                groups[group] += 1
                request_drafts(*args, group=group)

            proposer.request_drafts = counted
            run_case(engine, batch, args.prompt_len, 40)  # warm-up (the drafter's first kernels, its KV pool)
            proposer.drain_transport_seconds()
            proposer.draft_seconds.clear()
            groups.clear()
            row = measure(engine, mode, batch)
            transport = proposer.drain_transport_seconds()
            row["transport_us_p50"] = 1e6 * statistics.median(transport)
            row["transport_us_p90"] = 1e6 * _percentile(transport, 0.9)
            row["drafter_step_ms_p50"] = 1e3 * statistics.median(proposer.draft_seconds)
            row["draft_requests"] = len(transport)
            row["second_group_share"] = groups[1] / max(1, sum(groups.values()))
            print(json.dumps(row), flush=True)
            proposer.release()
            for buffer in shared:
                buffer.close()
            target.close()
            del engine
            torch.cuda.empty_cache()

    drafter.to("meta")  # the split runs use the actor's copy
    torch.cuda.empty_cache()
    if "split" in modes:
        with drafter_actor(drafter_dir, own_gpu=False) as address:
            measure_split(address, "split")
    own = [m for m in MODES if m.startswith("own_gpu") and m in modes]
    if own:
        with drafter_actor(drafter_dir, own_gpu=True) as address:
            for mode in own:
                measure_split(address, mode)

    print(markdown_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def markdown_table(results: dict) -> str:
    colocated = {r["batch"]: r for r in results["rows"] if r["mode"] == "colocated"}
    lines = [f"| mode (SYNTHETIC τ={results['synthetic_tau']:g}) | batch | tok/s | vs colocated | step ms | "
             "drafter step ms p50 | transport µs p50 / p90 | 2nd group |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results["rows"], key=lambda r: (r["batch"], MODES.index(r["mode"]))):
        base = colocated.get(r["batch"])
        ratio = f"{r['tok_s'] / base['tok_s']:.3f}" if base else "-"
        drafter = f"{r['drafter_step_ms_p50']:.2f}" if "drafter_step_ms_p50" in r else "-"
        transport = f"{r['transport_us_p50']:.0f} / {r['transport_us_p90']:.0f}" if "transport_us_p50" in r else "-"
        second = f"{r['second_group_share']:.2f}" if "second_group_share" in r else "-"
        lines.append(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.1f} | {ratio} | {r['step_ms']:.2f} | {drafter} "
                     f"| {transport} | {second} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
