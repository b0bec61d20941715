"""Engines over tiny random targets, with oracle drafters whose acceptance is chosen by the test."""

from __future__ import annotations

import hashlib
import weakref
from collections import defaultdict

import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.draft_runner import DraftRunner, Proposer
from dflash_serve.services.engine.engine import Engine
from dflash_serve.services.engine.kv_cache import KVPool, window_slots_for
from dflash_serve.services.engine.loader import allocate_target_kv, target_runner
from dflash_serve.services.engine.prefill_graphs import PrefillChunkView, PrefillGraphs
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.models import DFlashDraftModel, TargetModel

# The target forward every engine test runs on; tests/engine/conftest.py runs the suite once per value.
TARGET_IMPL = "auto"
CHAIN_ROUNDS = False  # Engine.chain_rounds: on a GPU by default, forced here to run that loop on the CPU


def build_engine(model, *, proposer=None, drafter: DFlashDraftModel | None = None, num_blocks=256, kv_block_size=4,
                 max_num_seqs=8, max_prefill_tokens=64, eos=(), tokenizer=None, max_model_len=512,
                 enable_prefix_caching=True, speculation="fixed", spec_table=None,
                 prefill_buckets: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Engine:
    """An engine on the CPU in float32; `drafter` builds the real DraftRunner, `proposer` plugs in an oracle.
    Speculation is fixed (every draft verified) unless a test asks for the adaptive policy, whose
    costs are then measured (a real drafter) or must be set by the test (an oracle); `spec_table`:
    EngineConfig.num_speculative_tokens_per_batch_size. `prefill_buckets` (tokens, chunks): prefill
    through `PrefillGraphs`' padded forward (run eagerly here), the last KV block its scratch block."""
    layer_ids = drafter.config.target_layer_ids if drafter is not None else getattr(proposer, "target_layer_ids", ())
    target = TargetModel(model, layer_ids)
    layout = TargetRunner.kv_layout(target)
    scratch = 1 if prefill_buckets else 0
    lookahead = drafter.config.block_size if drafter is not None else getattr(proposer, "block_size", 1)
    window = KVPool.window_of(layout)
    # Sliding-window layers in window slots, as the loader places them, where there are fewer.
    window_slots = window_slots_for(window, kv_block_size, max_num_seqs, lookahead, max_prefill_tokens) \
        if window is not None else 0
    if window_slots >= num_blocks - scratch:
        window_slots = 0
    pool, allocator = allocate_target_kv(layout, num_blocks, scratch, kv_block_size, window_slots, model.dtype, "cpu")
    max_positions = max_model_len + 64
    runner = target_runner(TARGET_IMPL, target, pool, max_positions=max_positions)
    if drafter is not None:
        d_layers, d_heads, d_dim = DraftRunner.kv_shape(drafter.config)
        pool = KVPool.allocate(d_layers, num_blocks, kv_block_size, d_heads, d_dim, drafter.dtype, "cpu")
        proposer = DraftRunner(drafter, target, pool, max_positions=max_positions)
    config = EngineConfig(target="tiny", kv_block_size=kv_block_size, num_kv_blocks=num_blocks,
                          max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                          enable_prefix_caching=enable_prefix_caching, speculation=speculation,
                          num_speculative_tokens_per_batch_size=spec_table or {})
    usable = num_blocks - scratch
    engine = Engine(runner, proposer, allocator, config, tokenizer=tokenizer,
                    eos_token_ids=eos, max_model_len=max_model_len)
    engine.chain_rounds = CHAIN_ROUNDS
    if prefill_buckets:
        engine.prefill_graphs = PrefillGraphs(
            runner, proposer if drafter is not None else None, kv_block_size=kv_block_size,
            max_blocks=-(-max_positions // kv_block_size), scratch_slot=usable * kv_block_size,
            device=torch.device("cpu"), token_buckets=prefill_buckets[0], chunk_buckets=prefill_buckets[1],
            capture=False)
    if drafter is not None:
        engine.measure_round_costs()
    return engine


# model -> (its weights' identities and versions, its fingerprint): hashing the weights again only
# when a tensor was replaced or written in place.
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint(model) -> str:
    """What a forward's result depends on: the class, the config (attention implementation
    included), the device and every weight's bytes. Two objects with the same weights have the
    same fingerprint (module fixtures are often rebuilt from a seed)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    state = tuple((id(t), t._version) for _, t in tensors)
    known = _fingerprints.get(model)
    if known is not None and known[0] == state:
        return known[1]
    config = model.config
    digest = hashlib.sha256(f"{type(model).__qualname__} {config!r} {getattr(config, '_attn_implementation', None)} "
                            f"{tensors[0][1].device}".encode())
    for name, tensor in tensors:
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    _fingerprints[model] = (state, digest.hexdigest())
    return _fingerprints[model][1]


# (the model's fingerprint, prompt) -> the longest greedy sequence computed so far.
_greedy_runs: dict[tuple[str, tuple[int, ...]], list[int]] = {}


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy continuation by plain transformers forwards over the whole sequence
    (no cache, no paging: independent of everything the engine does). Each step is the same
    forward over the same ids whatever asks for it, so runs are kept by the model's fingerprint
    (the same weights in a new object hit) and prompt, and a longer one extends a shorter: the
    engine tests ask for the same references under each of their parametrizations."""
    key = (_fingerprint(model), tuple(prompt))
    ids = list(_greedy_runs.get(key, prompt))
    while len(ids) < len(prompt) + n:
        ids.append(int(model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    _greedy_runs[key] = ids
    return ids[len(prompt):len(prompt) + n]


# (target's and drafter's fingerprints, the target's layers read, tokens) -> the dense context K/V.
_dense_contexts: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}


@torch.no_grad()
def dense_context_kv(runner: DraftRunner, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The drafter's context K/V of `tokens` recomputed densely: the target's forward over them
    all, its features through the drafter's projections. Kept by the models' fingerprints and the
    tokens: the engine tests check the same sequences under each of their parametrizations."""
    key = (_fingerprint(runner.target.model), _fingerprint(runner.drafter), tuple(runner.target.layer_ids),
           tuple(tokens))
    if key not in _dense_contexts:
        device = runner.pool.k.device
        _, features = runner.target.forward_with_features(torch.tensor([tokens], device=device))
        _dense_contexts[key] = runner.drafter.context_kv(features, torch.arange(len(tokens), device=device)[None])
    return _dense_contexts[key]


def assert_draft_context_is_committed_rows(runner: DraftRunner, seq, kv_block_size: int, tol: float = 1e-4) -> None:
    """The drafter's paged context of `seq` (positions 0..num_cached-1, through its block table)
    equals a dense recomputation from its committed tokens alone."""
    n, device = seq.num_cached, runner.pool.k.device
    kv = dense_context_kv(runner, seq.tokens[:n])
    slots = torch.tensor([seq.block_table[p // kv_block_size] * kv_block_size + p % kv_block_size for p in range(n)],
                         device=device)
    for layer, (k, v) in enumerate(kv):
        cached_k = runner.pool.k[layer].view(-1, *runner.pool.k.shape[-2:])[slots]
        torch.testing.assert_close(cached_k, k[0].transpose(0, 1), rtol=tol, atol=tol)
        cached_v = runner.pool.v[layer].view(-1, *runner.pool.v.shape[-2:])[slots]
        torch.testing.assert_close(cached_v, v[0].transpose(0, 1), rtol=tol, atol=tol)


def _slot_rows(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [cache.view(-1, *cache.shape[-2:])[slots].clone() for layers in pool.tensors() for cache in layers]


def _zero_slots(pool: KVPool, slots: torch.Tensor) -> None:
    for layers in pool.tensors():
        for cache in layers:
            cache.view(-1, *cache.shape[-2:])[slots] = 0


def assert_prefill_paths_agree(engine: Engine, chunks, rtol: float) -> None:
    """One step's prefill `chunks`, eagerly (the drafter's injection after it) and through
    `engine.prefill_graphs`: the sampled rows' logits, the features, positions and slots, the
    target's K/V and the drafter's context K/V are the same."""
    graphs, proposer = engine.prefill_graphs, engine.proposer
    assert graphs.fits(len(chunks), sum(c.length for c in chunks), proposer) and graphs.injects_for(proposer)
    sampling = [i for i, c in enumerate(chunks) if c.completes_prefill]
    logits, features, positions, slots = engine._eager_prefill(chunks, sampling)
    proposer.inject_context(features, positions, slots)
    pools = (engine.runner.pool, proposer.pool)
    eager_kv = [rows for pool in pools for rows in _slot_rows(pool, slots)]
    for pool in pools:
        _zero_slots(pool, slots)
    views = [PrefillChunkView(c.seq.tokens[c.start:c.start + c.length], c.start, c.seq.block_table) for c in chunks]
    out = graphs.run(views, sampling)
    torch.testing.assert_close(out.logits, logits, rtol=rtol, atol=rtol)
    torch.testing.assert_close(out.features, features, rtol=rtol, atol=rtol)
    assert out.positions.tolist() == positions.tolist() and out.slots.tolist() == slots.tolist()
    graph_kv = [rows for pool in pools for rows in _slot_rows(pool, slots)]
    for got, want in zip(graph_kv, eager_kv, strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)


def assert_no_write_can_reach_a_shared_block(engine: Engine) -> None:
    """Every block holding a position a sequence may still write (its uncommitted positions: the
    rest of its prefill, a round's verify and draft blocks, a chained round's lookahead) is its
    own and outside the prefix cache (vLLM #42971)."""
    alloc = engine.allocator
    for seq in engine.scheduler.running:
        for block in seq.block_table[seq.num_cached // alloc.block_size :]:
            assert alloc.refs(block) == 1 and not alloc.is_cached(block), (seq.request_id, block)


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation with an error planted so that exactly
    `pattern[round]` drafts are accepted (cycling through the pattern), per request (`propose`,
    which tests override, drafts when asked)."""

    target_layer_ids = (1,)  # the engine captures features for it, as for a real drafter

    def __init__(self, block_size: int, vocab: int, references: dict[str, list[int]], patterns: dict[str, list[int]],
                 wrong_token: int | None = None):
        self.block_size = block_size
        self.vocab = vocab
        self.references = references  # request id -> prompt + greedy continuation (long enough)
        self.patterns = patterns
        self.wrong_token = wrong_token  # what to plant instead of (true + 1) % vocab
        self.planned: dict[str, list[int]] = defaultdict(list)
        self.injected_positions: list[int] = []
        self.fail_on: set[str] = set()
        self._drafts = None

    def inject_context(self, features, positions, slots):
        assert features.shape[0] == positions.shape[0] == slots.shape[0]
        self.injected_positions.extend(positions.tolist())

    def request_drafts(self, request_ids, bonus, starts, tables, batch, num_drafts=None):
        self._drafts = self.propose(request_ids, bonus, starts, batch)

    def receive_drafts(self):
        return self._drafts

    def propose(self, request_ids, bonus_ids, starts, batch):
        drafts = torch.zeros(len(request_ids), self.block_size - 1, dtype=torch.long)
        for i, (rid, s) in enumerate(zip(request_ids, starts.tolist(), strict=True)):
            if rid in self.fail_on:
                raise RuntimeError(f"planted drafter failure for {rid}")
            ref = self.references[rid]
            assert ref[s] == int(bonus_ids[i]), "the engine's bonus token is not the target's greedy token"
            true = (ref[s + 1 : s + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
            pattern = self.patterns[rid]
            a = pattern[len(self.planned[rid]) % len(pattern)]
            self.planned[rid].append(a)
            if a < self.block_size - 1:
                wrong = self.wrong_token if self.wrong_token is not None else (true[a] + 1) % self.vocab
                true[a] = wrong if wrong != true[a] else (true[a] + 1) % self.vocab
            drafts[i] = torch.tensor(true)
        return drafts
