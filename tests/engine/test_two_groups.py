"""Two groups in flight (Engine, issue 18): with a drafter in another process (a DrafterServer in
a thread, over the real frame channel and shared memory), a batch of at least 2 × min_group_size
decoding sequences whose costs say so is split in two, and the drafter drafts one group's next
round while the target verifies the other's. Exactly lossless; the pipeline's order on both sides
of the channel; groups re-formed when the batch changes; one group for a small batch or where
two would be slower; a lost drafter means target-only decoding; cancelled requests leave no KV
blocks behind."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.round_costs import RoundCosts
from tests.engine import harness
from tests.engine.harness import build_engine, hf_greedy
from tests.engine.test_split_drafter import B, V, _remote_engine, pair  # noqa: F401 - pair: the fixture

TOKENS = 24
PROMPTS = [[1, 2, 3, 4], list(range(10, 30)), [7] * 6, [40, 41], [5, 9, 11, 30, 2], [60, 3, 60, 3, 60]]


# Round costs linear in the batch, as where a forward is compute-bound: two half batches pay.
LINEAR = {"sizes": [1, 8], "verify": [0.1, 0.8], "draft": [0.1, 0.8]}
# A forward costs the same at any batch, as where it is bound by reading the weights: they do not.
FLAT = {"sizes": [1, 8], "verify": [0.5, 0.5], "draft": [0.2, 0.2]}


class Pipeline:
    """A remote engine whose groups split from 2 × 2 sequences, with what both sides saw: the
    verifier's draft requests and receipts ("ask"/"receive", group) in order, and the drafter's
    draft steps (group, first_row, sequences, chained) in order. `references`: request id ->
    prompt + greedy continuation, for a drafter whose drafts are those with an error planted
    (accepting 0..B-1 of them in turn); without it, the random drafter drafts."""

    def __init__(self, target, drafter, references: dict[str, list[int]] | None = None, costs: dict = LINEAR,
                 **engine_options):
        self.shared = []
        self.engine, self.server, self.proposer = _remote_engine(target, drafter, self.shared, **engine_options)
        self.proposer.draft_groups = 2  # as for a drafter on a GPU of its own
        self.engine.min_group_size = 2
        ks = self.engine.speculation.ks
        self.engine.speculation.costs = RoundCosts(costs["sizes"], {k: costs["verify"] for k in ks}, costs["draft"])
        self.events: list[tuple[str, int]] = []
        self.frames: list[tuple[int, int, int, bool]] = []
        request, receive = self.proposer.request_drafts, self.proposer.receive_drafts

        def ask(*args, group=0):
            self.events.append(("ask", group))
            request(*args, group=group)

        def take(group=0):
            self.events.append(("receive", group))
            return receive(group)

        self.proposer.request_drafts, self.proposer.receive_drafts = ask, take
        session = self.server.session
        step = session.step

        def drafter_step(req):
            if req.request_ids:
                self.frames.append((req.group, req.first_row, len(req.request_ids), req.chained))
            return step(req)

        session.step = drafter_step
        if references is not None:
            session.runner.propose = self._oracle(references)
        self.drafted = record_drafts(session.runner)

    @staticmethod
    def _oracle(references: dict[str, list[int]]):
        drafted: dict[str, int] = {}

        def propose(request_ids, bonus, starts, batch, num_drafts=None):  # the drafter server drafts B-1
            drafts = torch.zeros(len(request_ids), B - 1, dtype=torch.long)
            for i, (rid, b, s) in enumerate(zip(request_ids, bonus.tolist(), starts.tolist(), strict=True)):
                ref = references[rid]
                # Read from the group's own rows of the shared inputs, or this fails the step.
                assert ref[s] == b, f"{rid}: bonus {b} at {s}, the target's is {ref[s]}"
                true = ref[s + 1 : s + B]
                a = drafted[rid] = (drafted.get(rid, -1) + 1) % B  # accepts a of the B-1 drafts
                if a < B - 1:
                    true[a] = (true[a] + 1) % V
                drafts[i] = torch.tensor(true)
            return drafts

        return propose

    def pipelined_turns(self) -> int:
        """Receipts of group 1's drafts: rounds of group B, each one pipelined behind group A's."""
        return self.events.count(("receive", 1))

    def close(self) -> None:
        self.proposer.release()
        for buffer in self.shared:
            buffer.close()


def record_drafts(runner) -> dict[tuple[str, int], list[int]]:
    """What `runner.propose` drafts from now on: (request id, start) -> drafts."""
    drafted, propose = {}, runner.propose

    def recorded(request_ids, bonus, starts, batch, num_drafts=None):
        drafts = propose(request_ids, bonus, starts, batch, num_drafts)
        drafted.update(zip(zip(request_ids, starts.tolist()), drafts.tolist()))
        return drafts

    runner.propose = recorded
    return drafted


def greedy_references(target, prompts, ids, tokens) -> dict[str, list[int]]:
    return {rid: p + hf_greedy(target, p, tokens + 2 * B) for rid, p in zip(ids, prompts, strict=True)}


def assert_pipeline_order(events: list[tuple[str, int]], frames, max_num_seqs: int) -> None:
    """Steady steps: group A takes its drafts (its round is launched), asks for its next ones
    (chained on that round), and only then B takes its own: the drafter drafts A's next round while
    the target verifies B's; then B asks. The drafter's draft steps alternate groups, and group 1's
    rows are the last of the shared buffers."""
    step = [("receive", 0), ("ask", 0), ("receive", 1), ("ask", 1)]
    assert any(events[i : i + 12] == step * 3 for i in range(len(events))), events
    groups = [g for g, *_ in frames]
    assert any(groups[i : i + 6] == [0, 1] * 3 for i in range(len(groups))), groups
    for group, first_row, n, _ in frames:
        assert first_row == (0 if group == 0 else max_num_seqs - n)


@pytest.mark.parametrize("draft_groups", [1, 2])
def test_round_costs_are_measured_for_a_drafter_that_can_pipeline(pair, draft_groups):
    """Fixed speculation needs no round costs itself, but the two-group gate weighs them: a
    drafter that can pipeline gets them measured at attach, one that cannot does not."""
    target, drafter = pair
    shared = []
    engine, _server, proposer = _remote_engine(target, drafter, shared, draft_groups=draft_groups,
                                               speculation="fixed")
    try:
        costs = engine.speculation.costs
        assert (costs is not None) == (draft_groups == 2)
        if costs is not None:
            assert set(costs.ks) == set(engine.speculation.ks)
            assert all(s > 0 for k in costs.ks if k for s in costs.verify[k])
    finally:
        proposer.release()
        for buffer in shared:
            buffer.close()


@pytest.mark.parametrize("drafts", ["oracle", "greedy", "seeded"])
def test_two_groups_are_lossless_and_pipelined(pair, drafts):
    """oracle: the target's greedy continuation with errors planted, accepting 0..B-1 drafts in
    turn; greedy and seeded: the random drafter, which drafts each sequence exactly as an
    in-process drafter does — so its context rows reached it right in both groups."""
    target, drafter = pair
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    if drafts == "seeded":
        params = [SamplingParams(temperature=1.0, top_k=20, seed=s, max_tokens=TOKENS) for s in range(len(PROMPTS))]
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=TOKENS)] * len(PROMPTS)
    references = greedy_references(target, PROMPTS, ids, TOKENS) if drafts == "oracle" else None
    expected = [s.output_ids for s in build_engine(target).generate(PROMPTS, params)]
    run = Pipeline(target, drafter, references)
    for rid, prompt, p in zip(ids, PROMPTS, params, strict=True):
        run.engine.add_request(prompt, p, rid)
    while run.engine.has_unfinished():
        run.engine.step()
    run.engine.drain()
    assert [run.engine.sequences[rid].output_ids for rid in ids] == expected
    if drafts == "oracle":
        assert expected == [references[rid][len(p) : len(p) + TOKENS] for rid, p in zip(ids, PROMPTS)]
        assert any(r.accepted and max(r.accepted) == B - 1 for r in run.engine.round_log)  # whole blocks accepted
    else:  # the same drafts for every (sequence, start) as in-process drafting in one batch
        local = build_engine(target, drafter=drafter)
        drafted = record_drafts(local.proposer)
        local.generate(PROMPTS, params)
        assert drafted and {(ids[int(rid[4:])], s): d for (rid, s), d in drafted.items()}.items() <= run.drafted.items()
    assert run.engine.proposer is run.proposer and run.engine.proposer_losses == 0
    if harness.CHAIN_ROUNDS:
        assert run.pipelined_turns() >= 3
        assert_pipeline_order(run.events, run.frames, run.engine.config.max_num_seqs)
    else:  # two groups chain their rounds: not without chained rounds
        assert run.pipelined_turns() == 0
    assert run.engine.allocator.num_free == run.engine.allocator.num_blocks
    run.close()


def test_admissions_and_finishes_re_form_the_groups_losslessly(pair):
    """Requests of different lengths end at different steps and new ones arrive mid-run (more than
    max_num_seqs in all): every change ends both groups, and the next stable batch splits again."""
    target, drafter = pair
    prompts = PROMPTS + [[8, 8, 1], list(range(50, 62)), [33, 2, 71, 4]]
    ids = [f"r{i}" for i in range(len(prompts))]
    lengths = [10, 30, 17, 24, 12, 28, 20, 9, 15]
    references = greedy_references(target, prompts, ids, max(lengths))
    run = Pipeline(target, drafter, references, max_num_seqs=6)
    arrivals = {0: range(5), 4: (5, 6), 8: (7, 8)}  # by step: while the groups are in flight, too
    step = 0
    while run.engine.has_unfinished() or step <= max(arrivals):
        for i in arrivals.get(step, ()):
            run.engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=lengths[i]), ids[i])
        run.engine.step()
        step += 1
    run.engine.drain()
    for rid, prompt, n in zip(ids, prompts, lengths, strict=True):
        assert run.engine.sequences[rid].output_ids == references[rid][len(prompt) : len(prompt) + n], rid
    assert run.engine.proposer_losses == 0
    if harness.CHAIN_ROUNDS:
        formed = [f for f in run.frames if f[0] == 1 and not f[3]]  # group 1's first request of each pair
        assert len(formed) >= 2 and {n for _, _, n, _ in formed} != {3}  # re-formed, at other sizes too
        assert_pipeline_order(run.events, run.frames, run.engine.config.max_num_seqs)
    assert run.engine.allocator.num_free == run.engine.allocator.num_blocks
    run.close()


@pytest.mark.parametrize("batch", ["small", "flat costs", "shared GPU"])
def test_one_group_for_a_small_batch_or_where_two_would_be_slower(pair, batch):
    """Also for a drafter on its verifier's GPU (RemoteProposer.connect's default): the two
    processes' work would not overlap there."""
    target, drafter = pair
    prompts = PROMPTS[:3] if batch == "small" else PROMPTS  # 3 < 2 × min_group_size
    ids = [f"req-{i}" for i in range(len(prompts))]
    references = greedy_references(target, prompts, ids, TOKENS)
    run = Pipeline(target, drafter, references, costs=FLAT if batch == "flat costs" else LINEAR)
    if batch == "shared GPU":
        run.proposer.draft_groups = 1
    done = run.engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS))
    assert [s.output_ids for s in done] == [hf_greedy(target, p, TOKENS) for p in prompts]
    assert run.frames and {g for g, *_ in run.frames} == {0} and run.pipelined_turns() == 0
    run.close()


# Two groups chain their rounds: these run the chained loop only (conftest's `chain_rounds`).
CHAINED_ONLY = pytest.mark.parametrize("chain_rounds", [True], indirect=True, ids=["chained"])


@CHAINED_ONLY
@pytest.mark.parametrize("when", ["receive", "ask"])
def test_a_drafter_lost_mid_pipeline_falls_back_to_target_only(pair, when):
    """The channel goes away while both groups are in flight: while a group waits for its drafts,
    or as it asks for its next ones."""
    target, drafter = pair
    run = Pipeline(target, drafter)
    ids = [run.engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in PROMPTS]
    while run.pipelined_turns() < 2:
        run.engine.step()
    name = {"receive": "receive_drafts", "ask": "request_drafts"}[when]
    call = getattr(run.proposer, name)

    def lost(*args, **kwargs):
        run.proposer.channel.close()  # the drafter process went away
        return call(*args, **kwargs)

    setattr(run.proposer, name, lost)
    while run.engine.has_unfinished():
        run.engine.step()
    run.engine.drain()
    assert run.engine.proposer is None and run.engine.proposer_losses == 1
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        seq = run.engine.sequences[rid]
        assert seq.error is None and seq.output_ids == hf_greedy(target, prompt, 40)
    assert run.engine.allocator.num_free == run.engine.allocator.num_blocks
    run.close()


@CHAINED_ONLY
def test_cancelling_requests_of_both_groups_leaks_no_kv_blocks(pair):
    target, drafter = pair
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    references = greedy_references(target, PROMPTS, ids, TOKENS)
    run = Pipeline(target, drafter, references)
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        run.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=TOKENS), rid)
    while run.pipelined_turns() < 2:
        run.engine.step()
    cancelled = {"r0", "r5"}  # one of each group
    assert all(run.engine.cancel(rid) for rid in cancelled)
    while run.engine.has_unfinished():
        run.engine.step()
    run.engine.drain()
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        if rid not in cancelled:
            assert run.engine.sequences[rid].output_ids == references[rid][len(prompt) : len(prompt) + TOKENS]
    assert run.engine.proposer_losses == 0
    assert run.engine.allocator.num_free == run.engine.allocator.num_blocks
    run.close()
