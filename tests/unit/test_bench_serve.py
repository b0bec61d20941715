"""`dflash bench`: its statistics on synthetic records; the embedded engine end to end (CLI and
report files); and the gRPC load loop against a real in-process gRPC server hosting the real
Router in front of a real (colocated) Verifier, without Ray. The engine's benchmark-only
`synthetic_tau` fixes every round's acceptance, so tau and per-position acceptance are known."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import grpc
import pytest

from services.api.dflash.v1 import generation_pb2_grpc
from services.bench.prompts import Prompt
from services.bench.serve_bench import (
    BenchSampling,
    EmbeddedBackend,
    GrpcBackend,
    RequestRecord,
    distribution_ms,
    run_bench,
    summarize,
)
from services.config import EngineConfig
from services.engine.loader import build_engine
from services.router.router import Router, RpcFailed
from services.verifier.verifier import Verifier
from tests.bench_data import write_tiny_bench_data
from tests.served_pair import save_tiny_pair

BLOCK = 6
PROMPTS = [Prompt("toy", str(i), text) for i, text in enumerate(
    ["def fib(n):", "Write a haiku about the sea.", "import os\nprint(os.getcwd())", "What is 2 + 2?", "Hello"])]
# 1 token from the prefill, then rounds of 3 (synthetic tau 3): 1 + 3 + 3 = 7, exactly 2 rounds.
SAMPLING = BenchSampling(max_tokens=7, ignore_eos=True)


# -- statistics -----------------------------------------------------------------------------------


def record(start, arrivals, tokens, rounds=0, accepted=0, per_position=(), error=None) -> RequestRecord:
    return RequestRecord(start=start, arrivals=list(arrivals),
                         output_tokens=tokens, rounds=rounds, draft_tokens=rounds * (BLOCK - 1),
                         accepted_tokens=accepted, accepted_per_position=list(per_position), error=error)


def test_latencies_of_one_request():
    r = record(1.0, [(1.5, 1), (1.7, 3), (2.3, 2)], tokens=6)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.8 / 5)  # first token to last, over the 5 tokens after the first
    assert r.itls() == pytest.approx([0.2 / 3] * 3 + [0.3] * 2)  # a message's gap, spread over its tokens
    assert record(0.0, [(0.1, 1)], tokens=1).tpot is None and record(0.0, [], tokens=0).ttft is None


def test_distribution_in_ms():
    stats = distribution_ms([i / 1e3 for i in range(1, 101)])  # 1..100 ms
    assert stats == pytest.approx({"mean": 50.5, "median": 50.5, "p99": 99.01})  # p99 interpolated linearly
    assert distribution_ms([]) == {"mean": None, "median": None, "p99": None}


def test_summary_pools_rounds_and_leaves_failed_requests_out():
    records = [
        record(0.0, [(0.1, 1), (0.2, 4)], tokens=5, rounds=1, accepted=3, per_position=[1, 1, 1, 0, 0]),
        record(0.0, [(0.3, 1), (0.4, 1), (0.5, 2)], tokens=4, rounds=2, accepted=1, per_position=[1, 0, 0, 0, 0]),
        record(0.0, [], tokens=0, error="RESOURCE_EXHAUSTED"),
        record(0.0, [(0.1, 1)], tokens=0, error="INTERNAL"),
    ]
    s = summarize(records, duration=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1, "INTERNAL": 1}
    assert s["output_tokens"] == 9 and s["output_tok_s"] == 4.5 and s["request_throughput"] == 1.0
    assert s["tau"] == pytest.approx(1 + 4 / 3)  # pooled over rounds, not a mean of per-request taus
    assert s["tau_per_request"] == pytest.approx(((1 + 3) + (1 + 1 / 2)) / 2)  # DFlash's script's mean
    assert s["acceptance_rate"] == pytest.approx(4 / 15)
    assert s["accepted_per_position"] == [2, 1, 1, 0, 0]
    assert s["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 0, 0])
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 300) / 2: failed requests are left out


def test_target_only_has_no_tau():
    s = summarize([record(0.0, [(0.1, 1), (0.2, 1)], tokens=2)], duration=1.0)
    assert s["tau"] is None and s["tau_per_request"] is None
    assert s["acceptance_rate"] is None and s["acceptance_per_position"] == []


# -- the embedded engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), block_size=BLOCK)


def check_known_acceptance(run: dict, requests: int) -> None:
    """Synthetic τ = 3: every request takes 2 rounds that each accept the first 2 of B-1 drafts."""
    assert (run["completed"], run["failed"]) == (requests, 0)
    assert run["output_tokens"] == SAMPLING.max_tokens * requests
    assert run["rounds"] == 2 * requests
    assert run["tau"] == run["tau_per_request"] == pytest.approx(3.0)  # equal when every request is alike
    assert run["acceptance_rate"] == pytest.approx(2 / (BLOCK - 1))
    assert run["acceptance_per_position"] == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0])


def test_embedded_runs_at_each_concurrency(model_pair):
    target, drafter = model_pair
    engine = build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=4))
    engine.synthetic_tau = 3.0
    runs = run_bench(EmbeddedBackend(engine), {"toy": PROMPTS}, [1, 4], SAMPLING, warmup=1, show_progress=False)
    assert [(r["dataset"], r["concurrency"]) for r in runs] == [("toy", 1), ("toy", 4)]
    for run in runs:
        check_known_acceptance(run, len(PROMPTS))
    assert not engine.sequences and engine.allocator.num_free == engine.allocator.num_blocks  # all released


def test_embedded_counts_refused_requests_as_failed(model_pair):
    target, _ = model_pair
    engine = build_engine(EngineConfig(target=target, max_tokens_limit=16))
    records = EmbeddedBackend(engine).run(PROMPTS[:2], BenchSampling(max_tokens=17), concurrency=2)
    assert summarize(records, 1.0)["errors"] == {"INVALID_ARGUMENT": 2}


def test_the_cli_writes_json_markdown_and_a_plot(model_pair, tmp_path, capsys):
    from services.cli import main

    target, drafter = model_pair
    out = tmp_path / "bench"
    data = write_tiny_bench_data(tmp_path / "bench-data")
    assert main(["bench", "--embedded", "--target", target, "--drafter", drafter, "--dataset", "gsm8k,mbpp",
                 "--data-dir", str(data), "--num-prompts", "2", "--concurrency", "1,2", "--warmup", "1",
                 "--max-tokens", "5", "--ignore-eos", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["drafter"] == drafter and results["setup"]["block_size"] == BLOCK
    assert [(r["dataset"], r["concurrency"]) for r in results["runs"]] == [
        ("gsm8k", 1), ("mbpp", 1), ("gsm8k", 2), ("mbpp", 2)]
    for run in results["runs"]:
        assert run["completed"] == 2 and run["output_tokens"] == 10
        assert run["tau"] == pytest.approx(1 + sum(run["accepted_per_position"]) / run["rounds"])
        assert len(run["acceptance_per_position"]) == BLOCK - 1
    table = (out / "results.md").read_text()
    assert "| dataset | concurrency | ok | failed | output tok/s | TTFT | TPOT | ITL | τ | τ per request | acceptance |" in table
    assert "| gsm8k | 2 | 2 | 0 |" in table and "Acceptance per draft position" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table in capsys.readouterr().out


# -- over gRPC ------------------------------------------------------------------------------------


class InProcessVerifierHandle:
    """The shape of the verifier's Ray Serve handle (generate.options(stream=True).remote(...),
    model_info.remote()) over a Verifier in this process."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.generate = SimpleNamespace(options=lambda stream: SimpleNamespace(remote=self._generate))
        self.model_info = SimpleNamespace(remote=self._model_info)

    def _generate(self, prompt_ids, params, request_id):
        return _Stream(self.verifier.generate(prompt_ids, params, request_id))

    async def _model_info(self):
        return self.verifier.model_info()


class _Stream:
    def __init__(self, outputs):
        self.outputs = outputs

    def __aiter__(self):
        return self.outputs

    def cancel(self):
        asyncio.ensure_future(self.outputs.aclose())  # closing the generator cancels the request


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Hosts the router on grpc.aio, as the Serve proxy does."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):  # noqa: N802
        try:
            async for response in self.router.Generate(request, context):
                yield response
        except RpcFailed:
            return

    async def GetModelInfo(self, request, context):  # noqa: N802
        return await self.router.GetModelInfo(request, context)


@pytest.fixture(scope="module")
def server(model_pair):
    target, drafter = model_pair
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 4, "max_tokens_limit": 64},
                         "topology": "colocated"})
    verifier.engine.synthetic_tau = 3.0
    router = Router(InProcessVerifierHandle(verifier), target, max_model_len=512, max_tokens_limit=64,
                    default_max_tokens=16, max_pending=8)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        grpc_server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        return grpc_server, port

    grpc_server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(grpc_server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    verifier.shutdown()


def test_grpc_runs_against_the_real_router_and_verifier(server, model_pair):
    backend = GrpcBackend(server, timeout=30)
    setup = backend.describe()
    assert (setup["target"], setup["drafter"], setup["topology"]) == (*model_pair, "colocated")
    runs = run_bench(backend, {"toy": PROMPTS}, [1, 3], SAMPLING, warmup=1, show_progress=False)
    for run in runs:
        check_known_acceptance(run, len(PROMPTS))


def test_grpc_failures_are_counted_by_status_code(server):
    records = GrpcBackend(server, timeout=30).run(PROMPTS[:3], BenchSampling(max_tokens=65), concurrency=2)
    s = summarize(records, 1.0)
    assert (s["completed"], s["failed"], s["errors"]) == (0, 3, {"INVALID_ARGUMENT": 3})
    records = GrpcBackend("127.0.0.1:1", timeout=5).run(PROMPTS[:1], SAMPLING, concurrency=1)
    assert records[0].error == "UNAVAILABLE"

