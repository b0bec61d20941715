"""Tensor parallelism (services/engine/tensor_parallel.py) on the CPU: two ranks over gloo, rank 1
a real process of its own, against the same checkpoints at tensor_parallel_size 1, in float32 —
logits and features equal to rounding (the row-parallel sums add in another order), greedy
outputs equal; what cannot be sharded refused at load; a rank killed mid-request fails the
replica with the reason."""

from __future__ import annotations

import asyncio
import re
import time

import psutil
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.kv_cache import AttentionBatch
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.tensor_parallel import rank_device
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.models import save_drafter
from dflash_serve.services.verifier.output_stream import OutputListener
from dflash_serve.services.verifier.verifier import Verifier
from tests.conftest import drafter_config, gemma4_drafter, random_drafter
from tests.served_pair import run_request
from tests.targets import gemma4_31b_twin, gemma4_e4b_twin, qwen3_moe_twin, tiny_target

V = 97  # odd: the vocabulary splits 49 + 48, the second slice padded
B = 4  # the drafter's block
KV = 4  # tokens per KV block


@pytest.fixture(autouse=True)
def target_impl():
    """Only the fused forward is sharded: tests/engine/conftest.py's run over transformers' code does not apply."""
    return "fused"


@pytest.fixture(autouse=True)
def chain_rounds():
    """The engines here are built by the loader, as served (on a CPU: one host sync per round)."""
    return False


def _save_pair(family: str, root) -> tuple[str, str]:
    """A twin of `family` and a random drafter reading its features; their folders."""
    target, drafter = root / f"{family}-target", root / f"{family}-drafter"
    if family == "gemma4":  # the 31B's two KV geometries, its global layers with 2 KV heads (the real: 4)
        gemma4_31b_twin(seed=3, vocab_size=V, global_kv_heads=2).save_pretrained(target)
        save_drafter(gemma4_drafter(block_size=B, seed=4, vocab_size=V), drafter)
    else:  # Llama's with a bias on every projection: split with the column-parallel ones, added once after the others
        tiny_target(family, layers=4, vocab=V, seed=21, biases=family == "llama").float().save_pretrained(target)
        cfg = drafter_config(vocab_size=V, num_target_layers=4, num_hidden_layers=2, block_size=B,
                             layer_types=["full_attention"] * 2,
                             dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
        save_drafter(random_drafter(cfg, seed=4, dtype=torch.float32), drafter)
    return str(target), str(drafter)


def _engine_config(target: str, drafter: str, tensor_parallel_size: int, max_model_len: int = 128) -> EngineConfig:
    return EngineConfig(target=target, drafter=drafter, dtype="float32", kv_block_size=KV,
                        num_kv_blocks=max_model_len // 2, max_num_seqs=2, max_prefill_tokens=16,
                        max_model_len=max_model_len, speculation="fixed", round_costs_dir="",
                        tensor_parallel_size=tensor_parallel_size)


@pytest.fixture(params=["llama", "qwen3", "gemma4"])
def engines(request, tmp_path):
    """(tensor_parallel_size 1, tensor_parallel_size 2) engines of one family's pair. One test
    each: a process holds one tensor-parallel engine at a time (its group is torch.distributed's)."""
    target, drafter = _save_pair(request.param, tmp_path)
    one = build_engine(_engine_config(target, drafter, 1))
    two = build_engine(_engine_config(target, drafter, 2))
    yield request.param, one, two
    two.runner.tp.close()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, V - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _forward(engine, tables: list[list[int]], starts: list[int], tokens: list[list[int]]):
    """The target's forward over `tokens` of sequences at `starts` in `tables`: every row's (logits, features)."""
    device = engine.device
    ids = torch.tensor([t for seq in tokens for t in seq], device=device)
    positions = torch.tensor([start + i for start, seq in zip(starts, tokens, strict=True) for i in range(len(seq))],
                             device=device)
    batch = AttentionBatch.build(tables, starts, [len(seq) for seq in tokens], KV, device)
    return engine.runner.forward(ids, positions, batch, torch.arange(ids.numel(), device=device))


def assert_two_ranks_compute_what_one_does(family: str, one, two, *, tolerance: float) -> None:
    """A prefill of two prompts, then a step reading their K/V: every row's logits and features
    agree to `tolerance`; then speculative decoding gives the same greedy tokens."""
    tables, prompts = [[0, 1, 2, 3], [4, 5, 6, 7]], [_tokens(11, 1), _tokens(6, 2)]
    if family == "gemma4":  # its sliding layers' K/V in window slots: rank 0's map goes to rank 1 with each step
        for engine in (one, two):  # as the allocator would give them
            engine.runner.pool.window_map[:8] = torch.arange(8, dtype=torch.int32)
    for starts, tokens in (([0, 0], prompts), ([11, 6], [[7], [9]])):
        (logits_1, features_1), (logits_2, features_2) = (_forward(e, tables, starts, tokens) for e in (one, two))
        assert logits_2.shape == logits_1.shape == (sum(map(len, tokens)), V)
        torch.testing.assert_close(logits_2, logits_1, rtol=tolerance, atol=tolerance)
        # The residual stream's rounding is at its own scale (Gemma's reaches ~10 here).
        torch.testing.assert_close(features_2, features_1, rtol=tolerance,
                                   atol=tolerance * features_1.abs().max().item())
    prompts = [_tokens(9, 3), _tokens(14, 4), _tokens(5, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [seq.output_ids for seq in one.generate(prompts, params)]
    assert [seq.output_ids for seq in two.generate(prompts, params)] == expected


def test_two_ranks_compute_what_one_does(engines):
    """A prefill of two prompts, then a step reading their K/V: every row's logits and features;
    then speculative decoding, the drafter on rank 0 reading its features: the same greedy tokens."""
    family, one, two = engines
    heads = [spec.num_kv_heads for spec in one.runner.pool.layout]
    assert [spec.num_kv_heads for spec in two.runner.pool.layout] == [h // 2 for h in heads]  # each rank's half
    assert_two_ranks_compute_what_one_does(family, one, two, tolerance=1e-5)
    assert two.proposer is not None and two.timings.rounds > 0


def test_rank_r_takes_the_r_th_gpu_after_the_engines():
    assert [rank_device(device, 1) for device in ("cuda", "cuda:2", "cpu")] == ["cuda:1", "cuda:3", "cpu"]


def _gelu_llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu"))


@pytest.mark.parametrize("twin, says", [
    (lambda: gemma4_31b_twin(seed=3, vocab_size=V),
     r"cannot be sharded: num_global_key_value_heads=1 \(KV heads of layer 2\) is not divisible by "
     "tensor_parallel_size=2"),
    (lambda: gemma4_e4b_twin(seed=3), "cannot be sharded: hidden_size_per_layer_input"),
    (qwen3_moe_twin, "cannot be sharded: mixture-of-experts"),
    (_gelu_llama, "needs the fused target forward, which LlamaForCausalLM has not"),
], ids=["gemma4-31b-one-global-kv-head", "gemma4-e4b-per-layer-inputs", "qwen3-moe", "no-fused-forward"])
def test_what_cannot_be_sharded_is_refused_at_load_naming_it(twin, says, tmp_path):
    twin().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2.*{says}"):
        build_engine(EngineConfig(target=str(tmp_path), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2))


def test_a_verifier_replica_runs_its_ranks_and_fails_with_the_reason_when_one_is_killed(tmp_path):
    """As served (without Ray): the replica's engine process starts rank 1, its child; a request
    decodes as one rank decodes it; rank 1 killed while a request decodes ends that request with
    an error naming it, and the replica's health check fails from then on (Serve replaces it)."""
    target, drafter = _save_pair("qwen3", tmp_path)
    # Room for a request that still decodes when the kill lands (~1,000 rounds).
    config = _engine_config(target, drafter, 2, max_model_len=4096)
    prompt, params = _tokens(10, 7), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (expected,) = build_engine(_engine_config(target, drafter, 1)).generate([prompt], params)
    verifier = Verifier({"engine": config.to_dict(), "topology": "colocated"})
    try:
        (rank_1,) = psutil.Process(verifier._process.pid).children()
        outputs = asyncio.run(run_request(verifier, prompt, params))
        assert [t for out in outputs for t in out.new_token_ids] == expected.output_ids

        async def killed_mid_request():
            listener = OutputListener()
            queue = listener.open("long")
            long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
            call = asyncio.ensure_future(verifier.generate(prompt, long, "long", await listener.reply_to()))
            assert not (await asyncio.wait_for(queue.get(), 30)).finished  # it decodes
            rank_1.kill()
            while not (last := await asyncio.wait_for(queue.get(), 30)).finished:
                pass
            await asyncio.wait_for(call, 30)
            await listener.aclose()
            return last

        last = asyncio.run(killed_mid_request())
        reason = f"TensorParallelError: tensor-parallel rank 1 (pid {rank_1.pid}) exited with signal SIGKILL"
        assert last.finish_reason is FinishReason.ERROR
        assert last.error.startswith(f"the engine loop stopped: {reason}"), last.error
        deadline = time.monotonic() + 30
        while not verifier._loop_error and time.monotonic() < deadline:  # the engine process's last message
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=re.escape(f"the engine loop stopped: {reason}")):
            verifier.check_health()
    finally:
        verifier.shutdown()
