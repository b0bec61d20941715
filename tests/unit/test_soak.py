"""services/bench/soak.py's own logic, without a server: the readiness wait and process keys."""

import grpc
import pytest

from dflash_serve.services.bench import soak


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "no verifier replica is running"


class _Stub:
    """Answers with the given statuses in turn (None: a successful one-message stream)."""

    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0

    def Generate(self, request, timeout):  # noqa: N802 - the gRPC method's name
        self.calls += 1
        answer = self.answers.pop(0)
        if answer is not None:
            raise _Status(answer)
        return iter([object()])


class _Reference:
    outputs = {"hello": [1, 2, 3]}


def _soak(stub) -> soak.Soak:
    return soak.Soak(stub, _Reference(), streams=1, max_tokens=4, cancel_fraction=0, bad_fraction=0, seed=0,
                     timeout_s=5)


def test_the_soak_waits_while_the_server_starts(monkeypatch):
    monkeypatch.setattr(soak.time, "sleep", lambda s: None)
    # Serve's proxy says NOT_FOUND until the application is deployed, the router UNAVAILABLE
    # until its verifier runs (both seen on the H100 at start-up).
    stub = _Stub([grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, None])
    _soak(stub).wait_until_ready(timeout_s=60)
    assert stub.calls == 4


def test_the_readiness_wait_fails_on_any_other_status_with_its_name():
    with pytest.raises(RuntimeError, match="INTERNAL"):
        _soak(_Stub([grpc.StatusCode.INTERNAL])).wait_until_ready(timeout_s=60)


def test_the_readiness_wait_gives_up_after_its_timeout(monkeypatch):
    monkeypatch.setattr(soak.time, "sleep", lambda s: None)
    clock = iter([0.0, 0.5, 2.0])
    monkeypatch.setattr(soak.time, "monotonic", lambda: next(clock))
    with pytest.raises(RuntimeError, match="not ready after 2 s: UNAVAILABLE"):
        _soak(_Stub([grpc.StatusCode.UNAVAILABLE] * 2)).wait_until_ready(timeout_s=1)


class _EchoStub:
    """Streams the reference's tokens for `hello`, cut to the request's max_tokens."""

    def Generate(self, request, timeout):  # noqa: N802 - the gRPC method's name
        return iter([soak.generation_pb2.GenerateResponse(
            token_ids=_Reference.outputs["hello"][:request.sampling.max_tokens])])


def test_progress_reports_say_incomplete_and_the_final_one_complete():
    """A report written while the soak runs (its --out every minute) must not read as a finished run."""
    reference = _Reference()
    reference.expected = lambda prompt, max_tokens: reference.outputs[prompt][:max_tokens]
    runner = soak.Soak(_EchoStub(), reference, streams=2, max_tokens=3, cancel_fraction=0, bad_fraction=0, seed=0,
                       timeout_s=5)
    seen = []
    report = runner.run(1.2, progress=lambda r: seen.append(r.to_dict()), progress_every_s=0.5)
    assert seen and all(not r["complete"] for r in seen)
    assert report.to_dict()["complete"] and report.ok and report.requests["greedy"] > 0
