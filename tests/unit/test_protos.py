"""The committed stubs are what protoc makes of protos/ today, and the messages round-trip."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from dflash_serve.services.api import codegen
from dflash_serve.services.api.dflash.v1 import drafter_pb2, generation_pb2, generation_pb2_grpc


def test_committed_stubs_are_not_stale():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the dev extra")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p.read_text() for p in codegen.generate(Path(tmp))}
    committed = {p.relative_to(codegen.PACKAGE_DIR): p.read_text()
                 for p in (codegen.PACKAGE_DIR / "dflash" / "v1").glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys(), "run: python -m dflash_serve.services.api.codegen"
    for name, text in fresh.items():
        assert committed[name] == text, f"{name} is stale: run python -m dflash_serve.services.api.codegen"


def test_generation_messages_round_trip():
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")]),
        sampling=generation_pb2.SamplingParams(temperature=0.5, seed=7, stop=["\n\n"]),
    )
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed.WhichOneof("input") == "chat" and parsed.sampling.seed == 7
    assert parsed.sampling.HasField("temperature") and not parsed.sampling.HasField("top_p")
    assert hasattr(generation_pb2_grpc, "add_GenerationServicer_to_server")


def test_drafter_frames_carry_handles_not_tensors():
    step = drafter_pb2.StepRequest(
        protocol_version=drafter_pb2.PROTOCOL_VERSION_1, step=3,
        features=drafter_pb2.KVBlockHandle(buffer_id="features-0", row_offset=128, rows=17),
        positions=list(range(100, 117)), slots=list(range(17)),
        request_ids=["a"], bonus_tokens=[5], starts=[117], block_tables=[drafter_pb2.BlockTable(blocks=[3, 9])],
    )
    frame = drafter_pb2.DrafterRequest(step=step).SerializeToString()
    parsed = drafter_pb2.DrafterRequest.FromString(frame)
    assert parsed.WhichOneof("kind") == "step" and parsed.step.features.rows == 17
    assert len(frame) < 400  # 17 feature rows of a 4096-wide model would be 139 KB inline
