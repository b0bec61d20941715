"""A `Proposer` whose drafter lives in another process, reached over a frame channel.

Feature rows go into a shared ring (opened once by the drafter) and only their handle travels.
The last injection rides on the next draft request (one frame, one reply per round: the drafter
injects, then drafts); an injection that meets another still waiting is sent on its own, without
waiting, and the reply to the next draft request drains both. On a GPU the reply is awaited by
polling, not sleeping (`BUSY_POLL_SECONDS`). Any channel failure, timeout or drafter error
raises `ProposerLost`: the engine then decodes target-only until a new drafter is attached.

A chained round (Engine: launched before the host has read the last one) asks for drafts after
bonus tokens and starts that exist only on this process's device: they are copied into a shared
buffer (`chained_inputs`) on the device, and the request goes out at once. Every frame is sent
after recording a `WritesDone` event, which the drafter waits for before it reads the ring or
those inputs, so this host never waits for its own device to hand work over. The other way, the
drafter writes its drafts into a shared `drafts` buffer and replies once that is queued; this side
waits for the drafter's event (on the host, watching the channel: a dead drafter's event may never
complete) and copies the drafts device to device.

The drafts come back in the reply, not through a shared GPU buffer ordered by a CUDA IPC event:
a stream waiting on another process's event stays blocked for good if that process dies before
the event completes (seen on an H100: the verifier's GPU work hangs, not just one round), and a
drafter must be free to die.

Two groups of sequences may be in flight (Engine: the drafter drafts one group's next round
while the target verifies the other's), so two draft requests may be outstanding: group 0's
rows of `chained_inputs` and `drafts` are the first, group 1's the last (together they are at
most max_num_seqs), each group has its own pair of events, and receiving one group's drafts
reads the replies up to its own only.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from dflash_serve.services.api.dflash.v1 import drafter_pb2
from dflash_serve.services.engine.cuda_graphs import RoundGraphs
from dflash_serve.services.engine.draft_runner import Proposer, ProposerLost
from dflash_serve.services.engine.kv_cache import AttentionBatch
from dflash_serve.services.models import TargetModel
from dflash_serve.services.transport import (
    BUSY_POLL_SECONDS,
    ChannelClosed,
    FeatureRing,
    OpenedWritesDone,
    SharedTensor,
    WritesDone,
    connect,
)

PROTOCOL = drafter_pb2.PROTOCOL_VERSION_3


@dataclass
class _DraftRequest:
    """A draft request sent whose drafts are not received yet."""

    rows: range  # its sequences' rows of the shared chained_inputs and drafts
    sent_at: float
    result: drafter_pb2.StepResult | None = None  # the reply, once read
    replied_at: float = 0.0
    done_at: float = 0.0  # when its drafts were done on the device


class RemoteProposer(Proposer):
    drafts_in_background = True
    context_after_accept = True  # the rows' positions and slots travel as host values: sent once the host has them

    def __init__(self, channel, ring: FeatureRing, chained_inputs: torch.Tensor, writes_done: list[WritesDone],
                 drafts: torch.Tensor, drafts_done: list[OpenedWritesDone], block_size: int, capacity_rows: int, *,
                 timeout: float, draft_groups: int = 1):
        self.channel = channel
        self.draft_groups = draft_groups
        self.ring = ring
        self.chained_inputs = chained_inputs
        self.writes_done = writes_done
        self.drafts = drafts
        self.drafts_done = drafts_done
        self.block_size = block_size
        self.capacity_rows = capacity_rows
        self.timeout = timeout
        self._step = 0
        # Per frame sent whose reply is not read yet, in order: the group whose drafts it asks for
        # (None: an injection alone), and the ring's rows written when it left.
        self._unanswered: collections.deque[tuple[int | None, int]] = collections.deque()
        self._requests: dict[int, _DraftRequest] = {}  # by group: asked for, not received
        self._pending: drafter_pb2.StepRequest | None = None  # an injection not sent yet
        self._busy_poll = BUSY_POLL_SECONDS if ring.shared.tensor.is_cuda else 0.0
        # Per draft request: time from sending it to having the reply, beyond the drafter's host
        # time on that step and its wait for this process's device: the channel, framing, earlier
        # injections it was still doing, and whatever of this process's own work meanwhile
        # (preparing the verify, committing the last round) outlasted it.
        self._transport_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        # Per draft request: from sending it to its drafts being done on the device, less the
        # drafter's wait for this process's device.
        self.draft_seconds: collections.deque[float] = collections.deque(maxlen=4096)

    @classmethod
    def connect(cls, address, *, target: TargetModel, block_size: int, kv_block_size: int, num_kv_blocks: int,
                capacity_rows: int, max_num_seqs: int, shared: list[SharedTensor],
                graphs: RoundGraphs | None = None, timeout: float = 30.0, draft_groups: int = 1) -> RemoteProposer:
        """Open the channel and say Hello; `shared` receives the buffers the verifier must keep alive.
        With the verifier's `graphs`, the drafter captures its forward for the same batch sizes.
        `draft_groups` 2 lets the engine pipeline two groups (`Proposer.draft_groups`): for a drafter
        on a GPU of its own; on its verifier's GPU the two processes' work would not overlap."""
        width = target.hidden_size * len(target.layer_ids)
        features = SharedTensor.allocate("features", (capacity_rows, width), target.dtype, target.device)
        embedding_weight, lm_head_weight = target.input_embeddings.weight.detach(), target.lm_head.weight.detach()
        embedding = SharedTensor.wrap("embedding", embedding_weight)
        tied = lm_head_weight.data_ptr() == embedding_weight.data_ptr() and lm_head_weight.shape == embedding_weight.shape
        lm_head = embedding if tied else SharedTensor.wrap("lm_head", lm_head_weight)  # tied: one buffer, named twice
        chained_inputs = SharedTensor.allocate("chained_inputs", (2, max_num_seqs), torch.long, target.device)
        drafts = SharedTensor.allocate("drafts", (max_num_seqs, block_size - 1), torch.long, target.device)
        shared.extend([features, embedding, chained_inputs, drafts] + ([] if tied else [lm_head]))
        writes_done = [WritesDone(target.device), WritesDone(target.device)]  # per group
        scale = getattr(target.input_embeddings, "embed_scale", 1.0)
        hello = drafter_pb2.Hello(
            protocol_version=PROTOCOL, features=features.describe(), kv_block_size=kv_block_size,
            num_kv_blocks=num_kv_blocks, block_size=block_size, embedding=embedding.describe(),
            lm_head=lm_head.describe(), embedding_scale=float(scale),
            final_logit_softcapping=float(target.final_logit_softcapping or 0.0),
            chained_inputs=chained_inputs.describe(), writes_done_event=writes_done[0].handle,
            drafts=drafts.describe(), group1_writes_done_event=writes_done[1].handle,
        )
        if graphs is not None:
            hello.graph_batch_sizes.extend(graphs.buckets)
            hello.max_blocks_per_sequence = graphs.max_blocks
            hello.scratch_blocks.extend(graphs.scratch_blocks)
        try:
            channel = connect(address, timeout=timeout)
            channel.send(drafter_pb2.DrafterRequest(hello=hello))
            reply = channel.recv(drafter_pb2.DrafterReply, timeout=timeout).hello
        except (ChannelClosed, OSError, TimeoutError) as err:
            raise ProposerLost(f"cannot reach the drafter at {address}: {err}") from err
        if reply.error:
            channel.close()
            raise ValueError(f"the drafter refused this verifier: {reply.error}")
        for buffer in (features, embedding, lm_head, chained_inputs, drafts):
            buffer.unlink_name()  # the drafter has mapped them: no name left to leak, however we end
        drafts_done = [OpenedWritesDone(event, target.device)
                       for event in (reply.drafts_done_event, reply.group1_drafts_done_event)]
        return cls(channel, FeatureRing(features), chained_inputs.tensor, writes_done, drafts.tensor, drafts_done,
                   block_size, capacity_rows, timeout=timeout, draft_groups=draft_groups)

    def inject_context(self, features: torch.Tensor, positions: torch.Tensor | list[int],
                       slots: torch.Tensor | list[int]) -> None:
        """Queue `features` for the drafter's context; positions and slots as host lists, or as
        tensors (read here: on a device, that waits for it)."""
        rows = features.shape[0]
        if rows == 0:
            return
        if not self.ring.can_write(rows):
            self._send_pending()
            self._drain()  # once the drafter has answered, every row is read and the ring may wrap
        handle = self.ring.write(features)
        self._send_pending()  # injections reach the drafter in the order they were made
        as_list = lambda x: x.tolist() if isinstance(x, torch.Tensor) else x  # noqa: E731
        self._pending = drafter_pb2.StepRequest(features=handle, positions=as_list(positions), slots=as_list(slots))

    def request_drafts(self, request_ids: list[str], bonus: list[int] | torch.Tensor, starts: list[int] | torch.Tensor,
                       tables: list[list[int]], batch: AttentionBatch | None, group: int = 0,
                       num_drafts: int | None = None) -> None:
        """Ask for a block of drafts for the tokens after each bonus token (all B-1 of them: it is
        asked before the round's k is final); `receive_drafts(group)` waits for them. `bonus` and
        `starts` as device tensors (a chained round's) go through the shared `chained_inputs`,
        copied there on the device without waiting for it. The drafter builds its own attention
        metadata from `tables`."""
        n = len(request_ids)
        rows = range(n) if group == 0 else range(len(self.drafts) - n, len(self.drafts))
        for other, request in list(self._requests.items()):
            # Never received (its group stopped): the drafter must be done with those rows first.
            if request.rows.start < rows.stop and rows.start < request.rows.stop:
                self._await(other)
                del self._requests[other]
        step, self._pending = self._pending or drafter_pb2.StepRequest(), None
        step.request_ids.extend(request_ids)
        if isinstance(bonus, torch.Tensor):
            self.chained_inputs[0, rows.start:rows.stop].copy_(bonus)
            self.chained_inputs[1, rows.start:rows.stop].copy_(starts)
            step.chained = True
        else:
            step.bonus_tokens.extend(bonus)
            step.starts.extend(starts)
        step.block_tables.extend(drafter_pb2.BlockTable(blocks=t) for t in tables)
        step.group, step.first_row = group, rows.start
        self._send(step, group)
        self._requests[group] = _DraftRequest(rows, time.perf_counter())

    def receive_drafts(self, group: int = 0) -> torch.Tensor:
        """The drafts of `group`'s request, [n, block-1] on this process's device: a view of the
        shared buffer, which the group's next request overwrites (copy them out before asking again)."""
        request = self._await(group)
        del self._requests[group]
        result, n = request.result, len(request.rows)
        if result.num_sequences != n:
            raise ProposerLost(f"the drafter answered for {result.num_sequences} sequences, not {n}")
        self._transport_seconds.append(
            request.replied_at - request.sent_at - result.draft_seconds - result.wait_seconds)
        self.draft_seconds.append(request.done_at - request.sent_at - result.wait_seconds)
        return self.drafts[request.rows.start:request.rows.stop]

    def drain_transport_seconds(self) -> list[float]:
        out = list(self._transport_seconds)
        self._transport_seconds.clear()
        return out

    def forget(self, request_ids: list[str]) -> None:
        try:
            self.channel.send(drafter_pb2.DrafterRequest(release=drafter_pb2.ReleaseSequences(request_ids=request_ids)))
        except (ChannelClosed, OSError):
            pass  # a lost drafter is noticed (and handled) at the next step

    def release(self) -> None:
        """Close the channel; the shared buffers are the caller's of `connect`."""
        self.channel.close()

    def _send_pending(self) -> None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._send(step, None)

    def _send(self, step: drafter_pb2.StepRequest, group: int | None) -> None:
        self._step += 1
        step.protocol_version = PROTOCOL
        step.step = self._step
        self.writes_done[step.group].record()  # after every write this frame names: the drafter waits for it
        try:
            self.channel.send(drafter_pb2.DrafterRequest(step=step))
        except (ChannelClosed, OSError) as err:
            raise ProposerLost(f"drafter channel closed: {err}") from err
        self._unanswered.append((group, self.ring.written))

    def _await(self, group: int) -> _DraftRequest:
        """`group`'s request, once its reply is read and its drafts are done."""
        request = self._requests[group]
        while request.result is None:
            self._read_reply()
        return request

    def _drain(self) -> None:
        """Read every outstanding reply."""
        while self._unanswered:
            self._read_reply()

    def _read_reply(self) -> None:
        """Read the oldest outstanding reply and wait for the drafts it announces (until then the
        drafter may still be reading the ring and the inputs)."""
        group, written = self._unanswered[0]
        try:
            result = self.channel.recv(drafter_pb2.DrafterReply, timeout=self.timeout, busy_poll=self._busy_poll).step
            self._unanswered.popleft()
            if result.error:
                raise ProposerLost(f"drafter step {result.step} failed: {result.error}")
            if group is not None:
                request = self._requests[group]
                request.result, request.replied_at = result, time.perf_counter()
                if result.num_sequences:
                    self.drafts_done[group].wait(self.timeout, owner_alive=lambda: not self.channel.peer_hung_up())
                request.done_at = time.perf_counter()
        except (ChannelClosed, OSError, TimeoutError) as err:  # OSError: ConnectionError from the wait
            raise ProposerLost(f"drafter did not answer: {err}") from err
        self.ring.mark_read(written)
