"""The real application on a real local Ray: gRPC in, router, verifier and drafter actors.

Streamed output equals the embedded engine's; bad input gets INVALID_ARGUMENT; a cancelled stream
frees every KV block on both actors; killing the drafter mid-stream loses no request and keeps
the output lossless; the exported counters are consistent; health and reflection answer.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request

import grpc
import psutil
import pytest

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.integration.conftest import DEVICE, deployed_app

pytestmark = pytest.mark.integration


def _wait(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def app(ray_serve, model_pair):
    with deployed_app(ray_serve, model_pair) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def embedded(model_pair):
    target, drafter = model_pair
    return build_engine(EngineConfig(target=target, drafter=drafter, device=DEVICE, num_kv_blocks=256))


def _stream(stub, **request):
    responses = list(stub.Generate(generation_pb2.GenerateRequest(**request), timeout=60))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses[-1]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=5)], ids=["greedy", "seeded"])
def test_streamed_output_equals_the_embedded_engine(app, embedded, sampling):
    prompt = "def main():\n    return"
    ids, text, last = _stream(app["stub"], prompt=prompt, sampling=generation_pb2.SamplingParams(max_tokens=24, **sampling))
    prompt_ids = embedded.tokenizer.encode(prompt)
    reference = embedded.generate([prompt_ids], SamplingParams(max_tokens=24, **sampling))[0]
    assert ids == reference.output_ids
    assert last.finish_reason in (generation_pb2.FINISH_REASON_LENGTH, generation_pb2.FINISH_REASON_STOP)
    assert last.usage.completion_tokens == len(ids) and last.usage.prompt_tokens == len(prompt_ids)
    assert last.spec_stats.num_drafts > 0
    assert sum(last.spec_stats.accepted_per_position) == last.spec_stats.num_accepted_tokens


def test_the_router_finds_the_verifiers_engine_and_sends_it_requests_directly_with_the_same_outputs(app, embedded):
    """The verifier registers its engine process's intake in Ray's key-value store; the router's
    requests look it up and, once connected, go there instead of through a Serve call."""
    _wait_direct(app)
    prompt = "def add(a, b):"
    ids, _, last = _stream(app["stub"], prompt=prompt, sampling=generation_pb2.SamplingParams(max_tokens=24,
                                                                                             temperature=0.0))
    reference = embedded.generate([embedded.tokenizer.encode(prompt)], SamplingParams(max_tokens=24,
                                                                                      temperature=0.0))[0]
    assert ids == reference.output_ids and last.spec_stats.num_drafts > 0


def _wait_direct(app) -> None:
    """Until the router sends its requests straight to the engine's intake."""
    def reached_directly():
        _stream(app["stub"], prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=2))
        return _verifier_stats(app)["router_intakes"] >= 1

    _wait(reached_directly, what="the router's direct intake to the engine")


@pytest.mark.parametrize(
    "request_kwargs, fragment",
    [
        (dict(), "input"),
        (dict(prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(prompt="x", sampling=generation_pb2.SamplingParams(max_tokens=10**9)), "max_tokens must be <="),
        (dict(token_ids=generation_pb2.TokenIds(ids=[5] * 1000)), "context"),
        (dict(prompt="x", sampling=generation_pb2.SamplingParams(top_p=0.0)), "top_p"),
        (dict(prompt="x", sampling=generation_pb2.SamplingParams(temperature=-1)), "temperature"),
        (dict(prompt="x", sampling=generation_pb2.SamplingParams(top_p=1.5)), "top_p"),
        (dict(prompt="x", sampling=generation_pb2.SamplingParams(top_k=-2)), "top_k"),
        (dict(chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="wizard", content="x")])),
         "wizard"),
    ],
)
def test_invalid_input_gets_invalid_argument_with_the_reason(app, request_kwargs, fragment):
    with pytest.raises(grpc.RpcError) as err:
        list(app["stub"].Generate(generation_pb2.GenerateRequest(**request_kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()


def _verifier_stats(app):
    return app["verifier"].stats.remote().result()


def _drafter_stats(app):
    import ray

    return ray.get(ray.get_actor(_verifier_stats(app)["drafter_actor"]).stats.remote())


def test_cancelling_mid_stream_frees_every_block_on_both_actors(app):
    call = app["stub"].Generate(generation_pb2.GenerateRequest(
        prompt="import os", sampling=generation_pb2.SamplingParams(max_tokens=400, ignore_eos=True)), timeout=60)
    next(call)
    next(call)
    call.cancel()
    stats = _wait(lambda: (s := _verifier_stats(app))["running"] == 0 and s["waiting"] == 0 and s, what="cancel")
    assert stats["kv_free_blocks"] == stats["kv_blocks"]
    _wait(lambda: _drafter_stats(app)["live_sequences"] == 0, what="the drafter to forget the sequence")


def test_past_max_pending_requests_are_resource_exhausted_and_nothing_leaks(app):
    long = generation_pb2.GenerateRequest(
        prompt="import os", sampling=generation_pb2.SamplingParams(max_tokens=480, ignore_eos=True))
    limit = app["config"].max_pending  # twice max_num_seqs: half of them wait in the engine
    calls = [app["stub"].Generate(long, timeout=120) for _ in range(limit)]
    try:
        _wait(lambda: (s := _verifier_stats(app))["running"] + s["waiting"] == limit, what="all requests in flight")
        with pytest.raises(grpc.RpcError) as err:
            list(app["stub"].Generate(long, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in err.value.details()
    finally:
        for call in calls:
            call.cancel()
    stats = _wait(lambda: (s := _verifier_stats(app))["running"] == 0 and s["waiting"] == 0 and s, what="cancel")
    assert stats["kv_free_blocks"] == stats["kv_blocks"]


def test_a_passed_deadline_is_deadline_exceeded_and_frees_the_request(app):
    call = app["stub"].Generate(generation_pb2.GenerateRequest(
        prompt="import os", sampling=generation_pb2.SamplingParams(max_tokens=480, ignore_eos=True)), timeout=0.3)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = _wait(lambda: (s := _verifier_stats(app))["running"] == 0 and s["waiting"] == 0 and s, what="deadline")
    assert stats["kv_free_blocks"] == stats["kv_blocks"]


def test_killing_the_drafter_mid_stream_loses_nothing_and_stays_lossless(app, embedded):
    import ray

    prompt = "class A:\n    def f(self):"
    sampling = generation_pb2.SamplingParams(max_tokens=60, ignore_eos=True)
    call = app["stub"].Generate(generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=120)
    first = [next(call)]
    ray.kill(ray.get_actor(_verifier_stats(app)["drafter_actor"]), no_restart=False)
    rest = list(call)
    ids = [t for r in first + rest for t in r.token_ids]
    reference = embedded.generate([embedded.tokenizer.encode(prompt)],
                                  SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))[0]
    assert ids == reference.output_ids
    assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert _verifier_stats(app)["drafter_losses"] >= 1
    _wait(lambda: _verifier_stats(app)["speculative"], what="the restarted drafter to be reattached")


def test_counters_are_consistent(app):
    _stream(app["stub"], prompt="for i in range(", sampling=generation_pb2.SamplingParams(max_tokens=20))

    def scrape():
        with urllib.request.urlopen(f"http://127.0.0.1:{app['ports']['metrics']}/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("ray_dflash_spec_decode"):
                name, value = line.rsplit(" ", 1)
                values[name] = values.get(name, 0.0) + float(value)
        drafts = sum(v for k, v in values.items() if k.startswith("ray_dflash_spec_decode_num_drafts_total"))
        return values if drafts > 0 else None  # the counters are exported from zero: wait for the round

    values = _wait(scrape, timeout=60, what="dflash metrics in the Ray scrape")

    def total(prefix):
        return sum(v for k, v in values.items() if k.startswith(prefix + "{") or k == prefix)

    drafts = total("ray_dflash_spec_decode_num_drafts_total")
    drafted = total("ray_dflash_spec_decode_num_draft_tokens_total")
    accepted = total("ray_dflash_spec_decode_num_accepted_tokens_total")
    per_pos = total("ray_dflash_spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and 0 <= accepted <= drafted
    assert per_pos == accepted


def test_the_verifier_replica_log_names_the_models_it_serves(app):
    """The startup log of each verifier replica (Serve's replica log file) says which models, at
    which revisions, it loaded; unpinned here (local folders)."""
    import glob

    import ray

    engine = app["config"].engine
    line = (f"models: target {engine.target} (unpinned: a local folder or the default branch); "
            f"drafter {engine.drafter} (unpinned: a local folder or the default branch)")
    logs = os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "serve", "replica_dflash_Verifier_*.log")

    def logged() -> bool:
        return any(line in open(path).read() for path in glob.glob(logs))

    _wait(logged, timeout=30, what=f"{line!r} in {logs}")


def test_health_and_reflection_answer(app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(app["channel"]).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    info = app["stub"].GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert info.block_size == 6 and info.topology == "split" and info.vocab_size == 600
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(app["channel"])
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    services = [s.name for r in replies for s in r.list_services_response.service]
    assert "dflash.v1.Generation" in services


def _scrape(app) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{app['ports']['metrics']}/metrics", timeout=5) as r:
        return [line for line in r.read().decode().splitlines() if line and not line.startswith("#")]


def test_every_series_the_dashboards_and_the_prometheus_rule_query_is_in_a_live_scrape(app):
    """A panel or alert on a series the server has not exported yet stays empty (and never
    fires): counters start at zero, gauges are set again every second, even while idle. The
    chart's PrometheusRule (recording rules and alerts, with a drafter) is held to the same."""
    from tests.helm.chart import render
    from tests.helm.promql import metric_names
    from tests.helm.test_dashboards import DASHBOARDS, expressions, load

    _stream(app["stub"], prompt="def add(a, b):", sampling=generation_pb2.SamplingParams(max_tokens=12))
    queried = {name for path in DASHBOARDS for expr in expressions(load(path)) for name in metric_names(expr)}
    (rule,) = render({"prometheusRule": {"enabled": True}}).all("PrometheusRule")
    rule_exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    assert any("alert" in r for group in rule["spec"]["groups"] for r in group["rules"])
    queried |= {name for expr in rule_exprs for name in metric_names(expr)}

    def missing():
        return queried - {line.split("{")[0].split(" ")[0] for line in _scrape(app)}

    deadline = time.monotonic() + 60
    while missing() and time.monotonic() < deadline:
        time.sleep(1)
    assert missing() == set()


def test_series_carry_vllms_model_name_and_finished_reasons(app):
    _stream(app["stub"], prompt="x = ", sampling=generation_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    long = generation_pb2.GenerateRequest(prompt="import os",
                                          sampling=generation_pb2.SamplingParams(max_tokens=400, ignore_eos=True))
    call = app["stub"].Generate(long, timeout=60)
    next(call)
    call.cancel()  # vLLM's abort
    pattern = re.compile(r'^ray_dflash_request_success_total\{.*finished_reason="(\w+)".*\} (\S+)$')

    served = f'model_name="{app["config"].model_name}"'  # the served name, not the target's path

    def reasons():
        found = {}
        for line in _scrape(app):
            if match := pattern.match(line):
                assert 'model_name="' in line and 'model="' not in line, line
                if served in line:  # (the node's agent still exports the series of apps tested before)
                    found[match[1]] = found.get(match[1], 0.0) + float(match[2])
        return found if found.get("length", 0) > 0 and found.get("abort", 0) > 0 else None

    found = _wait(reasons, timeout=60, what="a finished request in the scrape")
    assert found.keys() == {"stop", "length", "abort", "error"}  # vLLM's values, each from zero


def _serve_replica(deployment: str):
    """The one replica actor of `deployment` in the app (Serve names them SERVE_REPLICA::app#name#id)."""
    import ray

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::dflash#{deployment}#")]
    assert len(replicas) == 1, replicas
    return ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])


def _long_streams(stub, count: int) -> list:
    """`count` streams, each past its first token."""
    long = generation_pb2.GenerateRequest(prompt="import os",
                                          sampling=generation_pb2.SamplingParams(max_tokens=480, ignore_eos=True))
    calls = [stub.Generate(long, timeout=120) for _ in range(count)]
    for call in calls:
        next(call)
    return calls


def _wait_served_again(stub, *, fail_fast_s: float = 30) -> None:
    """Until a request is served; meanwhile every failure is UNAVAILABLE and comes fast."""
    def served():
        start = time.monotonic()
        try:
            _stream(stub, prompt="x = ", sampling=generation_pb2.SamplingParams(max_tokens=4))
            return True
        except grpc.RpcError as err:  # only while no replica runs, and without waiting out the restart
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert time.monotonic() - start < fail_fast_s  # 1 s locally, 10 s seen on a loaded 2-core CI machine
            return False

    _wait(served, timeout=180, what="a new replica to serve")


def _nothing_held(app) -> None:
    """No request, KV block, drafter sequence or shared-memory segment is left behind."""
    stats = _wait(lambda: (s := _verifier_stats(app))["running"] == 0 and s["waiting"] == 0 and s, what="idle")
    assert stats["kv_free_blocks"] == stats["kv_blocks"]
    _wait(lambda: _drafter_stats(app)["live_sequences"] == 0, what="the drafter to forget every sequence")
    # Shared buffers are unlinked once the drafter has mapped them. (Segments are named
    # dflash_<creator pid>_...: a test another pytest worker (-n) runs meanwhile may hold its own.)
    ours = _cluster_pids()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("dflash_")
                and ((pid := int(name.split("_")[1])) in ours or not psutil.pid_exists(pid))]


def _cluster_pids() -> set[int]:
    """This process and its descendants: the processes of this session's Ray cluster, and none
    of a server that another pytest worker (-n) runs on the machine meanwhile."""
    this = psutil.Process()
    return {this.pid, *(child.pid for child in this.children(recursive=True))}


def test_a_bounded_soak_is_lossless_and_leaks_nothing(app, model_pair):
    """services/bench/soak.py for 20 s, some hundreds of requests: greedy outputs equal the target
    alone's, cancellations and bad inputs end as they must, no replica restarted, nothing left
    held. DFLASH_TEST_SOAK_S sets another duration (it was 120 s, ~2,500 requests, until the
    suite had to fit in 5 minutes on CI's 2 cores, both of which a soak keeps busy)."""
    from dflash_serve.services.bench.soak import soak

    ours = _cluster_pids()
    report = soak(f"127.0.0.1:{app['ports']['grpc']}", model_pair[0], device=DEVICE, streams=4,
                  seconds=float(os.environ.get("DFLASH_TEST_SOAK_S", "20")),
                  max_tokens=24, cancel_fraction=0.2, bad_fraction=0.1)
    ours |= _cluster_pids()
    assert report.mismatches == 0, report.mismatch_examples
    assert not report.failures, report.to_dict()
    assert report.complete
    assert report.requests["greedy"] >= 20 and report.requests["cancelled"] and report.requests["bad_input"]
    assert report.outcomes["INVALID_ARGUMENT"] == report.requests["bad_input"]
    assert report.rss_mb is not None, report  # the replicas run here
    # The soak watches every replica on the machine: those of this session's cluster were not replaced.
    assert [p for p in report.rss_mb["replaced"] if int(p.split(":")[0]) in ours] == [], report.rss_mb
    _nothing_held(app)


def test_a_router_replica_dying_ends_its_streams_unavailable_and_leaks_nothing(app):
    """Streams through a killed router end UNAVAILABLE promptly (never hang), the verifier drops
    their requests, Serve starts a new router and it serves."""
    import ray

    stub = app["stub"]
    calls = _long_streams(stub, 2)
    killed = time.monotonic()
    ray.kill(_serve_replica("Router"), no_restart=True)
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.value.details(), err.value.details()
    assert time.monotonic() - killed < 30
    _wait_served_again(stub)
    _nothing_held(app)


def test_a_verifier_replica_dying_leaves_its_engine_to_the_next_replica_and_loses_nothing(app, embedded):
    """Last here: it restarts the verifier. Its engine process outlives it (`adoption`): the
    streams it held go on to their last token, exactly the engine's, requests sent meanwhile are
    served or fail fast and retryably, and the new replica adopts the same engine process, whose
    drafter (dead with the old replica) is replaced."""
    import ray

    stub = app["stub"]
    _wait_direct(app)  # a request sent as a Serve call dies with the replica's call: UNAVAILABLE, retry
    before = _verifier_stats(app)
    prompt = "import os"
    sampling = generation_pb2.SamplingParams(max_tokens=480, ignore_eos=True)
    calls = [stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=120)
             for _ in range(2)]
    firsts = [next(call) for call in calls]
    ray.kill(_serve_replica("Verifier"), no_restart=True)
    reference = embedded.generate([embedded.tokenizer.encode(prompt)],
                                  SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True))[0]
    for first, call in zip(firsts, calls, strict=True):
        rest = list(call)
        assert list(first.token_ids) + [t for r in rest for t in r.token_ids] == reference.output_ids
        assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    _wait_served_again(stub)
    after = _wait(lambda: (s := _verifier_stats(app))["drafter_actor"] != before["drafter_actor"] and s,
                  what="the new replica's stats")
    assert after["engine_pid"] == before["engine_pid"]  # adopted, not started again
    _wait(lambda: _verifier_stats(app)["speculative"], what="the new drafter to be attached")
    _nothing_held(app)
