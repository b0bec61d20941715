"""Tensor parallelism of the fused target forward (`EngineConfig.tensor_parallel_size`), Megatron-style.

Each of the `world` ranks holds a slice of every decoder layer: the query and KV heads of the QKV
projection and the rows of the gate-up projection (column-parallel), the matching input columns
of the O and down projections (row-parallel: each rank's output is a partial sum, all-reduced once
after each), the K/V of its own KV heads in its KV pool, and a slice of the vocabulary of the
embedding (a rank looks up the ids in its slice, zeros for the others, and the all-reduce sums the
one row with zeros: exact) and of the LM head (its logits all-gathered). The residual stream is
whole on every rank after each all-reduce, so the drafter's features are rank 0's own.

Rank 0 is the engine's process: the scheduler, sampling, acceptance and the drafter run there
alone; it keeps the whole embedding and LM head, which the drafter reads (its own forward uses
a view of its slice). The other ranks are processes it starts (`launch`), one per rank, that
load the target themselves, keep their shard and follow (`TensorParallel.follow`): each forward of
rank 0's runner first broadcasts its inputs (token ids, positions, the attention batch, the rows
of the logits, the window-slot map where the pool has window slots), and every rank runs the same
forward on its shard. No Python loop over ranks runs on the hot path.

A rank lost (killed, crashed) fails the group. Over gloo a collective with it raises on its peers
(they see the socket close), and rank 0 raises `TensorParallelError`, which ends the engine loop:
the replica fails its health check and is restarted, and its requests end with the error. NCCL
raises nothing: its collectives run on the GPU, where one with a dead peer never completes (or,
aborted, leaves results that look like any others), so rank 0, which watches its followers'
processes, exits as soon as one does (as NCCL's own watchdog would, later): the replica sees its
engine process gone, its calls end retryably and it fails its health check.

Not yet: CUDA graphs over the collectives (with tensor_parallel_size > 1 the forwards run eagerly);
each rank loads the whole checkpoint onto its device before it keeps its shard.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from dflash_serve.kernels import SkinnyLinear
from dflash_serve.services.engine.fused_target import has_moe_blocks
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool
from dflash_serve.services.models.target import TargetModel
from dflash_serve.services.process_control import die_with_parent

if TYPE_CHECKING:
    from dflash_serve.services.config import EngineConfig

log = logging.getLogger(__name__)

# Followers wait for rank 0's next step inside a broadcast for as long as the server idles, so no
# collective may time out; a dead rank is seen by its peers' sockets and rank 0's process watch.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
JOIN_TIMEOUT_S = 600.0  # a follower process starts (imports torch) and joins within this
LOST_WAIT_S = 2.0  # after a failed collective, how long rank 0 waits to see which follower exited
STOP_WAIT_S = 30.0
RANK_LOST_EXIT = 70  # rank 0's exit status when an NCCL group loses a rank (EX_SOFTWARE)
STOP, STEP = 0, 1
HEADER = 7  # op, tokens, sequences, block-table width, logits rows, max query length, window-map length


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group is lost: no forward can run any more (the replica must restart)."""


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the `rank`-th GPU after the one `device` names (cuda = cuda:0); cpu stays cpu."""
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return str(parsed)
    return f"cuda:{(parsed.index or 0) + rank}"


def _kv_heads_field(target: TargetModel, layer: nn.Module) -> str:
    """The config field a layer's KV head count comes from (Gemma-4's global layers have their own)."""
    if target.config.model_type == "gemma4_text" and getattr(layer.self_attn, "layer_type", None) == "full_attention":
        return "num_global_key_value_heads"
    return "num_key_value_heads"


def shard_unsupported_reason(target: TargetModel, world: int) -> str | None:
    """What of `target` cannot be split over `world` ranks, naming its config field, or None."""
    cfg = target.config
    if getattr(cfg, "hidden_size_per_layer_input", 0):
        return ("hidden_size_per_layer_input > 0 (Gemma-4 E2B/E4B's per-layer inputs: their embedding and "
                "projection run whole, outside the sharded layers)")
    if has_moe_blocks(target):
        return "mixture-of-experts blocks (num_experts: the experts are not sharded)"
    embedding = target.input_embeddings
    if type(embedding) is not nn.Embedding and not hasattr(embedding, "embed_scale"):
        return f"its input embedding {type(embedding).__name__} (a plain or a scaled table is what is sharded)"
    for index, layer in enumerate(target.layers):
        attn, mlp = layer.self_attn, layer.mlp
        counts = [("num_attention_heads", attn.q_proj.out_features // attn.head_dim, "attention heads")]
        if getattr(attn, "k_proj", None) is not None:  # a KV-shared layer reads another's
            counts.append((_kv_heads_field(target, layer), attn.k_proj.out_features // attn.head_dim, "KV heads"))
        counts.append(("intermediate_size", mlp.gate_proj.out_features, "MLP rows"))
        for field, count, what in counts:
            if count % world:
                return (f"{field}={count} ({what} of layer {index}) is not divisible by tensor_parallel_size={world}: "
                        "each rank holds an equal share of them")
    return None


@dataclass
class VocabShard:
    """A rank's slice of the vocabulary, [start, start + rows) of the embedding and the LM head,
    padded with zero rows to an equal share (so the logits gather in one collective)."""

    start: int
    rows: int
    embedding: torch.Tensor  # [share, H]
    embed_scale: torch.Tensor | None  # Gemma's × sqrt(H), as its embedding module applies it
    head: SkinnyLinear  # [share, H]
    vocab_size: int  # the LM head's rows: the gathered logits' width


def _equal_share(weight: torch.Tensor, rank: int, world: int) -> tuple[int, int, torch.Tensor]:
    """(start, rows, the rows padded to ceil(V / world)) of rank `rank`; a view where no padding is needed."""
    share = math.ceil(weight.shape[0] / world)
    start = rank * share
    rows = max(0, min(weight.shape[0], start + share) - start)
    piece = weight[start:start + rows]
    if rows < share:
        piece = torch.cat([piece, piece.new_zeros(share - rows, *weight.shape[1:])])
    return start, rows, piece


def _column(proj: nn.Linear, rank: int, world: int) -> None:
    rows = proj.out_features // world
    proj.weight = nn.Parameter(proj.weight.detach()[rank * rows:(rank + 1) * rows].clone(), requires_grad=False)
    if proj.bias is not None:
        proj.bias = nn.Parameter(proj.bias.detach()[rank * rows:(rank + 1) * rows].clone(), requires_grad=False)
    proj.out_features = rows


def _row(proj: nn.Linear, rank: int, world: int) -> None:
    cols = proj.in_features // world
    proj.weight = nn.Parameter(proj.weight.detach()[:, rank * cols:(rank + 1) * cols].contiguous(),
                               requires_grad=False)
    if proj.bias is not None and rank:  # the partial sums add up to one bias: rank 0's
        proj.bias = None
    proj.in_features = cols


def shard_target(target: TargetModel, rank: int, world: int) -> VocabShard:
    """Keep rank `rank`'s shard of every decoder layer (in place: the layers' projections become
    their slices, so the KV layout and the fused layers read the shard's geometry) and return its
    vocabulary slice. Followers (rank > 0) also give up the whole embedding and LM head; rank 0
    keeps them for the drafter. The HF model computes a shard's partial sums from then on: only
    the fused forward with this group runs it."""
    with torch.no_grad():
        for layer in target.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for proj in (attn.q_proj, getattr(attn, "k_proj", None), getattr(attn, "v_proj", None),
                         mlp.gate_proj, mlp.up_proj):
                if proj is not None:
                    _column(proj, rank, world)
            _row(attn.o_proj, rank, world)
            _row(mlp.down_proj, rank, world)
        head_weight, head_bias = target.lm_head.weight.detach(), target.lm_head.bias
        start, rows, embedding = _equal_share(target.input_embeddings.weight.detach(), rank, world)
        _, _, head = _equal_share(head_weight, rank, world)
        bias = None if head_bias is None else _equal_share(head_bias.detach(), rank, world)[2]
        if rank:
            embedding, head = embedding.clone(), head.clone()
            tied = target.model.get_output_embeddings().weight is target.input_embeddings.weight
            target.input_embeddings.weight = nn.Parameter(embedding, requires_grad=False)
            target.model.get_output_embeddings().weight = (target.input_embeddings.weight if tied
                                                           else nn.Parameter(head, requires_grad=False))
            head = target.model.get_output_embeddings().weight
            target.lm_head = SkinnyLinear(head, bias)
    scale = getattr(target.input_embeddings, "embed_scale", None)
    return VocabShard(start, rows, embedding, scale, SkinnyLinear(head, bias), head_weight.shape[0])


@dataclass(frozen=True)
class PoolGeometry:
    """What rank 0 decides of the KV pools (from its free memory) and every rank allocates alike."""

    num_blocks: int
    scratch: int
    block_size: int
    window_slots: int
    max_positions: int


class _Follower:
    """A follower rank's process, as rank 0 started it."""

    def __init__(self, rank: int, process: subprocess.Popen):
        self.rank = rank
        self.process = process

    def describe_exit(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        return f"tensor-parallel rank {self.rank} (pid {self.process.pid}) exited with {how}"


class TensorParallel:
    """One rank's part in the group: its vocabulary slice, the collectives the fused forward calls
    (`all_reduce`, `embed`, `logits`), and the step protocol (rank 0 `lead`s, the others `follow`)."""

    def __init__(self, rank: int, world: int, vocab: VocabShard, device: torch.device,
                 followers: list[_Follower] | None = None):
        self.rank = rank
        self.world = world
        self.vocab = vocab
        self.device = device
        self.followers = followers or []
        self.lost: str | None = None  # why the group failed (rank 0)
        self._closing = False
        for follower in self.followers:
            threading.Thread(target=self._watch, args=(follower,), name=f"tp-rank-{follower.rank}",
                             daemon=True).start()

    # -- the collectives of the forward ------------------------------------------------------------

    @staticmethod
    def all_reduce(partial: torch.Tensor) -> torch.Tensor:
        """The row-parallel O or down projection's partial sums -> the whole output, on every rank."""
        dist.all_reduce(partial)
        return partial

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The vocabulary-parallel input embedding: this rank's rows, zeros elsewhere, summed over the ranks."""
        vocab = self.vocab
        local = ids - vocab.start
        inside = (local >= 0) & (local < vocab.rows)
        rows = torch.nn.functional.embedding(local.clamp(0, vocab.embedding.shape[0] - 1), vocab.embedding)
        if vocab.embed_scale is not None:
            rows = rows * vocab.embed_scale.to(rows.dtype)
        return self.all_reduce(torch.where(inside[:, None], rows, 0))

    def logits(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [K, V] of final-normed rows [K, H]: each rank's vocabulary slice, gathered."""
        local = target.logits(hidden, self.vocab.head)  # the softcap, if any, is per element
        gathered = local.new_empty(self.world * local.shape[0], local.shape[1])
        dist.all_gather_single(gathered, local.contiguous())
        share = local.shape[1]
        return gathered.view(self.world, -1, share).transpose(0, 1).reshape(-1, self.world * share)[
            :, :self.vocab.vocab_size]

    # -- the step protocol -------------------------------------------------------------------------

    def send_setup(self, geometry: PoolGeometry) -> None:
        self._guard(lambda: dist.broadcast_object_list([geometry], src=0))

    def receive_setup(self) -> PoolGeometry:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def lead(self, forward: Callable, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
             rows: torch.Tensor, window_map: torch.Tensor | None):
        """Rank 0: send a forward's inputs to the followers, then run it. Any failure midway leaves
        the ranks in different collectives, so every one fails the group for good."""
        def step():
            n, width = batch.block_tables.shape
            window = window_map if window_map is not None else ids.new_empty(0)
            header = [STEP, ids.numel(), n, width, rows.numel(), batch.max_query_len, window.numel()]
            dist.broadcast(torch.tensor(header, dtype=torch.long, device=self.device), 0)
            parts = (ids, positions, batch.block_tables.flatten(), batch.seq_lens, batch.query_start,
                     batch.slot_mapping, rows, window)
            dist.broadcast(torch.cat([p.to(torch.long) for p in parts]), 0)
            return forward(ids, positions, batch, rows)
        return self._guard(step)

    def follow(self, forward: Callable, pool: KVPool) -> None:
        """A follower: run rank 0's forwards on this shard until it says stop."""
        while True:
            header = torch.empty(HEADER, dtype=torch.long, device=self.device)
            dist.broadcast(header, 0)
            op, tokens, n, width, k, max_query_len, window = header.tolist()
            if op == STOP:
                return
            payload = torch.empty(3 * tokens + n * width + 2 * n + 1 + k + window, dtype=torch.long,
                                  device=self.device)
            dist.broadcast(payload, 0)
            ids, positions, tables, seq_lens, query_start, slots, rows, window_map = payload.split(
                [tokens, tokens, n * width, n, n + 1, tokens, k, window])
            if window:
                pool.window_map.copy_(window_map)
            batch = AttentionBatch(block_tables=tables.view(n, width).to(torch.int32),
                                   seq_lens=seq_lens.to(torch.int32), query_start=query_start.to(torch.int32),
                                   slot_mapping=slots, max_query_len=max_query_len)
            forward(ids, positions, batch, rows)

    def _guard(self, work: Callable):
        if self.lost is not None:
            raise TensorParallelError(self.lost)
        try:
            return work()
        except Exception as err:  # noqa: BLE001 - see `lead`
            self.lost = self._why_lost(err)
            raise TensorParallelError(self.lost) from err

    def _why_lost(self, err: Exception) -> str:
        deadline = time.monotonic() + LOST_WAIT_S
        while True:  # the collective may fail before the dead rank's exit is seen
            exits = [e for e in (f.describe_exit() for f in self.followers) if e]
            if exits or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        cause = "; ".join(exits) if exits else f"a tensor-parallel step failed ({type(err).__name__}: {err})"
        return f"{cause}: this replica's tensor-parallel group cannot run forwards any more and must be restarted"

    def _watch(self, follower: _Follower) -> None:
        follower.process.wait()
        if self._closing:
            return
        if dist.get_backend() != "nccl":  # gloo's next collective raises: `_guard` says why
            log.error("%s", follower.describe_exit())
            return
        log.critical("%s: NCCL cannot fail the collectives in flight with it, so no result of this process can be "
                     "trusted any more: it exits", follower.describe_exit())
        os._exit(RANK_LOST_EXIT)

    def close(self) -> None:
        """Rank 0: stop the followers and leave the group (also when it failed)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        if self.lost is None:
            try:
                dist.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.long, device=self.device), 0)
            except Exception:  # noqa: BLE001 - a follower gone already: it is stopped below
                log.warning("tensor-parallel followers did not take the stop", exc_info=True)
        for follower in self.followers:
            try:  # after a failure the others may wait in a collective forever: no use waiting for them
                follower.process.wait(STOP_WAIT_S if self.lost is None else 0)
            except subprocess.TimeoutExpired:
                follower.process.kill()
                follower.process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(config: EngineConfig, target: TargetModel) -> TensorParallel:
    """Rank 0 (the engine's process): refuse what cannot be sharded, start a follower process per
    other rank, form the group and keep rank 0's shard of `target` (loaded whole on `config.device`)."""
    from dflash_serve.services.engine.fused_target import fused_unsupported_reason

    world = config.tensor_parallel_size
    name = type(target.model).__name__
    reason = fused_unsupported_reason(target)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={world} needs the fused target forward, which {name} has not "
                         f"({reason}); use tensor_parallel_size=1")
    reason = shard_unsupported_reason(target, world)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={world}: {name} cannot be sharded: {reason}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed's default group exists already in this process; a tensor-parallel "
                           "engine forms it (one such engine per process)")
    device = target.device
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                          wait_for_workers=False)
    followers = []
    try:
        for rank in range(1, world):
            spec = {"config": config.to_dict(), "rank": rank, "world": world, "port": store.port,
                    "device": rank_device(config.device, rank)}
            # It finds dflash_serve where this process does (a Ray runtime_env may put it on sys.path only).
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
            process = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], env=env)
            followers.append(_Follower(rank, process))
        _wait_joined(store, followers)
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    except BaseException:
        for follower in followers:
            follower.process.kill()
            follower.process.wait()
        raise
    log.info("tensor parallelism: %d ranks over %s (followers' pids %s)", world, _backend(device),
             [f.process.pid for f in followers])
    tp = TensorParallel(0, world, shard_target(target, 0, world), device, followers)
    atexit.register(tp.close)
    return tp


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _wait_joined(store: dist.TCPStore, followers: list[_Follower]) -> None:
    """Until every follower has started (set its key), or one exits, or JOIN_TIMEOUT_S passes."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    waiting = list(followers)
    while waiting:
        exits = [e for e in (f.describe_exit() for f in waiting) if e]
        if exits:
            raise RuntimeError(f"{'; '.join(exits)} while starting")
        waiting = [f for f in waiting if not store.check([f"joined/{f.rank}"])]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks {[f.rank for f in waiting]} did not start within "
                               f"{JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def follower_main(spec: dict) -> None:
    """A follower rank: join the group, load and shard the target, allocate the KV pool rank 0
    sizes, and run rank 0's forwards until it stops."""
    from dflash_serve.services.config import EngineConfig
    from dflash_serve.services.engine.fused_target import FusedTargetRunner
    from dflash_serve.services.engine.loader import allocate_target_kv, resolve_dtype
    from dflash_serve.services.engine.target_runner import TargetRunner

    die_with_parent()  # a follower alone has nothing to do once rank 0's process ends
    rank, world = spec["rank"], spec["world"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tensor-parallel rank {rank}: %(message)s")
    config = EngineConfig.from_dict(spec["config"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", spec["port"], world, False,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    dtype = resolve_dtype(config.dtype, device)
    target = TargetModel.from_pretrained(config.target, (), dtype=dtype, device=device,
                                         revision=config.target_revision)
    tp = TensorParallel(rank, world, shard_target(target, rank, world), device)
    geometry = tp.receive_setup()
    pool, _ = allocate_target_kv(TargetRunner.kv_layout(target), geometry.num_blocks, geometry.scratch,
                                 geometry.block_size, geometry.window_slots, dtype, device)
    runner = FusedTargetRunner(target, pool, max_positions=geometry.max_positions, tp=tp)
    log.info("following rank 0 (%d KV blocks)", geometry.num_blocks)
    with torch.inference_mode():
        tp.follow(runner.forward_shard, pool)
    dist.destroy_process_group()


if __name__ == "__main__":
    # The package's copy of this module, which the loader imports too (not a second one as __main__).
    from dflash_serve.services.engine import tensor_parallel

    tensor_parallel.follower_main(json.loads(sys.argv[1]))
