"""The serving path against the engine: the same prompts through `dflash bench --embedded` and
through a running `dflash serve` (gRPC, and OpenAI streaming), colocated and split, on one
machine in one call; a table of served tokens/s over embedded and of the TTFT serving adds.

    python -m dflash_serve.services.bench.serving_path --case default --data-dir bench-data --out DIR

Cases (each its own models, prompts and loads; `--size tiny` builds every model at a tiny shape,
for a CPU):
- default: the default pair (SmolLM2-135M-Instruct and its drafter), HumanEval and alpaca through
  the chat template (OpenAI: chat completions), T 0 and 1, c 1, 8, 32.
- qwen3-8b-target: a random-weight Qwen3-8B-shaped target alone (written under DIR/models, with a
  word-level tokenizer over its vocabulary), random 256-token prompts, 256 tokens each
  (ignore_eos), c 1, 8, 32, 64. No drafter: it isolates the serving path from the split.
- qwen3-8b-pair: that target and a random Qwen3-8B-DFlash-b16-shaped drafter at SYNTHETIC
  acceptance (tau 6.5, `engine.synthetic_acceptance_length`; its outputs are not the target's),
  c 1 and 32.

Goals (issue 67): served colocated >= 0.9 x embedded in every cell, served split >= 0.85 x
embedded (colocated), TTFT added by serving <= 2 ms at c 1.

Each case also times one-token requests at c 1 (`bench.first_token`) in the engine and through each
server by a bare socket, aiohttp and grpc.aio: the server's share of the TTFT added, and the clients'.

Both sides do the same work: no prefix cache on either (`SAME_WORK`), and at real size a run shorter
than `MIN_RUN_SECONDS` sends its set again and reports the runs pooled (`dflash bench --min-seconds`).

`--profile-concurrency C` also samples the server's processes and the bench's own with py-spy
(`services/bench/py_spy.py`) under a load at c = C of its own (over `--profile-protocol`) after each
topology's measured runs, long enough for the samples (the measured runs at c 32 last under a second on a
GPU): where the served path's time goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GOALS = {"colocated": 0.9, "split": 0.85}
TTFT_ADDED_GOAL_MS = 2.0
SERVE_START_TIMEOUT_S = 900.0
# Seconds the profile's load runs beyond its samples: the first requests' admission, and the last ones' tail.
PROFILE_MARGIN_S = 4.0
# The same prompts run at every load, over both protocols and at each T, against one server: with its prefix
# cache on, a server finds the later runs' prompts cached, where the embedded bench empties its cache before
# each run (served 1.1-1.26x embedded at Qwen3-8B shapes, c 32-64, came from that). Off on both sides, every
# run computes all its prompts and the ratio is the serving path's alone.
SAME_WORK = ["--no-enable-prefix-caching"]
MIN_RUN_SECONDS = 4.0  # `dflash bench --min-seconds`: a shorter run sends its set again, pooled


@dataclass
class Case:
    name: str
    datasets: str
    concurrency: str
    temperatures: tuple[float, ...]
    num_prompts: int
    max_tokens: int
    topologies: tuple[str, ...]
    chat: bool  # OpenAI: chat completions (prompt sets with a chat template) or completions (token ids)
    bench_flags: list[str] = field(default_factory=list)  # for every `dflash bench`
    engine_flags: list[str] = field(default_factory=list)  # for the embedded engine and the server alike


def cases(size: str, models: Path, data_dir: str | None) -> dict[str, Case]:
    tiny = size == "tiny"
    # 48 prompts at c 32 last under a second on a GPU: alone, such a run moved ±20 % from one call to the next.
    pooled = ["--min-seconds", "0" if tiny else str(MIN_RUN_SECONDS)]
    random_set = ["--input-len", "16" if tiny else "256", "--output-len", "8" if tiny else "256", "--ignore-eos",
                  "--seed", "0", *pooled]
    return {
        "default": Case("default", "humaneval,alpaca", "1,2" if tiny else "1,8,32", (0.0, 1.0), 4 if tiny else 48,
                        8 if tiny else 256, ("colocated", "split"), chat=True,
                        bench_flags=["--data-dir", str(data_dir), "--seed", "0", *pooled] if data_dir else pooled,
                        engine_flags=_default_pair_flags(models) if tiny else []),
        "qwen3-8b-target": Case("qwen3-8b-target", "random", "1,2" if tiny else "1,8,32,64", (0.0,),
                                4 if tiny else 64, 8 if tiny else 256, ("colocated",), chat=False, bench_flags=random_set,
                                engine_flags=["--target", str(models / "qwen3-8b"), "--drafter", "none",
                                              "--max-num-seqs", "2" if tiny else "64"]),
        "qwen3-8b-pair": Case("qwen3-8b-pair", "random", "1,2" if tiny else "1,32", (0.0,), 4 if tiny else 64,
                              8 if tiny else 256, ("colocated", "split"), chat=False, bench_flags=random_set,
                              engine_flags=["--target", str(models / "qwen3-8b"), "--drafter",
                                            str(models / "qwen3-8b-dflash"), "--synthetic-acceptance-length", "6.5"]),
    }


def _default_pair_flags(models: Path) -> list[str]:
    """--size tiny: the default case on the tiny pair, which has a chat template of its own."""
    return ["--target", str(models / "qwen3-8b"), "--drafter", str(models / "qwen3-8b-dflash")]


# -- models ----------------------------------------------------------------------------------------


def write_models(models: Path, size: str, device: str) -> None:
    """The random Qwen3-8B-shaped target (with a tokenizer) and DFlash drafter, once."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_serve.services.bench.spec_engine import QWEN3_8B, QWEN3_8B_DFLASH_B16
    from dflash_serve.services.models import DFlashDraftConfig, DFlashDraftModel, save_drafter

    target_dir, drafter_dir = models / "qwen3-8b", models / "qwen3-8b-dflash"
    if (target_dir / "tokenizer.json").exists() and (drafter_dir / "config.json").exists():
        return  # written whole before (the tokenizer is written last)
    shape, drafter_cfg = dict(QWEN3_8B), json.loads(json.dumps(QWEN3_8B_DFLASH_B16))
    if size == "tiny":
        small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
        shape.update(small, num_hidden_layers=4, max_position_embeddings=2048)
        drafter_cfg.update(small, num_hidden_layers=2, num_target_layers=4, layer_types=["full_attention"] * 2,
                           max_position_embeddings=2048, block_size=8,
                           dflash_config={"mask_token_id": 511, "target_layer_ids": [0, 2]})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    print(f"writing a random Qwen3-8B-shaped target and drafter ({size}) to {models}", flush=True)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config(**shape, eos_token_id=0, bos_token_id=0)).to(dtype).eval()
        drafter = DFlashDraftModel(DFlashDraftConfig.from_dict(drafter_cfg)).to(dtype).eval()
        for p in drafter.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    save_drafter(drafter, drafter_dir)
    target.save_pretrained(target_dir)
    word_level_tokenizer(shape["vocab_size"]).save_pretrained(target_dir)
    del target, drafter
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print("models written", flush=True)


def word_level_tokenizer(vocab_size: int):
    """A tokenizer with one word per id (`t0` ... ), with a chat template: random weights have no
    tokenizer of their own, and the router and the engine's detokenizer need one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t0", unk_token="t1")
    fast.chat_template = "{% for m in messages %}t2 {{ m['content'] }} {% endfor %}t3"
    return fast


# -- runs ------------------------------------------------------------------------------------------


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_serve.services.cli", *args]


def bench(case: Case, out: Path, temperature: float, backend: list[str], log, profile=None, *,
          concurrency: str | None = None, num_prompts: int | None = None) -> dict:
    """One `dflash bench` over the case's sets and loads (or `concurrency` and `num_prompts`); its
    results.json. `profile(log_offset, bench_pid)`, if given, starts a `LoadProfiler` over the
    bench's log from that offset."""
    command = cli("bench", *backend, *case.bench_flags, "--dataset", case.datasets,
                  "--concurrency", concurrency or case.concurrency, "--num-prompts", str(num_prompts or case.num_prompts),
                  "--max-tokens", str(case.max_tokens), "--temperature", str(temperature), "--out", str(out))
    print("$ " + " ".join(command[2:]), file=log, flush=True)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    profiler = None if profile is None else profile(log.tell(), process.pid)
    try:
        if process.wait() != 0:
            raise RuntimeError(f"dflash bench failed ({' '.join(command[2:])}); its output is in {log.name}")
    finally:
        if profiler is not None:
            profiler.finish()
            if profiler.summary:
                print(profiler.summary, flush=True)
    return json.loads((out / "results.json").read_text())


def first_token(case: Case, path: str, probe: list[str], out: Path, requests: int, log) -> list[dict]:
    """`bench.first_token` (one-token requests at c 1) in the engine or against the running server;
    a row per client (`in-process` for the engine)."""
    command = [sys.executable, "-m", "dflash_serve.services.bench.first_token", *probe, "--requests", str(requests),
               "--out", str(out)]
    print("$ " + " ".join(command[2:]), file=log, flush=True)
    if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
        raise RuntimeError(f"bench.first_token failed ({' '.join(command[2:])}); its output is in {log.name}")
    return [{"case": case.name, "path": path, "protocol": "in-process" if client == "embedded" else client,
             "first_token": summary} for client, summary in json.loads(out.read_text()).items()]


def profile_prompts(report: dict, concurrency: int, seconds: float) -> int:
    """Prompts per set for a run at `concurrency` that lasts the profile's seconds and a margin, at
    the pace the measured run kept there (its sets' runs last well under a second at c 32 on a GPU)."""
    runs = [r for r in report["runs"] if r["concurrency"] == concurrency and r["completed"]]
    if not runs:
        raise RuntimeError(f"no request completed at c={concurrency} in the measured run: nothing to pace the "
                           "profile's load by (its bench report says why)")
    seconds_per_prompt = min(r["duration"] / r["completed"] for r in runs)
    return max(concurrency, math.ceil((seconds + PROFILE_MARGIN_S) / len(runs) / seconds_per_prompt))


class Server:
    """`dflash serve` in a process of its own, up once it says so (`wait_until_up`); stopped with SIGINT."""

    def __init__(self, flags: list[str], log_path: Path, *, wait_until_up: bool = True):
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - open as long as the server
        # RAY_ADDRESS=local: a Ray of its own, never one this machine already runs (a test session's).
        self.process = subprocess.Popen(cli("serve", *flags), stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, "RAY_ADDRESS": "local"})
        deadline = time.monotonic() + SERVE_START_TIMEOUT_S
        while wait_until_up and "dflash-serve is up" not in log_path.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dflash serve did not come up; the end of its log ({log_path}):\n"
                                   + log_path.read_text()[-4000:])
            time.sleep(1.0)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def run_case(case: Case, out: Path, args: argparse.Namespace, log, results: list[dict], save) -> None:
    """Every path of the case: embedded, then each topology's server over each protocol; each
    run's rows go into `results`, saved as they come."""

    def record(path: str, protocol: str, temperature: float, report: dict) -> None:
        for run in report["runs"]:
            results.append({"case": case.name, "path": path, "protocol": protocol, "temperature": temperature,
                             "dataset": run["dataset"], "concurrency": run["concurrency"],
                             "output_tok_s": run["output_tok_s"], "ttft_mean_ms": run["ttft_ms"]["mean"],
                             "tpot_mean_ms": run["tpot_ms"]["mean"], "tau": run["tau"], "failed": run["failed"]})
        save()

    out.mkdir(parents=True, exist_ok=True)  # the server's log lands here before any bench has written
    if args.embedded:
        embedded = ["--embedded", *case.engine_flags, *SAME_WORK, *args.device_flags]
        for t in case.temperatures:
            record("embedded", "in-process", t, bench(case, out / f"embedded-t{t:g}", t, embedded, log))
        if args.first_token_requests:
            results += first_token(case, "embedded", embedded, out / "first-token-embedded.json",
                                   args.first_token_requests, log)
            save()
    for topology in [t for t in case.topologies if t in args.topologies]:
        flags = [*case.engine_flags, *SAME_WORK, *args.device_flags, *args.serve_flags, "--topology", topology,
                 "--grpc-port", str(args.grpc_port),
                 "--http-port", str(args.http_port), "--metrics-port", str(args.metrics_port)]
        print(f"starting dflash serve ({case.name}, {topology})", flush=True)
        server = Server(flags, out / f"serve-{topology}.log")
        try:
            for t in case.temperatures:
                grpc = ["--backend", "grpc", "--address", f"127.0.0.1:{args.grpc_port}"]
                openai = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{args.http_port}",
                          "--endpoint", "/v1/chat/completions" if case.chat else "/v1/completions"]
                if not case.chat:  # random token prompts: the tokenizer tells the bench the vocabulary
                    openai += ["--tokenizer", case.engine_flags[case.engine_flags.index("--target") + 1]]
                for protocol, backend in (("grpc", grpc), ("openai", openai)):
                    report = bench(case, out / f"{topology}-{protocol}-t{t:g}", t, backend, log)
                    record(topology, protocol, t, report)
                    if args.profile_concurrency and t == case.temperatures[0] and protocol == args.profile_protocol:
                        profile_load(case, out / f"profile-{topology}", t, backend, log, server, report, args)
            if args.first_token_requests:
                probe = ["--grpc", f"127.0.0.1:{args.grpc_port}", "--http", f"http://127.0.0.1:{args.http_port}"]
                results += first_token(case, topology, probe, out / f"first-token-{topology}.json",
                                       args.first_token_requests, log)
                save()
        finally:
            server.stop()


def profile_load(case: Case, folder: Path, temperature: float, backend: list[str], log, server: Server,
                 report: dict, args: argparse.Namespace) -> None:
    """py-spy of the server's processes and of the bench's own under a load of its own at
    --profile-concurrency, paced by the measured `report` to outlast the samples."""
    from dflash_serve.services.bench.py_spy import LoadProfiler

    c = args.profile_concurrency

    def profile(offset: int, bench_pid: int) -> LoadProfiler:
        return LoadProfiler(server.process.pid, Path(log.name), offset, c, args.profile_seconds, folder,
                            client_pid=bench_pid)

    bench(case, folder / "load", temperature, backend, log, profile, concurrency=str(c),
          num_prompts=profile_prompts(report, c, args.profile_seconds))


# -- the table -------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    """One row per (case, set, T, c): embedded tok/s and TTFT, then each served path's tok/s (x
    embedded) and TTFT added, marked where a goal is missed."""
    served = sorted({(r["path"], r["protocol"]) for r in results if r["path"] != "embedded"},
                    key=lambda p: (p[0] != "colocated", p[1]))
    head = ["case", "set", "T", "c", "embedded tok/s", "TTFT ms", *[f"{p} {q}" for p, q in served]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {(r["case"], r["dataset"], r["temperature"], r["concurrency"], r["path"], r["protocol"]): r
             for r in results}
    rows = sorted({k[:4] for k in keyed}, key=lambda k: (k[0], k[1], k[2], k[3]))
    for case, dataset, t, c in rows:
        base = keyed.get((case, dataset, t, c, "embedded", "in-process"))
        cells = [case, dataset, f"{t:g}", str(c)]
        cells += [f"{base['output_tok_s']:,.0f}", f"{base['ttft_mean_ms']:.1f}"] if base else ["", ""]
        for path, protocol in served:
            r = keyed.get((case, dataset, t, c, path, protocol))
            if r is None:
                cells.append("")
                continue
            if base is None:  # --no-embedded: nothing to compare with
                cells.append(f"{r['output_tok_s']:,.0f} (TTFT {r['ttft_mean_ms']:.1f} ms)")
                continue
            ratio = r["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else 0.0
            added = r["ttft_mean_ms"] - base["ttft_mean_ms"]
            missed = ratio < GOALS[path] or (c == 1 and added > TTFT_ADDED_GOAL_MS) or r["failed"]
            cells.append(f"{r['output_tok_s']:,.0f} ({ratio:.2f}×; TTFT {added:+.1f} ms)" + (" ✗" if missed else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def first_token_table(rows: list[dict]) -> str:
    """Per case and path, each client's median first token of a one-token request at c 1, and what it
    adds to the engine's."""
    lines = ["| case | path | client | first token ms (median) | p10 / p90 | added to the engine's |",
             "|---|---|---|---|---|---|"]
    engine = {r["case"]: r["first_token"]["median_ms"] for r in rows if r["path"] == "embedded"}
    order = {"embedded": 0, "colocated": 1, "split": 2}
    clients = {"in-process": 0, "socket": 1, "aiohttp": 2, "grpc": 3}
    for r in sorted(rows, key=lambda r: (r["case"], order[r["path"]], clients[r["protocol"]])):
        ft = r["first_token"]
        base = engine.get(r["case"]) if r["path"] != "embedded" else None
        added = "" if base is None else f"{ft['median_ms'] - base:+.2f}"
        lines.append(f"| {r['case']} | {r['path']} | {r['protocol']} | {ft['median_ms']:.2f} | "
                     f"{ft['p10_ms']:.2f} / {ft['p90_ms']:.2f} | {added} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="default", help="comma-separated: default, qwen3-8b-target, qwen3-8b-pair")
    parser.add_argument("--size", choices=["real", "tiny"], default="real", help="tiny: tiny models (a CPU)")
    parser.add_argument("--data-dir", help="the bench-data folder (the default case's prompt sets)")
    parser.add_argument("--models", help="where the random models are written (default OUT/models)")
    parser.add_argument("--device", help="engine.device for every engine (default: cuda where there is one)")
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument("--topologies", default="colocated,split",
                        help="the served topologies to run (of a case's); none: the embedded rows only (a later "
                             "--no-embedded run adds the served ones, for a case too long for one sitting)")
    parser.add_argument("--serve-flag", dest="serve_flags", action="append", default=[],
                        help="a flag for every `dflash serve` only, e.g. --serve-flag=--cuda-mps (repeatable)")
    parser.add_argument("--no-embedded", dest="embedded", action="store_false",
                        help="keep the embedded rows of an earlier run in --out instead of running them again")
    parser.add_argument("--out", default="serving-path", help="folder for every run's report and serving_path.json/.md")
    parser.add_argument("--profile-concurrency", type=int,
                        help="py-spy the server's processes once per topology under a gRPC load of its own at "
                             "this concurrency, after the measured runs (py-spy on PATH); raw stacks and a summary "
                             "in OUT/CASE/profile-TOPOLOGY")
    parser.add_argument("--first-token-requests", type=int,
                        help="one-token requests at c 1 in the engine and, per topology, through the server by a "
                             "bare socket, aiohttp and grpc.aio (`bench.first_token`: the server's share of the TTFT "
                             "added and the client libraries'); 0: none (default: 200, 20 at --size tiny)")
    parser.add_argument("--profile-seconds", type=float, default=8.0)
    parser.add_argument("--profile-protocol", choices=["grpc", "openai"], default="grpc",
                        help="the protocol of the profiled load")
    args = parser.parse_args(argv)
    args.topologies = [] if args.topologies == "none" else args.topologies.split(",")
    if args.first_token_requests is None:
        args.first_token_requests = 20 if args.size == "tiny" else 200
    if not set(args.topologies) <= {"colocated", "split"}:
        parser.error(f"--topologies takes colocated and/or split, or none, got {','.join(args.topologies)!r}")
    if not args.topologies and not args.embedded:
        parser.error("--topologies none with --no-embedded runs nothing")
    out = Path(args.out)
    models = Path(args.models) if args.models else out / "models"
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device_flags = ["--device", device]
    known = cases(args.size, models, args.data_dir)
    names = args.case.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(known)}")
    if "default" in names and args.size == "real" and not args.data_dir:
        parser.error("the default case reads its prompt sets from --data-dir")
    if args.profile_concurrency is not None:
        missing = [n for n in names if str(args.profile_concurrency) not in known[n].concurrency.split(",")]
        if missing:
            parser.error(f"--profile-concurrency {args.profile_concurrency} is not a load of case(s) {missing} "
                         f"(theirs: {', '.join(known[n].concurrency for n in missing)})")
        from dflash_serve.services.bench.py_spy import py_spy

        try:
            py_spy()
        except RuntimeError as err:
            parser.error(str(err))
    if args.size == "tiny" or set(names) - {"default"}:
        write_models(models, args.size, device)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "serving_path.json"
    kept = json.loads(results_path.read_text())["results"] if results_path.exists() else []
    paths = set(args.topologies) | ({"embedded"} if args.embedded else set())
    results = rows_kept(kept, names, paths, first_token=args.first_token_requests > 0)

    def save() -> None:
        results_path.write_text(json.dumps({"size": args.size, "device": _device_name(device),
                                            "results": results}, indent=1))

    with open(out / "bench.log", "a") as log:
        for name in names:
            run_case(known[name], out / name, args, log, results, save)
    text = table([r for r in results if "first_token" not in r])
    probed = [r for r in results if "first_token" in r]
    if probed:
        text += "\n\n" + first_token_table(probed)
    (out / "serving_path.md").write_text(text + "\n")
    print(text)
    return 0


def rows_kept(kept: list[dict], cases: list[str], paths: set[str], *, first_token: bool) -> list[dict]:
    """The rows of an earlier run in --out that this run does not measure again: other cases, other
    paths, and the first-token rows of a run without probes."""
    def run_again(r: dict) -> bool:
        return r["case"] in cases and r["path"] in paths and (first_token or "first_token" not in r)

    return [r for r in kept if not run_again(r)]


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


if __name__ == "__main__":
    sys.exit(main())
