"""`engine.deterministic` on CUDA in bfloat16 (issue 62): the pair's greedy output equals the target's
alone at batch 1, token for token, and a seeded request's tokens do not depend on the batch.

Without the mode this fails in bf16: cuBLAS picks other kernels for other row counts, and AR at
batch 8 already differs from AR at batch 1 at near-ties. Each engine here runs with CUDA graphs,
chained rounds and prefix caching on (the defaults); the target-only reference runs one request at
a time. The kernels are checked first at real shapes (Qwen3-8B's GEMMs, its attention heads over
contexts of several chunks).

Skipped without CUDA (CI). The default pair's tests also need the converted default target in
the model cache (`dflash fetch-default`) and the bench prompts (../shared/bench-data); each is
skipped, saying which is missing, without them.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dflash_serve.kernels import InvariantLinear
from dflash_serve.kernels.invariant_attention import paged_attention_invariant_triton
from dflash_serve.kernels.invariant_linear import InvariantSettings
from dflash_serve.services.bench.spec_engine import QWEN3_8B, build_models
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import assemble_engine, build_engine
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models import TargetModel
from dflash_serve.services.models.default_pair import DEFAULT_DRAFTER_DIR, SOURCE_FILE, target_dir
from dflash_serve.kernels.rope_kv_write import rope_kv_write_triton
from tests.bench_data import REAL_DATA_DIR
from tests.unit.test_batch_invariant_kernels import (
    Sequences,
    assert_a_rows_agree_across_calls,
    assert_rows_have_the_same_bits,
)
from tests.unit.test_kernels import rope_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUM_PROMPTS, NEW_TOKENS = 64, 128
PAIR_BATCHES = (8, 32)
SPECULATION = ("fixed", "adaptive")


# -- the kernels at real shapes -------------------------------------------------------------------

QWEN3_8B_GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                  "lm_head": (151936, 4096)}


@pytest.mark.parametrize("name", QWEN3_8B_GEMMS)
def test_invariant_linear_gives_a_row_the_same_bits_in_any_batch_at_qwen3_8b_shapes(name):
    n, k = QWEN3_8B_GEMMS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(512, k, generator=g, device="cuda", dtype=torch.bfloat16)
    layer = InvariantLinear(weight)
    assert layer.settings == InvariantSettings.for_shape(n, k)
    assert_rows_have_the_same_bits(layer, x)
    expected = x.float() @ weight.float().t()
    assert ((layer(x).float() - expected).norm() / expected.norm()).item() < 1e-2


# A's context spans six chunks of 512 keys; B's and C's calls widen the block tables and the batch.
LONG_CONTEXTS = {"A": 3000, "B": 700, "C": 4600}
LONG_CALLS = {
    "decode-alone": [("A", 1)],
    "decode-beside-others": [("C", 1), ("A", 1), ("B", 1)],
    "verify-alone": [("A", 16)],
    "verify-beside-others": [("B", 16), ("A", 16), ("C", 5)],
    "prefill-chunk": [("A", 512)],
    "prefill-chunk-beside-a-verify": [("C", 16), ("A", 1000)],
}


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_invariant_attention_gives_a_row_the_same_bits_in_decode_verify_and_prefill_at_a_real_head_shape(num_splits):
    """Qwen3-8B's heads (32 query heads over 8 KV heads of 128), bf16; the split chosen by the
    shapes (decode and verify of a few sequences take the split path), or forced."""
    sequences = Sequences(torch.bfloat16, "cuda", lengths=LONG_CONTEXTS, num_kv_heads=8, group=4, head_dim=128)

    def attend(*inputs, **options):
        return paged_attention_invariant_triton(*inputs, **options, num_splits=num_splits)

    assert_a_rows_agree_across_calls(attend, sequences, dict(scale=128**-0.5, causal=True, window=None), LONG_CALLS)


@pytest.mark.parametrize("norms", ["qwen3", "gemma4"])
def test_rope_kv_write_gives_a_token_the_same_bits_in_any_batch_at_a_real_head_shape(norms):
    """Qwen3-8B's heads with their q/k norms (the norm's sum is the one reduction in the kernel):
    each of 64 tokens' query, cached key and value are the same bits written alone (a decode
    step), among 16 and among 512 tokens. Without `batch_invariant` fewer than 8 tokens take a
    program per head, another layout of the sum, and 1 in 80 tokens' queries came out a bit off."""
    heads, kv_heads, head_dim = 32, 8, 128
    case = rope_case(tokens=512, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                     dtype=torch.bfloat16, qk_norm=True)
    qkv, positions, cos, sin, slots, k_cache, v_cache, weights = (
        [w.cuda() for w in t] if isinstance(t, list) else t.cuda() for t in case)
    q_norm, k_norm = (w.float() for w in weights) if norms == "gemma4" else weights
    flat = lambda cache: cache.view(-1, kv_heads, head_dim)  # noqa: E731

    def write(begin: int, tokens: int):
        """The queries, keys and values of tokens [begin, begin + tokens) written by one call."""
        keys, values = k_cache.clone(), v_cache.clone()
        part = slice(begin, begin + tokens)
        q = rope_kv_write_triton(qkv[part], positions[part], cos, sin, slots[part], keys, values,
                                 num_heads=heads, num_kv_heads=kv_heads, q_norm_weight=q_norm, k_norm_weight=k_norm,
                                 eps=1e-6, scale_in_float32=norms == "gemma4", v_norm=norms == "gemma4",
                                 batch_invariant=True)
        return q, flat(keys)[slots[part]], flat(values)[slots[part]]

    alone = [write(token, 1) for token in range(64)]
    for size in (16, 512):
        batched = write(0, size)
        for token in range(min(size, 64)):
            assert all(torch.equal(a[0], b[token]) for a, b in zip(alone[token], batched, strict=True)), \
                f"token {token} of {size}"


# The fused forward at Qwen3-8B's shapes (two of its layers, every layer's residual captured), over
# the engine's 16-token pages: A's 80 tokens whole, in chunks beside other prefills and a verify
# block, and by decode steps alone or beside another sequence's.
QWEN3_8B_LENGTHS = {"A": 80, "B": 56, "C": 37}
QWEN3_8B_SCHEDULES = {
    "whole-prompt": [[("A", 80)]],
    "chunks-beside-prefills-then-a-verify-block": [[("B", 40), ("A", 64)], [("A", 16), ("C", 30), ("B", 16)]],
    "a-chunk-then-decode-steps-alone": [[("A", 48)]] + [[("A", 1)]] * 32,
    "a-chunk-then-decode-steps-beside-another": [[("A", 48), ("C", 5)]] + [[("C", 1), ("A", 1)]] * 32,
}


def test_fused_forward_gives_a_token_the_same_bits_in_any_batch_at_qwen3_8b_shapes():
    """Names the first schedule, position and layer whose residual differs from the whole prompt's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_serve.services.engine.fused_target import FusedTargetRunner
    from dflash_serve.services.engine.kv_cache import KVPool
    from dflash_serve.services.engine.target_runner import TargetRunner
    from tests.unit.test_deterministic_forward import logits_of_a

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": 2})).to(torch.bfloat16).eval()
    target = TargetModel(model, (0, 1))
    pool = KVPool.allocate_layers(TargetRunner.kv_layout(target), 16, 16, torch.bfloat16, "cuda")
    runner = FusedTargetRunner(target, pool, max_positions=128, deterministic=True)
    runs = {name: logits_of_a(runner, schedule, QWEN3_8B_LENGTHS, with_features=True, page=16)
            for name, schedule in QWEN3_8B_SCHEDULES.items()}
    want_logits, want_features = runs["whole-prompt"]
    hidden = QWEN3_8B["hidden_size"]
    for name, (logits, features) in runs.items():
        if torch.equal(logits, want_logits) and torch.equal(features, want_features):
            continue
        position = next(i for i in range(logits.shape[0])
                        if not (torch.equal(logits[i], want_logits[i]) and torch.equal(features[i], want_features[i])))
        layers = [k for k in range(2) if not torch.equal(features[position, k * hidden:(k + 1) * hidden],
                                                         want_features[position, k * hidden:(k + 1) * hidden])]
        pytest.fail(f"{name}: A's token {position} differs from the whole prompt's; residual after layer(s) "
                    f"{layers} differ{'s' if len(layers) == 1 else ''} (none: the final norm or the LM head)")


# -- engines --------------------------------------------------------------------------------------


def engine_config(**overrides) -> EngineConfig:
    """bf16 on CUDA, deterministic, with every other default (CUDA graphs, chained rounds, prefix
    caching); round costs measured afresh (the adaptive policy's)."""
    values = dict(device="cuda", dtype="bfloat16", deterministic=True, round_costs_dir="")
    return EngineConfig(**{**values, **overrides})


def run_engine(build, prompts: list[list[int]], params, **config) -> list[list[int]]:
    """Every request's output tokens from the engine `build(engine_config(**config))`, which is
    then freed (its target's capture hooks removed: the random pair's HF model outlives it)."""
    engine = build(engine_config(**config))
    try:
        return [seq.output_ids for seq in engine.generate(prompts, params)]
    finally:
        engine.runner.target.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def first_difference(got: list[list[int]], expected: list[list[int]]) -> str:
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"prompt {i}: the first of {len(b)} output tokens that differs is token {at}"
    return ""


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def seeded_request_alone_and_in_a_batch_of_16(build_pair, prompts, **config) -> None:
    """A seeded T 1 request (untruncated, then with top-p) gives the same tokens alone and among 15
    others: greedy ones, other seeds and temperatures, top-k and top-p."""
    others = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
              SamplingParams(temperature=0.7, seed=11, max_tokens=NEW_TOKENS),
              SamplingParams(temperature=1.0, top_k=40, seed=12, max_tokens=NEW_TOKENS),
              SamplingParams(temperature=1.2, top_p=0.8, seed=13, max_tokens=NEW_TOKENS // 2)]
    crowd = [others[i % len(others)] for i in range(15)]
    for request in (SamplingParams(temperature=1.0, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True),
                    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)):
        alone = run_engine(build_pair, prompts[:1], request, max_num_seqs=16, speculation="fixed", **config)[0]
        beside = run_engine(build_pair, prompts[1:8] + prompts[:1] + prompts[8:16], crowd[:7] + [request] + crowd[7:],
                            max_num_seqs=16, speculation="fixed", **config)[7]
        assert beside == alone, first_difference([beside], [alone])


# The random Qwen3-8B-shaped pair: its logits are nearly flat, so near-ties are everywhere and any
# batch-dependent rounding changes the tokens. Random drafts are rarely accepted: each round still
# verifies k + 1 rows per sequence, and the adaptive policy mostly runs AR steps at batch 8 and 32.
QWEN3_8B_LIMITS = dict(target="random Qwen3-8B shape", max_model_len=512)


@pytest.fixture(scope="module")
def qwen3_8b_pair():
    target, drafter = build_models("qwen3-8b", "cuda")
    yield target, drafter
    del target, drafter
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def random_prompts():
    g = torch.Generator().manual_seed(62)
    lengths = torch.randint(8, 300, (NUM_PROMPTS,), generator=g).tolist()
    return [torch.randint(0, QWEN3_8B["vocab_size"] - 1000, (n,), generator=g).tolist() for n in lengths]


def qwen3_8b_builder(pair, *, with_drafter: bool):
    target, drafter = pair

    def build(config: EngineConfig):
        layer_ids = drafter.config.target_layer_ids if with_drafter else ()
        return assemble_engine(config, TargetModel(target, layer_ids), drafter if with_drafter else None)

    return build


@pytest.fixture(scope="module")
def qwen3_8b_target_alone(qwen3_8b_pair, random_prompts):
    return run_engine(qwen3_8b_builder(qwen3_8b_pair, with_drafter=False), random_prompts, GREEDY, max_num_seqs=1,
                      **QWEN3_8B_LIMITS)


@pytest.mark.parametrize("batch", PAIR_BATCHES)
@pytest.mark.parametrize("speculation", SPECULATION)
def test_qwen3_8b_shaped_pair_equals_the_target_alone_at_batch_1(qwen3_8b_pair, random_prompts,
                                                                  qwen3_8b_target_alone, speculation, batch):
    got = run_engine(qwen3_8b_builder(qwen3_8b_pair, with_drafter=True), random_prompts, GREEDY, max_num_seqs=batch,
                     speculation=speculation, **QWEN3_8B_LIMITS)
    assert got == qwen3_8b_target_alone, first_difference(got, qwen3_8b_target_alone)


def test_qwen3_8b_shaped_pair_seeded_request_is_the_same_alone_and_in_a_batch_of_16(qwen3_8b_pair, random_prompts):
    seeded_request_alone_and_in_a_batch_of_16(qwen3_8b_builder(qwen3_8b_pair, with_drafter=True), random_prompts,
                                              **QWEN3_8B_LIMITS)


# The default pair (SmolLM2-135M-Instruct and its drafter) on MT-Bench-style chat prompts (Spec-Bench's
# first turns), loaded from the model cache and this checkout for every engine.
DEFAULT_PAIR_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def default_pair_prompts():
    if not (target_dir() / SOURCE_FILE).is_file():
        pytest.skip(f"the default target is not in the model cache ({target_dir()}): run `dflash fetch-default`")
    if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        pytest.skip(f"the default drafter is not in this checkout ({DEFAULT_DRAFTER_DIR})")
    if not REAL_DATA_DIR.is_dir():
        pytest.skip(f"the bench prompts are not at {REAL_DATA_DIR}")
    from transformers import AutoTokenizer

    from dflash_serve.services.bench.prompts import load_prompts
    from dflash_serve.services.training.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    encoded = (encode_prompt(tokenizer, prompt.text) for prompt in load_prompts("spec-bench", REAL_DATA_DIR))
    fitting = [ids for ids in encoded if len(ids) + NEW_TOKENS <= DEFAULT_PAIR_MAX_MODEL_LEN]
    assert len(fitting) >= NUM_PROMPTS
    return fitting[:NUM_PROMPTS]


def default_pair(*, with_drafter: bool) -> dict:
    return dict(target=str(target_dir()), drafter=str(DEFAULT_DRAFTER_DIR) if with_drafter else None,
                max_model_len=DEFAULT_PAIR_MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def default_target_alone(default_pair_prompts):
    return run_engine(build_engine, default_pair_prompts, GREEDY, max_num_seqs=1, **default_pair(with_drafter=False))


@pytest.mark.parametrize("batch", PAIR_BATCHES)
@pytest.mark.parametrize("speculation", SPECULATION)
def test_default_pair_equals_the_target_alone_at_batch_1(default_pair_prompts, default_target_alone, speculation,
                                                         batch):
    got = run_engine(build_engine, default_pair_prompts, GREEDY, max_num_seqs=batch, speculation=speculation,
                     **default_pair(with_drafter=True))
    assert got == default_target_alone, first_difference(got, default_target_alone)


def test_default_pair_seeded_request_is_the_same_alone_and_in_a_batch_of_16(default_pair_prompts):
    seeded_request_alone_and_in_a_batch_of_16(build_engine, default_pair_prompts, **default_pair(with_drafter=True))
