"""Build an `Engine` from an `EngineConfig`: models, tokenizer, KV pools sized to the device."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from dflash_serve.kernels import warm_accept_round, warm_sample_race
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.cuda_graphs import DEFAULT_BUCKETS, RoundGraphs
from dflash_serve.services.engine.draft_runner import DraftRunner
from dflash_serve.services.engine.engine import Engine
from dflash_serve.services.engine.fused_target import FusedTargetRunner, fused_unsupported_reason
from dflash_serve.services.engine.kv_cache import BlockAllocator, KVPool, LayerKV, window_slots_for
from dflash_serve.services.engine.prefill_graphs import CHUNK_BUCKETS, TOKEN_BUCKETS, PrefillGraphs
from dflash_serve.services.engine.round_cost_cache import NOT_IN_KEY, RoundCostCache, machine, model_shape
from dflash_serve.services.engine.speculation import k_buckets
from dflash_serve.services.engine.target_runner import TargetRunner, unservable_reason
from dflash_serve.services.engine.tensor_parallel import PoolGeometry, TensorParallel, launch
from dflash_serve.services.models import DFlashDraftConfig, DFlashDraftModel, TargetModel, load_drafter
from dflash_serve.services.models.default_pair import cache_dir
from dflash_serve.services.models.target_files import load_tokenizer as load_target_tokenizer

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BLOCKS = 512


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmuls are slow on CPUs; GPUs run the checkpoints' own bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={name!r} is not a torch dtype (use auto, bfloat16, float16 or float32)")
    return dtype


def eos_token_ids(name_or_path: str, tokenizer, revision: str | None = None) -> set[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(name_or_path, revision=revision).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS below is all there is
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def load_tokenizer(config: EngineConfig):
    """(the target's tokenizer or None, its EOS token ids), at config.target_revision."""
    try:
        tokenizer = load_target_tokenizer(config.target, config.target_revision)  # the class the routers load
    except (OSError, ValueError):
        log.warning("no tokenizer found with %s: token ids in and out only, no stop strings", config.target)
        tokenizer = None
    return tokenizer, eos_token_ids(config.target, tokenizer, config.target_revision)


def log_models(config: EngineConfig) -> None:
    """The startup log's record of exactly which models this replica serves."""

    def source(name: str, revision: str | None) -> str:
        return f"{name} at revision {revision}" if revision else f"{name} (unpinned: a local folder or the default branch)"

    drafter = source(config.drafter, config.drafter_revision) if config.drafter else "none (target-only)"
    log.info("models: target %s; drafter %s", source(config.target, config.target_revision), drafter)


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int, *, usable: int,
                  reserved: int = 0) -> int:
    """`usable`: the blocks max_num_seqs sequences of max_model_len tokens can hold at once. More
    would only lengthen every start (85 % of an H200 for the 135 M default pair took 14 s to
    allocate) and hold memory a second process on the GPU could use. `reserved`: bytes of free
    memory held apart from the blocks (sliding-window layers' window slots, the weights of a
    drafter that another process loads meanwhile)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BLOCKS
    free, _ = torch.cuda.mem_get_info(device)
    # Leave room for activations of the largest forward (prefill chunk / verify batch).
    blocks = (int(free * config.kv_memory_fraction) - reserved) // bytes_per_block
    if blocks <= 0:
        raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free after loading the models)")
    return min(blocks, usable)


def allocate_target_kv(layout: list[LayerKV], num_blocks: int, scratch: int, block_size: int, num_window_slots: int,
                       dtype: torch.dtype, device: torch.device | str) -> tuple[KVPool, BlockAllocator]:
    """The target's KV pool and the allocator of its blocks but the last `scratch` (which CUDA
    graphs' padding rows write into); `num_window_slots` > 0: the sliding-window layers' K/V in
    that many window slots (and a scratch slot per scratch block)."""
    slots = num_window_slots + scratch if num_window_slots else None
    pool = KVPool.allocate_layers(layout, num_blocks, block_size, dtype, device, num_window_slots=slots)
    allocator = BlockAllocator(num_blocks - scratch, block_size,
                               window=KVPool.window_of(layout) if num_window_slots else None,
                               num_window_slots=num_window_slots, window_map=pool.window_map)
    if pool.window_map is not None:
        pool.window_map[num_blocks - scratch:] = torch.arange(num_window_slots, num_window_slots + scratch,
                                                              dtype=torch.int32)
    return pool, allocator


def target_runner(impl: str, target: TargetModel, pool: KVPool, *, max_positions: int, deterministic: bool = False,
                  tp: TensorParallel | None = None) -> TargetRunner | FusedTargetRunner:
    """The target's forward for `EngineConfig.target_impl`; auto takes the fused one where it applies.
    `deterministic` needs the fused one (EngineConfig refuses it with target_impl=transformers), and so
    does `tp` (`tensor_parallel.launch` refused a target without one)."""
    name = type(target.model).__name__
    reason = unservable_reason(target)
    if reason is not None:
        raise ValueError(f"{name} cannot be served: {reason}")
    if tp is not None:
        log.info("target forward: fused layers for %s, rank 0 of %d tensor-parallel ranks", name, tp.world)
        return FusedTargetRunner(target, pool, max_positions=max_positions, tp=tp)
    if impl == "transformers":
        log.info("target forward: transformers layer code for %s (target_impl=transformers)", name)
        return TargetRunner(target, pool, max_positions=max_positions)
    reason = fused_unsupported_reason(target)
    if reason is None:
        log.info("target forward: fused layers for %s (target_impl=%s%s)", name, impl,
                 ", batch-invariant kernels" if deterministic else "")
        return FusedTargetRunner(target, pool, max_positions=max_positions, deterministic=deterministic)
    if impl == "fused":
        raise ValueError(f"target_impl=fused: {name} has no fused forward ({reason}); use auto or transformers")
    if deterministic:
        raise ValueError(f"deterministic=true: {name} has no fused forward ({reason}), and only the fused forward "
                         "has batch-invariant kernels; turn deterministic off to serve it")
    log.info("target forward: transformers layer code for %s (no fused forward: %s)", name, reason)
    return TargetRunner(target, pool, max_positions=max_positions)


def build_engine(config: EngineConfig, *, defer_warm_up: bool = False) -> Engine:
    log_models(config)
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    drafter = (load_drafter(config.drafter, dtype=dtype, device=device, revision=config.drafter_revision)
               if config.drafter else None)
    layer_ids = drafter.config.target_layer_ids if drafter is not None else ()
    target = TargetModel.from_pretrained(config.target, layer_ids, dtype=dtype, device=device,
                                         revision=config.target_revision)
    if drafter is not None:
        drafter.check_target(target)
    tokenizer, eos = load_tokenizer(config)
    return assemble_engine(config, target, drafter, tokenizer=tokenizer, eos_token_ids=eos, defer_warm_up=defer_warm_up)


def assemble_engine(config: EngineConfig, target: TargetModel, drafter: DFlashDraftModel | None, *, tokenizer=None,
                    eos_token_ids: set[int] | frozenset[int] = frozenset(),
                    remote_drafter: DFlashDraftConfig | None = None, remote_drafter_kv_here: bool = True,
                    remote_drafter_bytes: int = 0, defer_warm_up: bool = False) -> Engine:
    """An engine around models already in memory: KV pools sized to the device, CUDA graphs
    captured and the drafter's round costs measured now — or with `defer_warm_up` later, between
    steps (`Engine.warm_up_next`): a serving engine answers first, its rounds eager until their
    graphs are captured and target-only until the drafter's costs are known.

    `remote_drafter`: the config of a drafter that another process will serve (it is attached
    later); the verify graphs take its drafts from the host. Its KV pool, the same number of
    blocks, is counted in the sizing when it lives on this GPU (`remote_drafter_kv_here`), not
    when the drafter has a GPU of its own; so are its weights' `remote_drafter_bytes`, which
    that process may not have loaded yet.

    With `config.tensor_parallel_size` > 1 the other ranks' processes start here and `target`
    becomes rank 0's shard (`tensor_parallel`); they stop if the engine cannot be built."""
    tp = launch(config, target) if config.tensor_parallel_size > 1 else None
    try:
        return _assemble(config, target, drafter, tokenizer, eos_token_ids, remote_drafter, remote_drafter_kv_here,
                         remote_drafter_bytes, tp, defer_warm_up)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def _assemble(config: EngineConfig, target: TargetModel, drafter: DFlashDraftModel | None, tokenizer,
              eos_token_ids: set[int] | frozenset[int], remote_drafter: DFlashDraftConfig | None,
              remote_drafter_kv_here: bool, remote_drafter_bytes: int, tp: TensorParallel | None,
              defer_warm_up: bool) -> Engine:
    device, dtype = target.device, target.dtype
    t_layout = TargetRunner.kv_layout(target)
    per_block = KVPool.layout_bytes_per_block(t_layout, config.kv_block_size, dtype)
    draft_cfg = drafter.config if drafter is not None else remote_drafter
    if draft_cfg is not None:
        d_layers, d_heads, d_dim = DraftRunner.kv_shape(draft_cfg)
        if drafter is not None or remote_drafter_kv_here:
            per_block += KVPool.bytes_per_block(d_layers, config.kv_block_size, d_heads, d_dim, dtype)
    lookahead = draft_cfg.block_size if draft_cfg is not None else 1
    use_graphs = config.cuda_graphs and device.type == "cuda"
    if use_graphs and tp is not None:
        # The followers would have to replay the same graphs in step: not built yet.
        log.warning("cuda_graphs: no CUDA graphs with tensor_parallel_size=%d (not captured over the collectives "
                    "yet): every forward runs eagerly", tp.world)
        use_graphs = False
    # CUDA graphs pad small batches with rows that write into these reserved scratch blocks.
    scratch = -(-lookahead // config.kv_block_size) if use_graphs else 0
    max_len = config.max_model_len or int(getattr(target.config, "max_position_embeddings", 0) or 32768)
    # A sequence holds its tokens plus a round's lookahead (a chained round: two).
    usable = config.max_num_seqs * -(-(max_len + 2 * lookahead) // config.kv_block_size) + scratch
    blocks = num_kv_blocks(config, device, per_block, usable=usable, reserved=remote_drafter_bytes)
    window_slots = 0
    window = KVPool.window_of(t_layout)
    if window is not None:  # the sliding-window layers' K/V in window slots, where that holds more
        window_slots = window_slots_for(window, config.kv_block_size, config.max_num_seqs, lookahead,
                                        config.max_prefill_tokens)
        slot_bytes = KVPool.layout_bytes_per_block(t_layout, config.kv_block_size, dtype, windowed=True)
        windowed_blocks = num_kv_blocks(config, device, per_block - slot_bytes, usable=usable,
                                        reserved=(window_slots + scratch) * slot_bytes + remote_drafter_bytes)
        if window_slots + scratch < windowed_blocks:
            log.info("KV cache: sliding-window layers (window %d) in %d window slots", window, window_slots)
            blocks, per_block = windowed_blocks, per_block - slot_bytes
        else:
            window_slots = 0
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", blocks, config.kv_block_size, blocks * per_block / 2**30)
    if blocks <= scratch:
        raise ValueError(f"num_kv_blocks={blocks} is too small; need more than {scratch}")
    pool, allocator = allocate_target_kv(t_layout, blocks, scratch, config.kv_block_size, window_slots, dtype, device)
    # A round chained after one not yet read may start a whole block further on (Engine.step).
    max_positions = max_len + 2 * lookahead
    if tp is not None:
        tp.send_setup(PoolGeometry(blocks, scratch, config.kv_block_size, window_slots, max_positions))
    runner = target_runner(config.target_impl, target, pool, max_positions=max_positions,
                           deterministic=config.deterministic, tp=tp)
    proposer = None
    if drafter is not None:
        draft_pool = KVPool.allocate(d_layers, blocks, config.kv_block_size, d_heads, d_dim, dtype, device)
        proposer = DraftRunner(drafter, target, draft_pool, max_positions=max_positions)
    # Deferred, a drafter here is attached once its round costs are known (`attach_when_measured`).
    engine = Engine(runner, None if defer_warm_up else proposer, allocator, config, tokenizer=tokenizer,
                    eos_token_ids=eos_token_ids, max_model_len=max_len)
    if use_graphs:
        t0 = time.perf_counter()
        engine.graphs = RoundGraphs(
            runner, proposer, block=lookahead, kv_block_size=config.kv_block_size,
            max_blocks=-(-max_positions // config.kv_block_size),
            scratch_blocks=list(range(blocks - scratch, blocks)),
            buckets=tuple(sorted({b for b in DEFAULT_BUCKETS if b < config.max_num_seqs} | {config.max_num_seqs})),
            external_drafts=remote_drafter is not None,
            k_buckets=k_buckets(lookahead, config.num_speculative_tokens_per_batch_size) if draft_cfg else None,
            capture_now=not defer_warm_up,
        )
        captured = "deferred" if defer_warm_up else f"captured in {time.perf_counter() - t0:.1f} s"
        log.info("round graphs %s (batch sizes %s, k %s)", captured, engine.graphs.buckets, engine.graphs.k_buckets)
        most = min(config.prefill_graph_tokens, config.max_prefill_tokens)
        token_buckets = tuple(b for b in TOKEN_BUCKETS if b <= most)
        if token_buckets:
            t0 = time.perf_counter()
            engine.prefill_graphs = PrefillGraphs(
                runner, proposer, kv_block_size=config.kv_block_size, max_blocks=engine.graphs.max_blocks,
                scratch_slot=(blocks - scratch) * config.kv_block_size, device=device, token_buckets=token_buckets,
                chunk_buckets=tuple(b for b in CHUNK_BUCKETS if b <= config.max_num_seqs),
                capture_now=not defer_warm_up,
            )
            captured = "deferred" if defer_warm_up else f"captured in {time.perf_counter() - t0:.1f} s"
            log.info("prefill graphs %s (tokens %s)", captured, token_buckets)
    if config.round_costs_dir != "":
        engine.round_cost_cache = RoundCostCache(
            Path(config.round_costs_dir) if config.round_costs_dir else cache_dir() / "round-costs",
            {"target": model_shape(target.config.to_dict()),
             "drafter": model_shape(draft_cfg.to_dict()) if draft_cfg is not None else None,
             "engine": {k: v for k, v in config.to_dict().items() if k not in NOT_IN_KEY},
             "dtype": str(dtype), "max_model_len": max_len, **machine(device)})
    if defer_warm_up and proposer is not None:
        engine.attach_when_measured(proposer)  # target-only until then, where they are to measure
    else:
        engine.measure_round_costs()  # a drafter in another process: once it is attached
    if device.type == "cuda":  # the sampling and acceptance kernels compiled now, not in a request's first step
        ks = engine.speculation.ks  # the rounds it serves first: AR alone until a drafter is attached
        warm_sample_race(target.lm_head.weight.shape[0], dtype, device, [k + 1 for k in ks], config.max_num_seqs)
        warm_accept_round(device, ks)
    return engine
