"""`engine.deterministic`'s target forward: a token's logits have the same bits however it is batched.

One sequence is run through differently shaped forwards — its whole prompt at once; two chunks
beside other sequences' prefills, the second a verify-sized block; a chunk, then one token per
forward beside another sequence's decode — and its logits must be the same bits in all; for a
Gemma-4 31B twin (two KV geometries, global keys derived from values, sliding layers in window
slots given up and reused as the windows move) too. On the CPU
the batch-invariant kernels run their torch references (bfloat16); the Triton kernels run the same
forwards on CUDA, else under the interpreter in a child pytest (float16; the interpreter has no
bfloat16 arithmetic), where the default forward does not pass this test: its GEMMs of up to 16
rows take SkinnyLinear and larger ones F.linear. Whole engines on a GPU: tests/gpu/test_deterministic_cuda.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.fused_target import FusedTargetRunner
from dflash_serve.services.engine.kv_cache import AttentionBatch, BlockAllocator, KVPool
from dflash_serve.services.engine.loader import target_runner
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.models import TargetModel
from tests.interpreter import use_row_invariant_dot
from tests.targets import gemma4_26b_a4b_twin, gemma4_31b_twin, gemma4_e4b_twin, qwen3_moe_twin, tiny_target
from tests.unit.test_fused_target import _llama_dynamic_rope, kv_pool_for
from tests.unit.test_kernels import DEVICE, ON_CUDA, TRITON_AVAILABLE, TRITON_RUNS_HERE, runs_triton

use_row_invariant_dot()

PAGE = 4
NUM_BLOCKS = 64
# Window slots of the Gemma-4 twin's sliding layers (window 5): fewer than the 17 blocks the three
# sequences end with, so slots are given up behind the windows and taken again.
WINDOW_SLOTS = 12
TARGETS = {family: (lambda family=family: tiny_target(family, layers=2, seed=1)) for family in ("qwen3", "llama", "gemma3")}
TARGETS["gemma4-31b"] = lambda: gemma4_31b_twin(seed=1)
LENGTHS = {"A": 24, "B": 30, "C": 11}
# Forwards of each schedule: (sequence, new tokens) per forward. Each ends with all of A's 24 tokens.
SCHEDULES = {
    "whole-prompt": [[("A", 24)]],
    "chunks-beside-prefills-then-a-verify-block": [[("B", 10), ("A", 16)], [("A", 8), ("C", 11), ("B", 6)]],
    "a-chunk-then-decode-steps-beside-another": [[("A", 16), ("C", 3)]] + [[("C", 1), ("A", 1)]] * 8,
}


def runner_for(family: str, *, deterministic: bool, dtype=torch.bfloat16, device="cpu") -> FusedTargetRunner:
    """A target's fused runner over a pool of its KV layout (sliding layers in window slots, if any)."""
    target = TargetModel(TARGETS[family]().to(dtype).to(device), (0,))
    layout = TargetRunner.kv_layout(target)
    window_slots = WINDOW_SLOTS if KVPool.window_of(layout) is not None else None
    pool = KVPool.allocate_layers(layout, NUM_BLOCKS, PAGE, dtype, device, num_window_slots=window_slots)
    return FusedTargetRunner(target, pool, max_positions=64, deterministic=deterministic)


def allocator_for(pool: KVPool, page: int = PAGE) -> BlockAllocator:
    """A fresh allocator of the pool's blocks, and of its window slots where it has them."""
    if pool.window_map is None:
        return BlockAllocator(pool.num_blocks, page)
    return BlockAllocator(pool.num_blocks, page, window=KVPool.window_of(pool.layout), num_window_slots=WINDOW_SLOTS,
                          window_map=pool.window_map)


def logits_of_a(runner: FusedTargetRunner, schedule, lengths=LENGTHS, *, with_features=False, page=PAGE):
    """A's logits at each of its positions [len(A), V], from the forwards of `schedule` (and with
    `with_features`, A's captured features too). Each forward's sequences take the blocks it writes
    first, and give up the window slots behind their windows after."""
    g = torch.Generator().manual_seed(0)
    device = runner.target.device
    ids = {name: torch.randint(0, 90, (n,), generator=g).to(device) for name, n in lengths.items()}
    allocator = allocator_for(runner.pool, page)
    tables = {name: [] for name in lengths}
    done = dict.fromkeys(lengths, 0)
    rows_of_a, features_of_a = [], []
    for forward in schedule:
        names = [name for name, _ in forward]
        lens = [n for _, n in forward]
        starts = [done[name] for name in names]
        for name, start, n in zip(names, starts, lens, strict=True):
            allocator.grow(tables[name], start + n)
        batch = AttentionBatch.build([tables[name] for name in names], starts, lens, page, device)
        tokens = torch.cat([ids[name][s : s + n] for name, s, n in zip(names, starts, lens, strict=True)])
        positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lens, strict=True)])
        logits, features = runner.forward(tokens, positions, batch, torch.arange(tokens.shape[0], device=device))
        first = sum(lens[: names.index("A")]) if "A" in names else None
        if first is not None:
            rows_of_a.append(logits[first : first + dict(forward)["A"]])
            if with_features:
                features_of_a.append(features[first : first + dict(forward)["A"]])
        for name, n in forward:
            done[name] += n
            allocator.leave_window(tables[name], done[name])
    return (torch.cat(rows_of_a), torch.cat(features_of_a)) if with_features else torch.cat(rows_of_a)


@pytest.mark.parametrize("family", list(TARGETS))
def test_deterministic_forward_gives_a_token_the_same_logits_in_any_batch(family):
    runner = runner_for(family, deterministic=True)
    by_schedule = {name: logits_of_a(runner, schedule) for name, schedule in SCHEDULES.items()}
    for name, logits in by_schedule.items():
        assert torch.equal(logits, by_schedule["whole-prompt"]), name
    # The same model as the default forward: within bfloat16's rounding of it.
    default = logits_of_a(runner_for(family, deterministic=False), SCHEDULES["whole-prompt"]).double()
    error = (by_schedule["whole-prompt"].double() - default).norm() / default.norm()
    assert error < 2e-2


@runs_triton
@pytest.mark.parametrize("family", ["qwen3", "gemma4-31b"])
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if ON_CUDA else []), ids=str)
def test_deterministic_forward_triton_gives_a_token_the_same_logits_in_any_batch(dtype, family):
    runner = runner_for(family, deterministic=True, dtype=dtype, device=DEVICE)
    by_schedule = {name: logits_of_a(runner, schedule) for name, schedule in SCHEDULES.items()}
    for name, logits in by_schedule.items():
        assert torch.equal(logits, by_schedule["whole-prompt"]), name


def test_deterministic_runner_uses_the_invariant_kernels_for_every_gemm():
    runner = runner_for("qwen3", deterministic=True)
    linears = [getattr(layer, name) for layer in runner.stack.layers for name in ("qkv", "o", "gate_up", "down")]
    assert all(type(linear).__name__ == "InvariantLinear" for linear in linears)
    assert type(runner.lm_head).__name__ == "InvariantLinear" and runner.stack.batch_invariant
    default = runner_for("qwen3", deterministic=False)
    assert default.lm_head is None and not default.stack.batch_invariant


def test_deterministic_gemma4_31b_runs_its_kv_groups_derived_keys_and_window_slots_invariantly():
    """What the schedules test's gemma4-31b case goes through: two KV geometries, global layers
    storing values only, sliding layers in window slots, and the batch-invariant attention."""
    runner = runner_for("gemma4-31b", deterministic=True)
    pool = runner.pool
    assert len({group.v.shape[-2:] for group in pool.groups}) == 2 and pool.window_map is not None
    global_layers = [i for i, spec in enumerate(pool.layout) if spec.keys_from_values]
    assert global_layers and all(pool.layer(i)[0] is None for i in global_layers)
    assert all(runner.stack.layers[i].keys_from_values is not None for i in global_layers)
    assert any(pool.windowed(i) for i in range(len(pool.layout))) and runner.stack.batch_invariant


def test_deterministic_refuses_gemma4_per_layer_inputs_naming_the_field():
    """E2B/E4B's per-layer inputs come from the model's own projection and norm, which are not
    batch-invariant: the build stops, saying which config field and which part of the target."""
    target = TargetModel(gemma4_e4b_twin(seed=1))
    pool = KVPool.allocate_layers(TargetRunner.kv_layout(target), 8, PAGE, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"engine.deterministic does not cover Gemma-4's per-layer inputs "
                                         r"\(hidden_size_per_layer_input > 0: E2B, E4B\) yet"):
        target_runner("auto", target, pool, max_positions=64, deterministic=True)
    assert isinstance(target_runner("auto", target, pool, max_positions=64), FusedTargetRunner)


def test_deterministic_needs_the_fused_forward():
    with pytest.raises(ValueError, match="deterministic=true needs the fused target forward"):
        EngineConfig(target="tiny", deterministic=True, target_impl="transformers")
    unfused = TargetModel(_llama_dynamic_rope())  # dynamic RoPE has no fused forward
    with pytest.raises(ValueError, match="deterministic=true: LlamaForCausalLM has no fused forward"):
        target_runner("auto", unfused, kv_pool_for(unfused), max_positions=64, deterministic=True)


@pytest.mark.parametrize("twin", [gemma4_26b_a4b_twin, qwen3_moe_twin], ids=["gemma4-26b-a4b", "qwen3-moe"])
def test_deterministic_refuses_mixture_of_experts_blocks(twin):
    """An expert's GEMM takes the rows routed to it, which depend on the whole batch: the build
    stops, saying so; without the mode the same target is fused."""
    target = TargetModel(twin())
    with pytest.raises(ValueError, match=r"engine.deterministic does not cover mixture-of-experts blocks"):
        target_runner("auto", target, kv_pool_for(target), max_positions=64, deterministic=True)
    assert isinstance(target_runner("auto", target, kv_pool_for(target), max_positions=64), FusedTargetRunner)


@pytest.mark.skipif(ON_CUDA or TRITON_RUNS_HERE or not TRITON_AVAILABLE,
                    reason="the Triton tests run in this process (CUDA or TRITON_INTERPRET=1), or triton is absent")
def test_interpreted_deterministic_forward_in_a_child_pytest():
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
