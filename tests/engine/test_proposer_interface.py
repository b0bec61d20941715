"""A proposer that implements only the `Proposer` interface runs the engine's rounds in either
style its attributes declare (asked after the verify's inputs, context in-line; or asked first,
context after acceptance, drafts in a buffer it rewrites), and losing it mid-round leaves the
output the target's own."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.draft_runner import Proposer, ProposerLost
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.engine import harness
from tests.engine.harness import build_engine, hf_greedy
from tests.targets import tiny_target

V, B, KV, TOKENS = 64, 5, 4, 24


class FakeProposer(Proposer):
    """Drafts the target's greedy continuation with an error planted after `accept` drafts. It
    keeps its context (KV slot -> position) from what it is given, checks at every request that
    the context covers each sequence up to its bonus token, and raises `ProposerLost` from the
    `lose_at`-th call of the method named `lose_in`."""

    target_layer_ids = (1,)

    def __init__(self, references: dict[str, list[int]], *, background: bool, accept: int = 2,
                 lose_in: str | None = None, lose_at: int = 4):
        self.block_size = B
        self.drafts_in_background = self.context_after_accept = background
        self.references, self.accept = references, accept
        self.lose_in, self.lose_at = lose_in, lose_at
        self.calls = {"request_drafts": 0, "receive_drafts": 0, "inject_context": 0}
        self.context: dict[int, int] = {}
        self.buffer = torch.zeros(8, B - 1, dtype=torch.long)  # a drafter in the background rewrites it
        self.drafts: torch.Tensor | None = None
        self.device_inputs: list[bool] = []  # per request: bonus tokens as a tensor (not host lists)
        self.received = 0
        self.forgotten: set[str] = set()
        self.released = 0

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if name == self.lose_in and self.calls[name] == self.lose_at:
            raise ProposerLost(f"{name} lost the drafter")

    def request_drafts(self, request_ids, bonus, starts, tables, batch, group=0, num_drafts=None):
        self._call("request_drafts")
        assert (batch is None) == self.drafts_in_background
        self.device_inputs.append(isinstance(bonus, torch.Tensor))
        bonus, starts = torch.as_tensor(bonus).tolist(), torch.as_tensor(starts).tolist()
        drafts = torch.zeros(len(request_ids), B - 1, dtype=torch.long)
        for i, (rid, b, s, table) in enumerate(zip(request_ids, bonus, starts, tables, strict=True)):
            ref = self.references[rid]
            assert ref[s] == b
            missing = [p for p in range(s) if self.context.get(table[p // KV] * KV + p % KV) != p]
            assert not missing, (rid, missing)
            true = ref[s + 1 : s + B]
            true[self.accept] = (true[self.accept] + 1) % V
            drafts[i] = torch.tensor(true)
        if self.drafts_in_background:
            self.buffer[: len(request_ids)] = drafts
            drafts = self.buffer[: len(request_ids)]
        self.drafts = drafts

    def receive_drafts(self, group=0):
        self._call("receive_drafts")
        self.received += 1
        return self.drafts

    def inject_context(self, features, positions, slots):
        self._call("inject_context")
        positions, slots = torch.as_tensor(positions).tolist(), torch.as_tensor(slots).tolist()
        assert features.shape[0] == len(positions) == len(slots)
        self.context.update(zip(slots, positions, strict=True))

    def forget(self, request_ids):
        self.forgotten.update(request_ids)

    def release(self):
        self.released += 1


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=2, vocab=V, seed=21).float()


@pytest.mark.parametrize("lose_in", [None, "request_drafts", "receive_drafts", "inject_context"])
@pytest.mark.parametrize("style", ["local", "background"])
def test_a_proposer_implementing_only_the_interface_is_lossless_and_losing_it_mid_round_too(target, style, lose_in):
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6], "c": list(range(20, 31))}
    greedy = {rid: hf_greedy(target, p, TOKENS + 2 * B) for rid, p in prompts.items()}
    fake = FakeProposer({rid: prompts[rid] + greedy[rid] for rid in prompts}, background=style == "background",
                        lose_in=lose_in)
    engine = build_engine(target, proposer=fake, kv_block_size=KV)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=TOKENS), rid)
    while engine.has_unfinished():
        engine.step()
    engine.drain()  # a chained round launched after the last one that counted
    for rid in prompts:
        seq = engine.sequences[rid]
        assert seq.error is None and seq.output_ids == greedy[rid][:TOKENS]
    assert sum(1 for r in engine.round_log if r.k) == fake.received  # every round with drafts in hand verified them
    if lose_in is None:
        assert engine.proposer is fake and engine.proposer_losses == 0 and fake.released == 0
        assert fake.forgotten == set(prompts)
        # Every round accepts `accept` drafts; each request's last commits only those max_tokens has room for.
        cut = (TOKENS - 1) % (fake.accept + 1) - 1
        accepted = [a for r in engine.round_log if r.k for a in r.accepted]
        assert accepted.count(cut) == len(prompts) and set(accepted) == {fake.accept, cut}
    else:
        assert engine.proposer is None and engine.proposer_losses == 1 and fake.released == 1
        # The round that lost its drafts went on without them (k = 0), as every round after it.
        ks = [r.k for r in engine.round_log]
        assert 0 in ks and ks == sorted(ks, key=lambda k: k == 0)
    # Chained rounds name their bonus tokens by the device's results; a local drafter always gets tensors.
    if style == "local":
        assert all(fake.device_inputs)
    else:
        assert any(fake.device_inputs) == harness.CHAIN_ROUNDS and not all(fake.device_inputs)
    assert engine.allocator.num_free == engine.allocator.num_blocks
