"""Serves one verifier at a time over a frame channel (protos/dflash/v1/drafter.proto).

The verifier says Hello once: it names the shared buffers (its ring of committed feature rows,
and its embedding and LM head, which the drafter uses rather than loading the target again) and
the KV geometry (block ids are the verifier's: one block table per sequence addresses both
pools). Then each StepRequest injects the new feature rows and drafts a block per sequence —
after the bonus tokens of the request, or, for a chained round, after those the verifier's
device wrote into `chained_inputs` (it says when its writes are done: `OpenedWritesDone`). The
drafts go into the verifier's shared `drafts` buffer, and the reply leaves as soon as that work
is queued: the verifier waits for this side's `WritesDone` event, not for the frame. A verifier
with two groups of sequences in flight has a draft request of each outstanding: each group has
its rows of those buffers and its own pair of events, so neither waits for the other's work.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from dflash_serve.kernels import SkinnyLinear
from dflash_serve.services.api.dflash.v1 import drafter_pb2
from dflash_serve.services.engine.cuda_graphs import InjectionGraphs, RoundGraphs
from dflash_serve.services.engine.draft_runner import DraftRunner
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool
from dflash_serve.services.models import DFlashDraftModel, load_drafter
from dflash_serve.services.transport import (
    BUSY_POLL_SECONDS,
    ChannelClosed,
    FrameListener,
    OpenedTensor,
    OpenedWritesDone,
    WritesDone,
    open_shared,
    read_rows,
)

log = logging.getLogger(__name__)
PROTOCOL = drafter_pb2.PROTOCOL_VERSION_3
# How long a step waits for the verifier's device to finish writing what the step names.
WRITES_DONE_TIMEOUT_SECONDS = 60.0


class SharedTargetHead:
    """The parts of the target a drafter uses — input embedding (with the target's own scaling)
    and LM head (with its softcap) — over weights mapped from the verifier."""

    def __init__(self, embedding: torch.Tensor, lm_head: torch.Tensor, embedding_scale: float, softcap: float):
        self.input_embeddings = SimpleNamespace(weight=embedding)
        self.lm_head_weight = lm_head
        self.lm_head = SkinnyLinear(lm_head)
        self.embedding_scale = embedding_scale
        self.final_logit_softcapping = softcap or None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.input_embeddings.weight
        out = F.embedding(ids, weight)
        return out if self.embedding_scale == 1.0 else out * torch.tensor(self.embedding_scale, dtype=weight.dtype)


class DrafterSession:
    """What one Hello set up: mapped buffers, this verifier's KV pool, the runner.

    The mapped buffers live on the verifier's device (`home`); the drafter computes on its own
    (`compute`): the same device, or another GPU of the node (drafter_placement own_gpu). What a
    step reads is copied home -> compute, its drafts compute -> home (GPU to GPU; `.to` and
    `copy_` do nothing more when the two are one device), and `drafts_done` is recorded on home,
    the only device the verifier sees."""

    def __init__(self, drafter: DFlashDraftModel, hello: drafter_pb2.Hello):
        cfg = drafter.config
        if hello.block_size != cfg.block_size:
            raise ValueError(f"verifier expects block size {hello.block_size}, this drafter drafts {cfg.block_size}")
        buffers = (hello.features, hello.embedding, hello.lm_head, hello.chained_inputs, hello.drafts)
        opened: dict[str, OpenedTensor] = {}  # by buffer id: a tied embedding and LM head are one buffer
        for desc in buffers:
            if desc.buffer_id not in opened:
                opened[desc.buffer_id] = open_shared(desc)
        self._opened = list(opened.values())
        self.features, _, _, self.chained_inputs, self.drafts = (opened[d.buffer_id].tensor for d in buffers)
        self.home, self.compute = self.features.device, drafter.device
        # The target's weights are read by every draft: copied to the compute device once (a tied
        # pair stays one tensor), rather than read across devices every step.
        weights = {buffer_id: opened[buffer_id].tensor.to(self.compute)
                   for buffer_id in {hello.embedding.buffer_id, hello.lm_head.buffer_id}}
        embedding, lm_head = weights[hello.embedding.buffer_id], weights[hello.lm_head.buffer_id]
        # One pair of events per group (StepRequest.group).
        self.writes_done = [OpenedWritesDone(event, self.home)
                            for event in (hello.writes_done_event, hello.group1_writes_done_event)]
        self.drafts_done = [WritesDone(self.home), WritesDone(self.home)]
        head = SharedTargetHead(embedding, lm_head, hello.embedding_scale, hello.final_logit_softcapping)
        if not 0 <= cfg.mask_token_id < embedding.shape[0]:
            raise ValueError(f"mask_token_id={cfg.mask_token_id} is not a row of the target embedding ({embedding.shape[0]})")
        layers, heads, dim = DraftRunner.kv_shape(drafter.config)
        pool = KVPool.allocate(layers, hello.num_kv_blocks, hello.kv_block_size, heads, dim, drafter.dtype, self.compute)
        self.kv_block_size = hello.kv_block_size
        # No sequence outgrows its block table, nor the pool where the verifier sent no table width.
        max_positions = (hello.max_blocks_per_sequence or hello.num_kv_blocks) * hello.kv_block_size
        self.runner = DraftRunner(drafter, head, pool, max_positions=max_positions)
        self.graphs = self.injection = None
        if hello.graph_batch_sizes and self.compute.type == "cuda":
            # At batch 1 an eager draft forward spends most of its time launching kernels.
            self.graphs = RoundGraphs(None, self.runner, block=cfg.block_size, kv_block_size=hello.kv_block_size,
                                      max_blocks=hello.max_blocks_per_sequence,
                                      scratch_blocks=list(hello.scratch_blocks),
                                      buckets=tuple(hello.graph_batch_sizes))
            # A round injects 1..B rows per sequence: buckets of 16, 32, … up to a full batch's.
            top = self.graphs.max_batch * cfg.block_size
            self.injection = InjectionGraphs(
                self.runner, self.features.shape[1], self.features.dtype,
                scratch_slot=hello.scratch_blocks[0] * hello.kv_block_size,
                buckets=tuple(16 << i for i in range(max(1, top // 16).bit_length())))
        self.live: set[str] = set()
        self.steps = 0

    def step(self, req: drafter_pb2.StepRequest) -> drafter_pb2.StepResult:
        n, device = len(req.request_ids), self.compute
        seq_rows = slice(req.first_row, req.first_row + n)  # the sequences' rows of chained_inputs and drafts
        if req.group > 1 or seq_rows.stop > self.drafts.shape[0]:
            raise ValueError(f"group {req.group}, rows [{seq_rows.start}, {seq_rows.stop}): the groups are 0 and 1, "
                             f"the shared drafts buffer has {self.drafts.shape[0]} rows")
        # Host work first, while the verifier's device may still be writing what this step reads:
        # afterwards only the copies out of the shared buffers and the replays are left to launch.
        injection = bucket = None
        if req.features.rows and self.injection is not None:
            injection = self.injection.stage(list(req.positions), list(req.slots))
        if n and self.graphs is not None and n <= self.graphs.max_batch:
            tables = [list(t.blocks) for t in req.block_tables]
            bucket = (self.graphs.stage(tables) if req.chained
                      else self.graphs.stage(tables, list(req.bonus_tokens), list(req.starts)))
        waited = self.writes_done[req.group].wait(WRITES_DONE_TIMEOUT_SECONDS)
        t0 = time.perf_counter()
        if req.features.rows:
            rows = read_rows(self.features, req.features).to(device)
            if injection is not None:
                self.injection.replay(rows, injection)
            else:
                positions = torch.tensor(req.positions, dtype=torch.long, device=device)
                slots = torch.tensor(req.slots, dtype=torch.long, device=device)
                self.runner.inject_context(rows, positions, slots)
            if rows.is_cuda and not n:
                # The reply lets the verifier reuse these ring rows; the copy into KV must be done by then.
                torch.cuda.current_stream(device).synchronize()
        if n:  # the verifier reuses ring rows and inputs only once these drafts are done
            self.live.update(req.request_ids)
            # Across devices torch orders this copy after the draft on compute, and home's current
            # stream, where drafts_done is recorded, after the copy.
            self.drafts[seq_rows].copy_(self._draft(req, seq_rows, bucket))
            self.drafts_done[req.group].record()
        result = drafter_pb2.StepResult(protocol_version=PROTOCOL, step=req.step, num_sequences=n)
        self.steps += 1
        result.draft_seconds = time.perf_counter() - t0
        result.wait_seconds = waited
        return result

    def _draft(self, req: drafter_pb2.StepRequest, seq_rows: slice, bucket) -> torch.Tensor:
        """The block's drafts; `seq_rows`: the sequences' of chained_inputs; `bucket`: the draft
        graph's, staged by `step` (None: eagerly)."""
        n, device = len(req.request_ids), self.compute
        if req.chained:  # the verifier's device wrote them (done: `step` waited for it)
            bonus, starts = self.chained_inputs[:, seq_rows].to(device)
        else:
            bonus, starts = list(req.bonus_tokens), list(req.starts)
        if bucket is not None:
            if req.chained:
                self.graphs.load_inputs(bucket, bonus, starts)
            self.graphs.draft(bucket)
            return bucket.drafts[:n]
        block = self.runner.block_size
        tables = [list(t.blocks) for t in req.block_tables]
        starts_t = torch.as_tensor(starts, dtype=torch.long).to(device)
        batch = AttentionBatch.build(tables, starts_t.tolist(), [block] * n, self.kv_block_size, device)
        bonus_t = torch.as_tensor(bonus, dtype=torch.long).to(device)
        return self.runner.propose(list(req.request_ids), bonus_t, starts_t, batch)

    def close(self) -> None:
        for opened in self._opened:
            opened.close()


class DrafterServer:
    def __init__(self, drafter: DFlashDraftModel, *, host: str = "127.0.0.1"):
        self.drafter = drafter
        self.listener = FrameListener(host=host, port=0)
        self.session: DrafterSession | None = None
        self.sessions_served = 0
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, drafter_path: str, *, device: str, dtype: torch.dtype, revision: str | None = None) -> DrafterServer:
        return cls(load_drafter(drafter_path, dtype=dtype, device=device, revision=revision))

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="drafter-server", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        if self.drafter.device.type == "cuda":
            # This thread's kernels launch on the current device, Triton's included, and a drafter
            # on its own GPU sees the verifier's first.
            torch.cuda.set_device(self.drafter.device)
        while True:
            channel = self.listener.accept(timeout=None)
            try:
                self._serve(channel)
            except ChannelClosed:
                log.info("verifier disconnected")
            except Exception:  # noqa: BLE001 - one bad session must not stop the server
                log.exception("drafter session failed")
            finally:
                channel.close()
                if self.session is not None:
                    self.session.close()
                    self.session = None

    def _serve(self, channel) -> None:
        first = channel.recv(drafter_pb2.DrafterRequest)
        if first.WhichOneof("kind") != "hello":
            raise ValueError("the first frame of a session must be Hello")
        hello = first.hello
        reply = drafter_pb2.HelloReply(protocol_version=PROTOCOL, block_size=self.drafter.config.block_size)
        if hello.protocol_version != PROTOCOL:
            reply.error = f"protocol version {hello.protocol_version} is not supported; this drafter speaks {PROTOCOL}"
        else:
            try:
                self.session = DrafterSession(self.drafter, hello)
                reply.drafts_done_event, reply.group1_drafts_done_event = (
                    event.handle for event in self.session.drafts_done)
            except ValueError as err:
                reply.error = str(err)
        channel.send(drafter_pb2.DrafterReply(hello=reply))
        if reply.error:
            return
        self.sessions_served += 1
        busy_poll = BUSY_POLL_SECONDS if self.drafter.device.type == "cuda" else 0.0  # on CPU the cores compute
        while True:
            frame = channel.recv(drafter_pb2.DrafterRequest, busy_poll=busy_poll)
            kind = frame.WhichOneof("kind")
            if kind == "step":
                try:
                    result = self.session.step(frame.step)
                except Exception as err:  # noqa: BLE001 - reported to the verifier, which falls back
                    log.exception("draft step failed")
                    result = drafter_pb2.StepResult(protocol_version=PROTOCOL, step=frame.step.step,
                                                    error=f"{type(err).__name__}: {err}")
                channel.send(drafter_pb2.DrafterReply(step=result))
            elif kind == "release":
                self.session.live.difference_update(frame.release.request_ids)

    def stats(self) -> dict:
        session = self.session
        return {
            "connected": session is not None,
            "live_sequences": len(session.live) if session else 0,
            "steps": session.steps if session else 0,
            "sessions_served": self.sessions_served,
        }


def _serve_child(drafter_path: str, device: str, dtype: str, visible_devices: str | None, conn) -> None:
    import os

    from dflash_serve.services.engine.loader import resolve_dtype

    if visible_devices is not None:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    server = DrafterServer.load(drafter_path, device=device, dtype=resolve_dtype(dtype, torch.device(device)))
    conn.send(server.address)
    conn.close()
    server.serve_forever()


def spawn_drafter_process(drafter_path: str, *, device: str, dtype: str = "auto", visible_devices: str | None = None):
    """A drafter server in a child process of its own, without Ray (CUDA IPC handles cannot be
    opened by the process that made them, so a drafter on a thread would not do): for tests and
    benchmarks. `visible_devices`: the child's CUDA_VISIBLE_DEVICES (None: this process's), with
    the verifier's GPU first (`drafter.actor.cuda_visibility`). Returns the process (terminate it
    when done) and its address."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve_child, args=(drafter_path, device, dtype, visible_devices, child), daemon=True)
    process.start()
    if not parent.poll(600):
        process.terminate()
        raise TimeoutError("the drafter process did not start within 600 s")
    return process, parent.recv()
