"""Sampling (spec §3.2): parameter validation, seeded draws that depend only on (seed, position,
logits), the sampled distribution for temperature / top-k / top-p, and draft acceptance."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dflash_serve.kernels import sampling as race
from dflash_serve.kernels.sampling import mix32_
from dflash_serve.services.engine import sampling
from dflash_serve.services.engine.sampling import SamplingBatch, resolve_seed, sample_tokens
from dflash_serve.services.engine.sampling_params import SamplingParams

# Chi-square tests pass when the p-value is above this. The noise is a fixed hash, so each test
# either always passes or always fails: no flakiness.
SIGNIFICANCE = 1e-3


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: torch.Tensor) -> torch.Tensor:
    seeds = [p.seed if p.seed is not None else 0 for p in params]
    return sample_tokens(logits, SamplingBatch.build(params, seeds, logits.device), positions)


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-0.1), r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.1"),
        (SamplingParams(temperature=math.nan), r"temperature must be a finite number >= 0 .*got nan"),
        (SamplingParams(temperature=math.inf), r"temperature must be a finite number >= 0 .*got inf"),
        (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (SamplingParams(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
        (SamplingParams(top_k=-1), r"top_k must be >= 0 \(0 = disabled\), got -1"),
        (SamplingParams(max_tokens=0), r"max_tokens must be >= 1, got 0"),
        (SamplingParams(stop=("###", "")), r"stop strings must be non-empty, but stop\[1\] is empty"),
        (SamplingParams(stop_token_ids=(3, -2)), r"stop_token_ids must be >= 0, got -2"),
        (SamplingParams(seed=2**64), r"seed must fit in a signed 64-bit integer, got 18446744073709551616"),
    ],
)
def test_validate_names_the_bad_field(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_max_tokens_limit():
    SamplingParams(max_tokens=100).validate(max_tokens_limit=100)
    with pytest.raises(ValueError, match=r"max_tokens must be <= 100, got 101"):
        SamplingParams(max_tokens=101).validate(max_tokens_limit=100)


def test_defaults_are_valid_and_json_lists_become_tuples():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1, seed=-(2**63)).validate()
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2])
    assert params.stop == ("a", "bc") and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="###").stop == ("###",)  # one stop string, not three characters
    hash(params)


def test_resolve_seed():
    assert resolve_seed(SamplingParams(seed=7), random.Random(0)) == 7
    drawn = [resolve_seed(SamplingParams(), random.Random(123)) for _ in range(2)]
    assert drawn[0] == drawn[1]  # reproducible for the same engine seed
    assert 0 <= drawn[0] < 2**63
    rng = random.Random(123)
    assert resolve_seed(SamplingParams(), rng) != resolve_seed(SamplingParams(), rng)


# --- greedy and determinism ---------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(3, 4, 50)
    positions = torch.arange(4).expand(3, 4)
    tokens = sample(logits, [SamplingParams(temperature=0)] * 3, positions)
    assert torch.equal(tokens, logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_argmax_and_sampled_rows_sample():
    logits = torch.zeros(3, 16, 1000)  # flat: argmax is token 0 everywhere
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0)]
    tokens = sample(logits, params, torch.arange(16).expand(3, 16))
    assert (tokens[[0, 2]] == 0).all()
    assert tokens[1].unique().numel() > 12


def _mixed_requests():
    """Two requests with different parameters: top-p alone (needs a full sort) and top-k + top-p."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 1000) * 2
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=11),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.95, seed=12),
    ]
    positions = torch.tensor([[100, 101, 102, 103, 104], [7, 8, 9, 10, 11]])
    return logits, params, positions


def test_draw_depends_only_on_seed_position_and_logits():
    logits, params, positions = _mixed_requests()
    together = sample(logits, params, positions)
    for n in range(2):
        alone = sample(logits[n : n + 1], [params[n]], positions[n : n + 1])
        assert torch.equal(alone[0], together[n])
        for s in range(5):  # target-only decoding: one position per call
            one = sample(logits[n : n + 1, s : s + 1], [params[n]], positions[n : n + 1, s : s + 1])
            assert one.item() == together[n, s].item()
    # Other requests around it, in another order, with a greedy one among them.
    crowd_logits = torch.cat([torch.randn(1, 5, 1000), logits[1:], torch.randn(1, 5, 1000), logits[:1]])
    crowd_params = [SamplingParams(temperature=0.5, seed=3), params[1], SamplingParams(temperature=0), params[0]]
    crowd_positions = torch.cat([positions[:1] + 50, positions[1:], positions[:1], positions[:1]])
    crowd = sample(crowd_logits, crowd_params, crowd_positions)
    assert torch.equal(crowd[1], together[1]) and torch.equal(crowd[3], together[0])


def test_draw_ignores_the_global_rng_and_row_chunking(monkeypatch):
    logits, params, positions = _mixed_requests()
    torch.manual_seed(1)
    first = sample(logits, params, positions)
    torch.manual_seed(2)
    torch.rand(100)
    monkeypatch.setattr(sampling, "_CHUNK_ELEMENTS", 2 * 1000)  # two rows per chunk of the thresholds
    monkeypatch.setattr(race, "CHUNK_ELEMENTS", 3 * 1000)  # and three of the race's reference
    assert torch.equal(sample(logits, params, positions), first)


def test_positions_and_seeds_change_the_draw():
    logits = torch.zeros(1, 64, 1000)  # uniform: every token equally likely
    positions = torch.arange(64)[None]
    by_seed = [sample(logits, [SamplingParams(seed=seed)], positions)[0] for seed in (1, 2, 2**40 + 1)]
    for tokens in by_seed:
        assert tokens.unique().numel() > 55  # draws at different positions differ
    for a, b in ((0, 1), (0, 2), (1, 2)):  # seeds differing in low or only in high bits
        assert (by_seed[a] != by_seed[b]).sum() > 55


def test_hash_is_murmur_style_mixing_in_int64_and_int32_lanes():
    def reference(x: int) -> int:  # plain uint32 arithmetic
        x ^= x >> 16
        x = (x * 0x604BAA5D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x43D6CE97) & 0xFFFFFFFF
        return x ^ (x >> 15)

    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF] + torch.randint(0, 2**32, (1000,)).tolist()
    expected = [reference(x) for x in values]
    assert mix32_(torch.tensor(values)).tolist() == expected
    # int32 lanes (the [R, V] hash's): the same 32 bits, the multiplies wrapping
    as_int32 = torch.tensor([x - 2**32 if x >= 2**31 else x for x in values], dtype=torch.int32)
    assert [x & 0xFFFFFFFF for x in mix32_(as_int32).tolist()] == expected


# --- the sampled distribution --------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.4, -2.2, -3.0], dtype=torch.float64)


def expected_distribution(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The reference: softmax(logits / T), keep the top k, renormalise, keep the smallest prefix
    reaching top_p, renormalise."""
    probs = torch.softmax(LOGITS / temperature, dim=0)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs)
    k = top_k if top_k > 0 else len(probs)
    kept[order[:k]] = probs[order[:k]]
    kept /= kept.sum()
    mass = 0.0
    nucleus = torch.zeros_like(probs)
    for token in order[:k].tolist():  # 10 tokens: the test's reference, not the implementation
        nucleus[token] = kept[token]
        mass += kept[token].item()
        if mass >= top_p:
            break
    return nucleus / nucleus.sum()


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


DRAWS = 20_000
CASES = {
    "temperature": dict(temperature=0.8),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_k_above_vocab": dict(temperature=1.0, top_k=1000),
    "top_p": dict(temperature=1.2, top_p=0.7),
    "top_k_then_top_p": dict(temperature=1.0, top_k=5, top_p=0.8),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_sampled_distribution_matches_reference(case, vary):
    kwargs = CASES[case]
    probs = expected_distribution(kwargs["temperature"], kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    logits = LOGITS.float()
    if vary == "seed":  # many requests at one position
        params = [SamplingParams(seed=seed, **kwargs) for seed in range(DRAWS)]
        tokens = sample(logits.expand(DRAWS, 1, -1), params, torch.full((DRAWS, 1), 37))
    else:  # one request over many positions
        tokens = sample(logits.expand(1, DRAWS, -1), [SamplingParams(seed=99, **kwargs)], torch.arange(DRAWS)[None])
    counts = torch.bincount(tokens.flatten(), minlength=len(LOGITS)).double()
    assert counts[probs == 0].sum() == 0, "a token outside top-k / top-p was sampled"
    assert chi_square_p_value(counts, probs) > SIGNIFICANCE


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_consecutive_draws_are_independent(vary):
    """Pairs of draws at neighbouring positions (or neighbouring seeds) are uniform over V x V."""
    v = 4
    if vary == "position":
        tokens = sample(torch.zeros(1, DRAWS + 1, v), [SamplingParams(seed=5)], torch.arange(DRAWS + 1)[None])[0]
    else:
        params = [SamplingParams(seed=seed) for seed in range(DRAWS + 1)]
        tokens = sample(torch.zeros(DRAWS + 1, 1, v), params, torch.full((DRAWS + 1, 1), 3))[:, 0]
    pairs = tokens[:-1] * v + tokens[1:]
    counts = torch.bincount(pairs, minlength=v * v).double()
    assert chi_square_p_value(counts, torch.full((v * v,), 1 / (v * v), dtype=torch.float64)) > SIGNIFICANCE


def test_truncation_edges():
    logits = torch.tensor([[[0.0, 5.0, -math.inf, 4.9, 1.0]]]).expand(200, 1, 5)
    positions = torch.arange(200)[:, None]
    # A tiny top_p still keeps the top token; a masked (-inf) token is never drawn.
    tiny = sample(logits, [SamplingParams(top_p=1e-6, seed=s) for s in range(200)], positions)
    assert (tiny == 1).all()
    plain = sample(logits, [SamplingParams(temperature=3.0, seed=s) for s in range(200)], positions)
    assert not (plain == 2).any() and set(plain.unique().tolist()) == {0, 1, 3, 4}
    top1 = sample(logits, [SamplingParams(top_k=1, temperature=5.0, seed=s) for s in range(200)], positions)
    assert (top1 == 1).all()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_batch_invariant_top_p_threshold_does_not_depend_on_the_other_requests(device):
    """engine.deterministic: a top-p request's nucleus is taken over the whole sorted vocabulary,
    so its threshold has the same bits alone and beside requests with other truncations (without
    it, the softmax and cumulative sum run over the batch's largest top-k)."""
    logits = torch.randn(3, 4, 1000, generator=torch.Generator().manual_seed(0)).to(device)
    request = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1)
    others = [SamplingParams(temperature=1.0, top_k=300, seed=2), SamplingParams(temperature=1.0, top_p=0.5, seed=3)]

    def thresholds(params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
        batch = SamplingBatch.build(params, [p.seed for p in params], device, batch_invariant=True)
        assert batch.needs_full_sort
        return sampling._thresholds(logits[rows], batch)

    alone = thresholds([request], [0])
    beside_others = thresholds([others[0], request, others[1]], [1, 0, 2])
    assert torch.equal(beside_others[1], alone[0])
    assert torch.isfinite(alone).all()  # a nucleus narrower than the vocabulary in every row
