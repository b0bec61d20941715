"""A verifier replica that can no longer serve says so: its health check raises (Serve replaces
it, the router reports NOT_SERVING) and the requests it held end with the reason, not a hang."""

from __future__ import annotations

import asyncio

import pytest

from dflash_serve.services.engine.sampling import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.verifier.verifier import Verifier
from tests.served_pair import run_request, save_tiny_pair


def test_a_stopped_engine_loop_fails_the_health_check_and_ends_the_requests_it_held(tmp_path):
    target, drafter = save_tiny_pair(tmp_path, block_size=6)
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2}, "topology": "colocated"})
    verifier.check_health()  # serving

    def broken_step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    verifier.engine.step = broken_step

    outputs = asyncio.run(asyncio.wait_for(
        run_request(verifier, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5)), timeout=30))
    last = outputs[-1]
    assert last.finished and last.finish_reason is FinishReason.ERROR
    assert last.error == "the engine loop stopped: RuntimeError: CUDA error: an illegal memory access was encountered"
    with pytest.raises(RuntimeError, match="the engine loop stopped: RuntimeError: CUDA error"):
        verifier.check_health()
    verifier.shutdown()
