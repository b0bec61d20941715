"""Tensor parallelism on two GPUs over NCCL: what tests/engine/test_tensor_parallel.py checks over
gloo — two ranks compute what one does, in float32 — and a rank killed mid-request: rank 0's
process (a verifier replica's engine process) exits, so nothing computed with the dead rank
reaches a client, and the request's call fails as a lost replica's does (retryable).

Skipped without two CUDA devices (CI); run on a two-GPU machine.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest
import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.verifier.output_stream import OutputListener, StreamLost
from dflash_serve.services.verifier.verifier import Verifier
from tests.engine.test_tensor_parallel import _engine_config, _save_pair, _tokens, assert_two_ranks_compute_what_one_does

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _cuda(config: EngineConfig) -> EngineConfig:
    return EngineConfig(**{**config.to_dict(), "device": "cuda"})


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_two_gpus_compute_what_one_does(family, tmp_path):
    """CUDA graphs asked for: with two ranks the forwards run eagerly (not captured over NCCL yet)."""
    target, drafter = _save_pair(family, tmp_path)
    one = build_engine(_cuda(_engine_config(target, drafter, 1)))
    two = build_engine(_cuda(_engine_config(target, drafter, 2)))
    try:
        assert two.graphs is None and one.graphs is not None
        assert_two_ranks_compute_what_one_does(family, one, two, tolerance=1e-4)
    finally:
        two.runner.tp.close()


def test_a_rank_killed_mid_request_takes_its_replicas_engine_process_down(tmp_path):
    target, drafter = _save_pair("qwen3", tmp_path)
    config = _cuda(_engine_config(target, drafter, 2, max_model_len=4096))
    verifier = Verifier({"engine": config.to_dict(), "topology": "colocated"})
    try:
        (rank_1,) = psutil.Process(verifier._process.pid).children()

        async def killed_mid_request():
            listener = OutputListener()
            queue = listener.open("long")
            params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
            reply_to = await listener.reply_to()
            call = asyncio.ensure_future(verifier.generate(_tokens(10, 7), params, "long", reply_to))
            assert not (await asyncio.wait_for(queue.get(), 60)).finished  # it decodes
            rank_1.kill()
            with pytest.raises(StreamLost, match=r"verifier replica exited \(exit code 70\): retry"):
                await asyncio.wait_for(call, 60)
            await listener.aclose()

        asyncio.run(killed_mid_request())
        with pytest.raises(RuntimeError, match="the engine process exited"):
            verifier.check_health()
    finally:
        verifier.shutdown()
