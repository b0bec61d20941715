"""drafter_placement own_gpu on two GPUs: a drafter process that sees the verifier's GPU first and
its own second maps the verifier's buffers on the first (CUDA IPC), computes on the second, and
hands its drafts back across GPUs; the engine's output is the colocated engine's, token for token.

Skipped without two CUDA devices (CI); run on a two-GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.drafter.actor import cuda_visibility
from dflash_serve.services.engine.loader import assemble_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models import TargetModel
from tests.conftest import drafter_config, random_drafter
from tests.targets import tiny_target

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

V, B = 96, 6


def _physical_ids() -> list[str]:
    """This process's cuda:0 and cuda:1 as CUDA_VISIBLE_DEVICES names them (what Ray's
    get_gpu_ids() gives the verifier and the drafter)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:2] if visible else ["0", "1"]


def _engine(target: TargetModel, graphs: bool, spec_table, drafter=None, remote_drafter=None):
    config = EngineConfig(target="tiny", device="cuda:0", kv_block_size=16, num_kv_blocks=128, max_num_seqs=4,
                          cuda_graphs=graphs, speculation="fixed", num_speculative_tokens_per_batch_size=spec_table or {})
    return assemble_engine(config, target, drafter, remote_drafter=remote_drafter,
                           remote_drafter_kv_here=remote_drafter is None)


@pytest.mark.parametrize("spec_table", [None, {1: 3}], ids=["all-drafts", "k3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("graphs", [False, True])
def test_a_drafter_on_its_own_gpu_matches_the_colocated_engine(graphs, tied, spec_table, tmp_path):
    from dflash_serve.services.drafter.server import spawn_drafter_process
    from dflash_serve.services.models import save_drafter
    from dflash_serve.services.verifier.remote_drafter import RemoteProposer

    model = tiny_target("qwen3", layers=4, vocab=V, seed=7).float().to("cuda:0")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2,
                         dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    drafter = random_drafter(cfg, seed=3, dtype=torch.float32).to("cuda:0")
    target = TargetModel(model, drafter.config.target_layer_ids)
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    colocated = _engine(target, graphs, spec_table, drafter=drafter).generate(prompts, params)

    save_drafter(drafter, tmp_path / "drafter")
    verifier_gpu, own_gpu = _physical_ids()
    visible, device = cuda_visibility([verifier_gpu], [own_gpu], "cuda:0")
    assert device == "cuda:1"
    free_before, _ = torch.cuda.mem_get_info(1)  # after this process's own context there
    process, address = spawn_drafter_process(str(tmp_path / "drafter"), device=device, dtype="float32",
                                             visible_devices=visible)
    shared = []
    try:
        engine = _engine(target, graphs, spec_table, remote_drafter=drafter.config)
        proposer = RemoteProposer.connect(address, target=target, block_size=B, kv_block_size=16,
                                          num_kv_blocks=engine.runner.pool.num_blocks, capacity_rows=256,
                                          max_num_seqs=4, shared=shared, graphs=engine.graphs)
        engine.attach_proposer(proposer)
        split = engine.generate(prompts, params)
        # The drafter's context, weights, copied target head and KV pool are on the second GPU.
        free_after, _ = torch.cuda.mem_get_info(1)
        assert free_before - free_after > 64 * 2**20
        for a, b in zip(colocated, split, strict=True):
            assert b.output_ids == a.output_ids
            assert b.stats.accepted_per_position == a.stats.accepted_per_position
        assert engine.allocator.num_free == engine.allocator.num_blocks
        proposer.release()
    finally:
        process.terminate()
        process.join(10)
        for buffer in shared:
            buffer.close()
