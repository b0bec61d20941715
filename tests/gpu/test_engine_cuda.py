"""The engine on CUDA: Triton kernels, CUDA graphs and the paged drafter, still lossless.

Skipped without CUDA (CI); run on the GPU test machine.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.cuda_graphs import InjectionGraphs
from dflash_serve.services.engine.draft_runner import DraftRunner
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool
from dflash_serve.services.engine.loader import assemble_engine
from dflash_serve.services.engine.prefill_graphs import PrefillChunkView
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.models import TargetModel
from tests.conftest import drafter_config, random_drafter
from tests.engine.harness import assert_draft_context_is_committed_rows, assert_prefill_paths_agree, hf_greedy
from tests.targets import tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V, B = 96, 6


def _engine(target_model, drafter, *, graphs: bool, max_num_seqs=4, target_impl="auto", async_scheduling=True,
            speculation="fixed", spec_table=None, defer_warm_up=False, round_costs_dir=None):
    """Every draft verified unless a test asks for the adaptive policy or a static table."""
    target = TargetModel(target_model, drafter.config.target_layer_ids if drafter is not None else ())
    config = EngineConfig(target="tiny", device="cuda", kv_block_size=16, num_kv_blocks=128,
                          max_num_seqs=max_num_seqs, cuda_graphs=graphs, target_impl=target_impl,
                          async_scheduling=async_scheduling, speculation=speculation,
                          num_speculative_tokens_per_batch_size=spec_table or {}, round_costs_dir=round_costs_dir)
    return assemble_engine(config, target, drafter, defer_warm_up=defer_warm_up)


def _tiny_pair():
    """The suite's pair on the GPU in float32: a 4-layer target and a random 2-layer drafter of
    its layers 0 and 2."""
    model = tiny_target("qwen3", layers=4, vocab=V, seed=7).float().cuda()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    drafter = random_drafter(cfg, seed=3, dtype=torch.float32).cuda()
    return model, drafter


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["chained", "synced"])
@pytest.mark.parametrize("target_impl", ["fused", "transformers"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_cuda_engine_equals_plain_greedy(graphs, with_drafter, target_impl, async_scheduling):
    model = tiny_target("qwen3", layers=4, vocab=V, seed=7).float().cuda()
    drafter = None
    if with_drafter:
        cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                             layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
        drafter = random_drafter(cfg, seed=3, dtype=torch.float32).cuda()
    engine = _engine(model, drafter, graphs=graphs, target_impl=target_impl, async_scheduling=async_scheduling)
    assert (engine.graphs is not None) == graphs and engine.chain_rounds == async_scheduling
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]  # 3 sequences: a padded bucket of 4
    chained = []
    launch = engine._launch_round
    engine._launch_round = lambda seqs, previous=None, *rest: chained.append(previous is not None) or launch(seqs, previous, *rest)
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    assert any(chained) == async_scheduling
    with torch.no_grad():
        for prompt, seq in zip(prompts, done, strict=True):
            assert seq.output_ids == hf_greedy(model, prompt, 40)
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("target_impl", ["fused", "transformers"])
def test_prefill_graph_replays_equal_the_eager_prefill(target_impl):
    """A step's prefill replayed from its captured (tokens, chunks) bucket: the same logits,
    features, target K/V and drafter context as the eager forward (float32), for one prompt,
    several (padded to a bucket of chunks), and a chunk starting past a cached prefix."""
    model = tiny_target("qwen3", layers=4, vocab=V, seed=11).float().cuda()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    drafter = random_drafter(cfg, seed=3, dtype=torch.float32).cuda()
    engine = _engine(model, drafter, graphs=True, target_impl=target_impl)
    assert engine.prefill_graphs is not None and engine.prefill_graphs.injects_for(engine.proposer)
    for prompts in ([list(range(3, 40))], [[1, 2, 3], list(range(5, 75)), [7] * 9]):
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4)) for p in prompts]
        plan = engine.scheduler.schedule()
        assert len(plan.prefills) == len(prompts) and not plan.decodes
        assert_prefill_paths_agree(engine, plan.prefills, rtol=1e-4)
        for c in plan.prefills:
            c.seq.num_cached = c.start + c.length
            engine.scheduler.offer_committed_blocks(c.seq)
        for rid in ids:
            engine.cancel(rid)
    # The first prompt again, with more: its first two blocks come from the prefix cache.
    engine.add_request(list(range(3, 40)) + [9, 9], SamplingParams(temperature=0.0, max_tokens=4))
    plan = engine.scheduler.schedule()
    assert plan.prefills[0].start == 32
    assert_prefill_paths_agree(engine, plan.prefills, rtol=1e-4)


def test_cuda_graph_spec_sampling_reproduces_target_only():
    model = tiny_target("llama", layers=3, vocab=V, seed=1).float().cuda()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=3, num_hidden_layers=1,
                         layer_types=["full_attention"], dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1]})
    drafter = random_drafter(cfg, seed=5, dtype=torch.float32).cuda()
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, seed=s) for s in range(3)]
    prompts = [[4, 5, 6], [9, 9], list(range(20))]
    spec = [s.output_ids for s in _engine(model, drafter, graphs=True).generate(prompts, params)]
    plain = [s.output_ids for s in _engine(model, None, graphs=True).generate(prompts, params)]
    assert spec == plain


def test_bf16_gemma_style_drafter_runs_and_stays_lossless_in_float32_target():
    """Sliding-window causal draft layers through the Triton kernel with CUDA graphs."""
    model = tiny_target("qwen3", layers=6, vocab=V, seed=2).float().cuda()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=6, num_hidden_layers=3, sliding_window=8,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1, 3, 4]})
    drafter = random_drafter(cfg, seed=9, dtype=torch.float32).cuda()
    engine = _engine(model, drafter, graphs=True)
    prompts = [list(range(30)), [3, 1, 4, 1, 5]]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=50))
    with torch.no_grad():
        for prompt, seq in zip(prompts, done, strict=True):
            assert seq.output_ids == hf_greedy(model, prompt, 50)


@pytest.mark.parametrize("spec_table", [None, {1: 3}, {1: 0}], ids=["all-drafts", "k3", "k0"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("graphs", [False, True])
def test_split_drafter_over_cuda_ipc_matches_the_colocated_engine(graphs, tied, spec_table, tmp_path):
    """The drafter in a process of its own maps the verifier's feature ring, embedding and LM head
    (one buffer when tied) by CUDA IPC, and writes its drafts into the verifier's buffer; with
    graphs the verify replays a graph that copies them in on the device (the first k of them; k 0:
    no draft request, the rows still reach the drafter)."""
    from dflash_serve.services.drafter.server import spawn_drafter_process
    from dflash_serve.services.models import save_drafter
    from dflash_serve.services.verifier.remote_drafter import RemoteProposer

    model = tiny_target("qwen3", layers=4, vocab=V, seed=7).float().cuda()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    drafter = random_drafter(cfg, seed=3, dtype=torch.float32).cuda()
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    colocated = _engine(model, drafter, graphs=graphs, spec_table=spec_table).generate(prompts, params)

    save_drafter(drafter, tmp_path / "drafter")
    process, address = spawn_drafter_process(str(tmp_path / "drafter"), device="cuda", dtype="float32")
    target = TargetModel(model, drafter.config.target_layer_ids)
    config = EngineConfig(target="tiny", device="cuda", kv_block_size=16, num_kv_blocks=128, max_num_seqs=4,
                          cuda_graphs=graphs, speculation="fixed", num_speculative_tokens_per_batch_size=spec_table or {})
    engine = assemble_engine(config, target, None, remote_drafter=drafter.config)
    shared = []
    proposer = RemoteProposer.connect(address, target=target, block_size=B, kv_block_size=16,
                                      num_kv_blocks=engine.runner.pool.num_blocks, capacity_rows=256, max_num_seqs=4, shared=shared,
                                      graphs=engine.graphs)
    engine.attach_proposer(proposer)
    assert (engine.graphs is not None and engine.graphs.fits(proposer, B)) == graphs
    verified = []
    verify = engine.graphs.verify if graphs else None
    if graphs:
        engine.graphs.verify = lambda bucket, k: verified.append(k) or verify(bucket, k)
    split = engine.generate(prompts, params)
    assert not graphs or set(verified) == {3 if spec_table == {1: 3} else 0 if spec_table else B - 1}
    for a, b in zip(colocated, split, strict=True):
        assert b.output_ids == a.output_ids
        assert b.stats.accepted_per_position == a.stats.accepted_per_position
    assert engine.allocator.num_free == engine.allocator.num_blocks
    proposer.release()
    process.terminate()
    for buffer in shared:
        buffer.close()


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])  # 40: more than the largest bucket, eager
def test_injection_graphs_write_what_the_eager_injection_writes(rows):
    model, drafter = _tiny_pair()
    target = TargetModel(model, drafter.config.target_layer_ids)
    layers, heads, dim = DraftRunner.kv_shape(drafter.config)
    pools = [KVPool.allocate(layers, 16, 16, heads, dim, torch.float32, "cuda") for _ in range(2)]
    eager, graphed = (DraftRunner(drafter, target, pool, max_positions=16 * 16) for pool in pools)
    scratch_block = 15
    graphs = InjectionGraphs(graphed, 2 * 32, torch.float32, scratch_slot=scratch_block * 16, buckets=(16, 32))
    generator = torch.Generator().manual_seed(rows)
    written = set()
    for round_ in range(3):  # rounds of different sizes reuse the static buffers
        count = max(1, rows - round_)
        features = torch.randn(count, 2 * 32, generator=generator).cuda()
        positions = torch.randperm(200, generator=generator)[:count]
        slots = torch.randperm(15 * 16, generator=generator)[:count]  # never the scratch block
        eager.inject_context(features, positions.cuda(), slots.cuda())
        graphs.inject(features, positions.tolist(), slots.tolist())
        written.update(slots.tolist())
    torch.cuda.synchronize()
    # Only the written slots: a pool is not zeroed at allocation, so the others hold whatever was there.
    rows_written = torch.tensor(sorted(written), device="cuda")
    for eager_cache, graph_cache in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v)):
        torch.testing.assert_close(graph_cache.flatten(1, 2)[:, rows_written], eager_cache.flatten(1, 2)[:, rows_written])


def _runner_outputs(model, runner_class) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, features) of a prefill of mixed lengths (300 and 37 tokens), then of a verify block each."""
    target = TargetModel(model, (0, 2))
    dtype = next(model.parameters()).dtype
    pool = KVPool.allocate_layers(TargetRunner.kv_layout(target), 64, 16, dtype, "cuda")
    runner = runner_class(target, pool, max_positions=4096)
    g = torch.Generator().manual_seed(1)
    tables = [list(range(0, 20)), list(range(20, 40))]
    starts, results = [0, 0], []
    for lens in ([300, 37], [16, 16]):
        ids = torch.randint(0, 500, (sum(lens),), generator=g).cuda()
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]).cuda()
        batch = AttentionBatch.build(tables, starts, lens, 16, "cuda")
        results.append(runner.forward(ids, positions, batch, torch.arange(sum(lens), device="cuda")))
        starts = [s + n for s, n in zip(starts, lens, strict=True)]
    target.close()
    return results


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _fused_equals_transformers_in_bf16(model, name: str) -> None:
    """Both runners over a prefill of mixed lengths (300 and 37 tokens), then a verify block each."""
    from dflash_serve.services.engine.fused_target import FusedTargetRunner

    for ref, got in zip(_runner_outputs(model, TargetRunner), _runner_outputs(model, FusedTargetRunner), strict=True):
        for tensor, ref_tensor in zip(got, ref, strict=True):
            err = _relative_error(tensor, ref_tensor)
            assert err < 2e-2, (name, err)


def _fused_as_near_float64_as_transformers_in_bf16(model, name: str) -> None:
    """For MoE routers in bf16: their logits meet exact ties at the k-th expert, which transformers
    breaks by `torch.topk`'s unspecified order and the fused routing by the lower index, so the two
    runners pick other experts for a few tokens. Both are measured against the same weights in
    float64 (transformers' eager experts), and the fused path is no further from it."""
    from dflash_serve.services.engine.fused_target import FusedTargetRunner

    truth_model = copy.deepcopy(model).double()
    truth_model.set_experts_implementation("eager")  # grouped_mm has no float64
    truth = _runner_outputs(truth_model, TargetRunner)
    del truth_model
    transformers_bf16 = _runner_outputs(model, TargetRunner)
    fused_bf16 = _runner_outputs(model, FusedTargetRunner)
    for exact, ref, got in zip(truth, transformers_bf16, fused_bf16, strict=True):
        for tensor, ref_tensor, exact_tensor in zip(got, ref, exact, strict=True):
            fused_err, transformers_err = _relative_error(tensor, exact_tensor), _relative_error(ref_tensor, exact_tensor)
            assert fused_err <= 1.1 * transformers_err + 1e-3, (name, fused_err, transformers_err)


def _gemma4_scores_of_order_one(model) -> None:
    """Gemma-4 attends with scaling 1: a trained checkpoint's q/k norms keep q·k of order one.
    Random norm weights near 1 give scores of spread ~20 over heads of 256 and 512, an argmax that
    any bf16 rounding flips (each runner then lies 1.1 from float64); scaled by head_dim**-0.25,
    each lies within 3e-2 of it (measured on the CPU)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            for norm in (attention.q_norm, getattr(attention, "k_norm", None)):
                if norm is not None:
                    norm.weight.mul_(attention.head_dim**-0.25)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_forward_in_bf16_at_a_real_head_size_matches_transformers(family):
    """The Triton path of every fused kernel (CPU runs cover the interpreter in float32 only)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = kinds[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=4096)).to(torch.bfloat16).cuda().eval()
    _fused_equals_transformers_in_bf16(model, family)


def test_fused_gemma3_forward_in_bf16_matches_transformers():
    """Gemma-3's fused layers on the GPU: sandwich norms (random weights, so `1 + w` matters), GELU-tanh,
    sliding layers (a 128-token window inside the 300-token prefill) and global layers with linearly
    scaled RoPE, each on its own table, and the final logit softcap."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, query_pre_attn_scalar=96, max_position_embeddings=4096,
        sliding_window=128, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    _fused_equals_transformers_in_bf16(model.to(torch.bfloat16).cuda().eval(), "gemma3")


@pytest.mark.parametrize("shape", ["31B", "E4B"])
def test_fused_gemma4_forward_in_bf16_at_its_real_head_sizes_matches_transformers(shape):
    """Gemma-4's text decoder at the real head sizes: sliding layers of head 256, global layers of
    head 512 (31B: one KV head, k_eq_v; E4B: per-layer inputs and KV-shared layers), a 128-token
    window inside the 300-token prefill, random norms and layer scalars."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    layer_types = ["sliding_attention", "full_attention"] * 3
    extra = (dict(num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0)
             if shape == "31B" else
             dict(hidden_size_per_layer_input=64, vocab_size_per_layer_input=512, num_kv_shared_layers=2,
                  use_double_wide_mlp=True))
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, max_position_embeddings=4096,
        sliding_window=128, final_logit_softcapping=30.0, layer_types=layer_types, **extra))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    _gemma4_scores_of_order_one(model)
    _fused_equals_transformers_in_bf16(model.to(torch.bfloat16).cuda().eval(), f"gemma4 {shape}")


@pytest.mark.parametrize("family", ["gemma4-26b-a4b", "qwen3-moe"])
def test_fused_moe_forward_in_bf16_matches_transformers(family):
    """The MoE blocks' CUDA path (routing on the device, both expert GEMMs as grouped_mm) against
    transformers' experts in bf16: Gemma-4's experts beside the dense MLP (heads 256/512, k_eq_v)
    and Qwen3-MoE's sparse layers (a dense first layer), 16 experts routed top-4, random routers
    and expert scales so that each token's experts are clearly apart."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=512, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=4096)
    if family == "gemma4-26b-a4b":
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            **common, intermediate_size=384, num_key_value_heads=2, head_dim=256, global_head_dim=512,
            num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=128,
            final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"] * 2,
            enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=256))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, intermediate_size=1024, num_key_value_heads=2, head_dim=128, num_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[0]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
            elif "router.scale" in name or "per_expert_scale" in name:
                param.uniform_(0.5, 1.5)
            elif "router.proj" in name or "mlp.gate.weight" in name:
                param.normal_(0.0, 1.0)
    if family == "gemma4-26b-a4b":
        _gemma4_scores_of_order_one(model)
        _fused_as_near_float64_as_transformers_in_bf16(model.to(torch.bfloat16).cuda().eval(), family)
    else:
        _fused_equals_transformers_in_bf16(model.to(torch.bfloat16).cuda().eval(), family)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["chained", "synced"])
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_prefix_cache_hits_with_graphs_and_chained_rounds_stay_lossless(graphs, async_scheduling):
    """A shared opening and a second turn hit the prefix cache while other requests decode (CUDA
    graphs replaying rounds over shared blocks, chained rounds writing two blocks ahead)."""
    model, drafter = _tiny_pair()
    engine = _engine(model, drafter, graphs=graphs, async_scheduling=async_scheduling)
    opening = list(range(3, 40))  # 2 full blocks of 16
    first = engine.generate([opening + [50, 51]], SamplingParams(temperature=0.0, max_tokens=30))[0]
    prompts = [opening + [60, 61, 62], opening + [50, 51] + first.output_ids + [70], [9, 8, 7]]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
    with torch.no_grad():
        for prompt, seq in zip(prompts, done, strict=True):
            assert seq.output_ids == hf_greedy(model, prompt, 30)
    assert engine.scheduler.prefix_cache_hits == 32 + 64  # the opening; the first conversation
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["chained", "synced"])
def test_cuda_graphs_per_k_bucket_stay_lossless(async_scheduling):
    """Verify and injection graphs per k bucket (0, 1, 3, B−1 and the table's 2): rounds of every
    k, changing every round (chained rounds too), replay them — and the adaptive policy on costs
    measured by replaying them — with greedy and seeded requests in one padded batch: the same
    output as target-only decoding."""
    model, drafter = _tiny_pair()
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]  # 3 sequences: a padded bucket of 4
    params = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=1.0, seed=5, max_tokens=40),
              SamplingParams(temperature=0.7, top_k=8, seed=6, max_tokens=40)]
    reference = [s.output_ids for s in _engine(model, None, graphs=True).generate(prompts, params)]
    with torch.no_grad():
        assert reference[0] == hf_greedy(model, prompts[0], 40)

    engine = _engine(model, drafter, graphs=True, async_scheduling=async_scheduling, speculation="adaptive",
                     spec_table={8: 2})  # batches of 8 or more only: the policy decides below
    graphs = engine.graphs
    assert graphs.k_buckets == engine.speculation.ks == (0, 1, 2, 3, B - 1)
    costs = engine.speculation.costs  # measured by replaying the graphs
    assert costs.batch_sizes == [1, 2, 4] and costs.ks == graphs.k_buckets and costs.measured_draft
    replayed = []
    verify = graphs.verify
    graphs.verify = lambda bucket, k: replayed.append(k) or verify(bucket, k)
    order = iter([3, 0, B - 1, 1, 2, 0, 0, B - 1] * 100)
    adaptive = engine.speculation.choose
    engine.speculation.choose = lambda caps, context: next(order)
    launched = []
    launch = engine._launch_round
    engine._launch_round = lambda seqs, previous=None, *rest: launched.append(previous is not None) or launch(seqs, previous, *rest)
    done = engine.generate(prompts, params)
    assert [s.output_ids for s in done] == reference
    assert set(replayed) == set(graphs.k_buckets)  # every round replayed a graph, of every k
    assert len(replayed) == len(launched) and any(launched) == async_scheduling
    assert engine.allocator.num_free == engine.allocator.num_blocks

    engine.speculation.choose = adaptive
    replayed.clear()
    done = engine.generate(prompts, params)
    assert [s.output_ids for s in done] == reference
    assert replayed and set(replayed) <= set(graphs.k_buckets)
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["chained", "synced"])
def test_the_round_graphs_keep_the_drafters_context_exact_for_every_k(async_scheduling):
    """Each round's injection graph puts the verify graph's rows into the drafter's context:
    rounds forced to every k, with runs of AR steps between drafting rounds, greedy and seeded
    requests in one padded batch. After every step the drafter's context of every running
    sequence equals a dense recomputation from its committed tokens, and the outputs equal
    target-only decoding."""
    model, drafter = _tiny_pair()
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]  # 3 sequences: a padded bucket of 4
    params = [SamplingParams(temperature=0.0, max_tokens=60), SamplingParams(temperature=1.0, seed=5, max_tokens=60),
              SamplingParams(temperature=0.0, max_tokens=45)]
    reference = [s.output_ids for s in _engine(model, None, graphs=True).generate(prompts, params)]
    engine = _engine(model, drafter, graphs=True, async_scheduling=async_scheduling, speculation="adaptive")
    assert not engine.defer_context and set(engine.graphs.k_buckets) >= {0, 1, 3, B - 1}
    order = itertools.chain([0] * 12, itertools.cycle([B - 1, 0, 0, 0, 1, 0, 0, 3]))
    engine.speculation.choose = lambda caps, context: next(order)
    replayed = []
    verify = engine.graphs.verify
    engine.graphs.verify = lambda bucket, k: replayed.append(k) or verify(bucket, k)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_cached and not seq.is_prefilling:
                assert_draft_context_is_committed_rows(engine.proposer, seq, engine.allocator.block_size, tol=1e-3)
                checked += 1
    assert checked > 40 and {0, 1, 3, B - 1} <= set(replayed)
    assert [engine.sequences.pop(i).output_ids for i in ids] == reference
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["chained", "synced"])
def test_accept_graphs_sample_and_accept_as_the_eager_round(async_scheduling):
    """Rounds of every k whose batch samples without truncation (all greedy, or greedy and seeded
    requests mixed) sample and accept in the bucket's accept graphs, chained rounds reading the
    graphs' next bonus tokens and starts; a batch that truncates (top-k) samples eagerly, and so do
    rounds that verify more drafts than a request's limit. Every output equals the eager target's."""
    model, drafter = _tiny_pair()
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]  # 3 sequences: a padded bucket of 4
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in (5, 6)]
    batches = {
        "greedy": [greedy] * 3,
        "mixed": [greedy, *seeded],
        "top_k": [dataclasses.replace(p, top_k=8) for p in [*seeded, seeded[0]]],
        "limited": [dataclasses.replace(p, num_speculative_tokens=1) for p in [greedy, *seeded]],
    }
    eager = _engine(model, None, graphs=False)
    engine = _engine(model, drafter, graphs=True, async_scheduling=async_scheduling, speculation="adaptive")
    graphs = engine.graphs
    order = iter([3, 0, B - 1, 1, 0, 0, B - 1] * 1000)
    engine.speculation.choose = lambda caps, context: next(order)
    accepted, launched = [], []
    accept = graphs.accept
    graphs.accept = lambda bucket, k, sampling, n: accepted.append((k, sampling.all_greedy)) or accept(
        bucket, k, sampling, n)
    launch = engine._launch_round
    engine._launch_round = lambda seqs, previous=None, *rest: launched.append(previous is not None) or launch(
        seqs, previous, *rest)
    for name, params in batches.items():
        accepted.clear(), launched.clear()
        reference = [s.output_ids for s in eager.generate(prompts, params)]
        assert [s.output_ids for s in engine.generate(prompts, params)] == reference, name
        assert any(launched) == async_scheduling
        ks = {k for k, _ in accepted}
        if name in ("greedy", "mixed"):  # every round, of every k
            assert len(accepted) == len(launched) and ks == set(graphs.k_buckets), name
            assert (name == "greedy") == all(g for _, g in accepted)
        elif name == "limited":  # the rounds of k <= 1 only
            assert ks == {0, 1} and 0 < len(accepted) < len(launched)
        else:
            assert not accepted, name
        assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["chained", "synced"])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_graphs_captured_between_steps_stay_lossless(with_drafter, async_scheduling):
    """A serving engine's graphs deferred (`defer_warm_up`) and captured one bucket after each step
    while two requests decode: the first round runs eagerly, the next ones in the bucket of 4 (the
    largest, captured first), then in their own of 2 — the same greedy tokens."""
    model, drafter = _tiny_pair()
    engine = _engine(model, drafter if with_drafter else None, graphs=True, async_scheduling=async_scheduling,
                     defer_warm_up=True)
    graphs, prefill = engine.graphs, engine.prefill_graphs
    assert engine.graphs_pending and not graphs.holds(1) and not prefill.fits(1, 3, engine.proposer)
    rounds = []  # each round's bucket size, None: eager
    round_inputs = engine._round_inputs

    def recording_round_inputs(*args):
        inputs = round_inputs(*args)
        rounds.append(None if inputs.bucket is None else inputs.bucket.size)
        return inputs

    engine._round_inputs = recording_round_inputs
    prompts = [[1, 2, 3], list(range(5, 40))]
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=60)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        if rounds and engine.graphs_pending:  # the first round runs before any capture
            engine.capture_next_graph()
    assert not engine.graphs_pending and prefill.fits(1, 3, engine.proposer)
    assert rounds[0] is None and rounds.index(4) < rounds.index(2), rounds
    with torch.no_grad():
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert engine.sequences[request_id].output_ids == hf_greedy(model, prompt, 60)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_prefill_graph_captured_late_writes_no_running_sequences_kv():
    """A prefill bucket captured while a request runs: its warm-up forward runs over the static
    buffers, which a served prefill leaves naming real KV slots (maybe another sequence's by
    then). Here they name the running sequence's first block, with other tokens: the capture
    must leave that block alone — the same greedy tokens."""
    model, drafter = _tiny_pair()
    engine = _engine(model, drafter, graphs=True, defer_warm_up=True)
    while not engine.graphs.complete:
        engine.capture_next_graph()
    prompt = list(range(5, 40))
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40))
    engine.step()  # its prefill, eager: no prefill bucket is captured yet
    prefill, seq = engine.prefill_graphs, engine.sequences[request]
    tokens, chunks = prefill._to_capture[0]
    prefill._stage([PrefillChunkView([7] * 16, 0, seq.block_table)], [0], tokens, chunks)
    engine.capture_next_graph()
    assert prefill.fits(chunks, tokens, engine.proposer)
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        assert engine.sequences[request].output_ids == hf_greedy(model, prompt, 40)


def test_costs_measured_at_a_start_are_timed_on_the_deferred_graphs_once_captured(tmp_path):
    """With no costs kept from an earlier start, a deferred engine serves target-only and times the
    adaptive policy's costs between steps on the graphs the rounds will replay, after capturing
    them (`warm_up_next`); then its drafter is attached. A later start loads them and attaches it
    at once, its graphs still to capture."""
    model, drafter = _tiny_pair()
    engine = _engine(model, drafter, graphs=True, speculation="adaptive", defer_warm_up=True,
                     round_costs_dir=str(tmp_path))
    assert engine.graphs_pending and engine.measuring_costs and engine.proposer is None
    while engine.warming_up:
        engine.warm_up_next()
    assert engine.proposer is not None and engine.speculation.costs.batch_sizes == [1, 2, 4]
    again = _engine(model, drafter, graphs=True, speculation="adaptive", defer_warm_up=True,
                    round_costs_dir=str(tmp_path))
    assert again.graphs_pending and again.proposer is not None and again.speculation.costs is not None
