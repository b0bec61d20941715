"""`dflash train`: regenerate responses with the target, train a DFlash drafter on them, write a
z-lab checkpoint that the engine loads (dflash-spec §4).

The output folder holds:
    config.json, model.safetensors   the drafter in z-lab format (bfloat16): `load_drafter`, `--drafter`
    training_state.pt                float32 weights, optimizer state, step and time used (`--resume`)
    train_log.jsonl                  one line per checkpoint: step, loss, lr, held-out τ, ...
    answers.jsonl                    the target's regenerated answers (unless --answers puts them elsewhere)

Held-out τ is measured for real: the checkpoint just written is loaded with `load_drafter` and
drives the engine (paged KV, the same kernels as serving) over held-out prompts at temperature 0;
τ is the mean accepted length per round including the bonus token, averaged per prompt, then
over prompts (spec §3.1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from dflash_serve.kernels import rms_norm_reference
from dflash_serve.services.bench.prompts import DEFAULT_DATA_DIR
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import assemble_engine, eos_token_ids, resolve_dtype
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models import (
    DFlashDraftConfig,
    DFlashDraftModel,
    TargetModel,
    default_target_layer_ids,
    load_drafter,
    load_target_config,
    save_drafter,
)
from dflash_serve.services.models.checkpoint import check_state_dict, read_draft_config, read_state_dict, resolve_checkpoint
from dflash_serve.services.models.draft import RMSNorm
from dflash_serve.services.training.blocks import block_loss, default_gamma, draft_blocks
from dflash_serve.services.training.dataset import (
    KV_BLOCK,
    TrainingSet,
    fingerprint,
    read_records,
    regenerate,
    split_held_out,
)
from dflash_serve.services.training.prompts import encode_prompt, load_prompts

STATE_NAME = "training_state.pt"
LOG_NAME = "train_log.jsonl"
ANSWERS_NAME = "answers.jsonl"
STAGES = ("all", "data", "train")
SERVED_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class TrainConfig:
    target: str
    output: str
    target_revision: str | None = None  # the target's hub commit or tag (None: the default branch)
    # -- data: prompts answered by the target ---------------------------------------------------
    prompts: tuple[str, ...] = ("sharegpt", "gsm8k", "mbpp")
    data_dir: str = DEFAULT_DATA_DIR  # the bench-data folder
    answers: str | None = None  # the regenerated answers (JSON lines); default OUTPUT/answers.jsonl
    stage: str = "all"
    max_new_tokens: int = 512
    gen_temperature: float = 0.0
    gen_batch: int = 256
    samples_per_prompt: int = 1  # > 1 needs gen_temperature > 0; answer 0 keeps the prompt's key
    gen_max_minutes: float | None = None
    # -- the drafter (a fresh run; a resumed one keeps the saved architecture) -----------------
    block_size: int = 16
    num_layers: int = 2
    num_features: int | None = None  # target layers fed to fc; default num_layers (the spec's rule)
    target_layer_ids: tuple[int, ...] | None = None  # default: the spec's rule for num_features
    intermediate_size: int | None = None  # default: the target's
    mask_token_id: int | None = None  # default: see choose_mask_token_id
    init_from: str | None = None  # start from this drafter checkpoint (folder or hub id): architecture, weights
    init_from_revision: str | None = None  # its hub commit or tag (None: the default branch)
    # -- optimisation (spec §4: AdamW 6e-4, warmup 4 %, cosine, clip 1.0, bf16) ----------------
    gamma: float | None = None  # default: 7 for B=16, 5 for B=10, 4 for B=8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    anchors: int = 64  # blocks per sequence, re-drawn every epoch
    max_seq_len: int = 2048
    batch_size: int = 16
    epochs: float = 6.0
    max_minutes: float | None = None  # training-time budget over all invocations of the run
    stop_after_steps: int | None = None  # end this invocation early; --resume continues the run
    # -- held-out τ ----------------------------------------------------------------------------
    eval_every: int = 500  # steps between checkpoint + τ (0: only at the end)
    eval_prompts: int = 32
    eval_set: str | None = None  # a prompt-set spec (e.g. humaneval); default: held-out data prompts
    eval_max_tokens: int = 256
    # -- run -----------------------------------------------------------------------------------
    resume: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on GPU (autocast, float32 master weights), float32 on CPU

    def validate(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r}: choose one of {', '.join(STAGES)}")
        if self.block_size < 2 or self.num_layers < 1 or self.anchors < 1 or self.batch_size < 1:
            raise ValueError("block_size >= 2, num_layers >= 1, anchors >= 1 and batch_size >= 1 are required")
        if self.max_seq_len < 2 * self.block_size:
            raise ValueError(f"max_seq_len={self.max_seq_len} is shorter than two blocks of {self.block_size}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype={self.dtype!r}: choose auto, bfloat16 or float32 "
                             "(float16 would need loss scaling)")


# Settings that define a run: a resumed run keeps its saved values (the architecture is kept too,
# through the saved drafter config), so that it continues exactly as if never interrupted.
RUN_DEFINING = ("gamma", "lr", "warmup_ratio", "grad_clip", "anchors", "max_seq_len", "batch_size", "epochs",
                "max_minutes", "seed", "eval_prompts", "eval_set")


# -- the drafter ---------------------------------------------------------------------------------


class TrainableRMSNorm(RMSNorm):
    """RMSNorm through the plain-torch reference: the same values, with a backward pass (the fused
    Triton kernel that RMSNorm runs on CUDA has none, and would silently stop the gradients)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


def trainable_drafter(config: DFlashDraftConfig) -> DFlashDraftModel:
    drafter = DFlashDraftModel(config)
    for module in drafter.modules():
        if type(module) is RMSNorm:
            module.__class__ = TrainableRMSNorm  # same parameters and state-dict names
    return drafter


def choose_mask_token_id(tokenizer, embedding_rows: int) -> int:
    """An embedding row the drafter can own as MASK (spec §1.7; the embedding stays frozen, so any
    row works if real text never puts it in a block): the first row past the tokenizer's
    vocabulary when the table is padded (Qwen3's 151669 is exactly that), else the highest
    special (added) token that is not BOS/EOS/PAD/UNK and not produced by the chat template
    (SmolLM2: 16, `<empty_output>`)."""
    if tokenizer is None:
        raise ValueError("the target has no tokenizer to pick a mask token from: pass --mask-token-id")
    if len(tokenizer) < embedding_rows:
        return len(tokenizer)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    reserved |= set(encode_prompt(tokenizer, "hello"))
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    candidates = [i for i in special if i not in reserved and i < embedding_rows]
    if not candidates:
        raise ValueError("no unused row or spare special token in the target's vocabulary: pass --mask-token-id")
    return max(candidates)


def new_drafter_config(config: TrainConfig, tokenizer) -> DFlashDraftConfig:
    """A z-lab config.json for a fresh drafter at the target's width (spec §2.1): Qwen3-style
    layers with the target's heads, head_dim, MLP width and RoPE theta unless told otherwise."""
    t = load_target_config(config.target, config.target_revision)
    heads = t.num_attention_heads
    rows = t.vocab_size
    layer_ids = config.target_layer_ids or default_target_layer_ids(t.num_hidden_layers,
                                                                    config.num_features or config.num_layers)
    rope = getattr(t, "rope_parameters", None) or {}
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id if config.mask_token_id is not None
            else choose_mask_token_id(tokenizer, rows),
            "target_layer_ids": list(layer_ids),
        },
        "num_target_layers": t.num_hidden_layers,
        "num_hidden_layers": config.num_layers,
        "hidden_size": t.hidden_size,
        "intermediate_size": config.intermediate_size or t.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "hidden_act": "silu",
        "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta") or getattr(t, "rope_theta", None) or 1_000_000.0,
        "max_position_embeddings": t.max_position_embeddings,
        "attention_bias": False,
        "layer_types": ["full_attention"] * config.num_layers,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": rows,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": t.eos_token_id,
        "pad_token_id": t.pad_token_id,
        "dtype": str(SERVED_DTYPE).removeprefix("torch."),
    }
    return DFlashDraftConfig.from_dict(raw)


def export_drafter(drafter: DFlashDraftModel, folder: Path) -> None:
    """The z-lab checkpoint as served: the drafter's weights in bfloat16."""
    with torch.device("meta"):
        served = DFlashDraftModel(drafter.config)
    served.load_state_dict({k: v.detach().to("cpu", SERVED_DTYPE) for k, v in drafter.state_dict().items()},
                           assign=True)
    save_drafter(served, folder)


# -- schedule, checkpoints, τ --------------------------------------------------------------------


def lr_factor(progress: float, warmup_ratio: float) -> float:
    """Linear warmup over the first `warmup_ratio` of the run, then cosine to zero."""
    if progress < warmup_ratio:
        return progress / warmup_ratio
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup_ratio) / (1 - warmup_ratio))))


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous state intact


@torch.no_grad()
def held_out_tau(target: TargetModel, drafter_dir: Path, prompts: list[list[int]], *, max_new_tokens: int,
                 eos: set[int]) -> tuple[float, list[float]]:
    """Greedy generation with the saved drafter through the engine -> (τ, acceptance rate per
    draft position). τ is the mean of each prompt's τ, as DFlash's benchmark script reports it
    (spec §3.1); per-position acceptance is pooled over all rounds."""
    drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
    drafter.check_target(target)
    block = drafter.config.block_size
    config = EngineConfig(
        target="(training target)", drafter=str(drafter_dir), device=str(target.device), kv_block_size=KV_BLOCK,
        num_kv_blocks=sum(math.ceil((len(p) + max_new_tokens + block) / KV_BLOCK) for p in prompts) + 1,
        max_num_seqs=len(prompts), max_prefill_tokens=max(8192, max(map(len, prompts))), cuda_graphs=False,
        speculation="fixed",  # τ of the drafter's whole block, whatever would pay on this machine
    )
    engine = assemble_engine(config, target, drafter, eos_token_ids=eos)
    stats = [s.stats for s in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))]
    stats = [s for s in stats if s.rounds]
    if not stats:  # every answer ended at its first token: nothing was drafted
        return math.nan, [math.nan] * (block - 1)
    rounds = sum(s.rounds for s in stats)
    per_position = [sum(s.accepted_per_position[j] for s in stats) / rounds for j in range(block - 1)]
    return sum(s.mean_acceptance_length for s in stats) / len(stats), per_position


# -- the run -------------------------------------------------------------------------------------


def _load_tokenizer(target: str, revision: str | None):
    try:
        return AutoTokenizer.from_pretrained(target, revision=revision)
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def stop_signals():
    """While training, SIGTERM (a preempted pod, `timeout`) or Ctrl-C asks the loop to stop after
    the step in flight, so the run is checkpointed and --resume loses nothing; a second signal
    acts as usual. Yields the list the handler appends to. Only the main thread can take signals."""
    requested: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    watched = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in watched}

    def handler(signum, frame) -> None:
        requested.append(signum)
        for s, h in previous.items():
            signal.signal(s, h)
        tqdm.write(f"{signal.Signals(signum).name}: stopping after this step with a checkpoint")

    for s in watched:
        signal.signal(s, handler)
    try:
        yield requested
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _resumed(config: TrainConfig, saved: dict) -> TrainConfig:
    changed = {f: (getattr(config, f), saved[f]) for f in RUN_DEFINING if getattr(config, f) != saved[f]}
    if changed:
        print("resuming with the run's saved settings: " +
              ", ".join(f"{f}={old!r} (not {new!r})" for f, (new, old) in changed.items()))
    return dataclasses.replace(config, **{f: saved[f] for f in RUN_DEFINING})


def train(config: TrainConfig) -> Path:
    """Run the stages of `config` and return the output folder."""
    config.validate()
    out = Path(config.output)
    state_path = out / STATE_NAME
    state = None
    if state_path.exists():
        if not config.resume:
            raise ValueError(f"{out} holds a training run already: pass --resume to continue it, or another --output")
        state = torch.load(state_path, map_location="cpu")
        config = _resumed(config, state["config"])
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = _load_tokenizer(config.target, config.target_revision)
    if state:
        draft_config = DFlashDraftConfig.from_dict(state["drafter_config"])
    elif config.init_from:
        init_folder = resolve_checkpoint(config.init_from, config.init_from_revision)
        draft_config = read_draft_config(init_folder)
        print(f"starting from the drafter in {config.init_from} (its architecture; the drafter flags are ignored)")
    else:
        draft_config = new_drafter_config(config, tokenizer)
    target = TargetModel.from_pretrained(config.target, draft_config.target_layer_ids, dtype=dtype, device=device,
                                         revision=config.target_revision)
    target.model.requires_grad_(False)  # embedding and LM head included: both are shared, frozen
    eos = eos_token_ids(config.target, tokenizer, config.target_revision)
    answers = Path(config.answers) if config.answers else out / ANSWERS_NAME

    if tokenizer is None and (config.stage != "train" or config.eval_set):
        raise ValueError(f"{config.target} has no tokenizer: encoding prompts (--stage data/all, --eval-set) needs one")
    out.mkdir(parents=True, exist_ok=True)  # only now: a bad --target or --init-from leaves nothing behind

    if config.stage in ("all", "data"):
        added = regenerate(target, tokenizer, load_prompts(list(config.prompts), config.data_dir), answers,
                           eos_token_ids=eos, max_seq_len=config.max_seq_len, max_new_tokens=config.max_new_tokens,
                           temperature=config.gen_temperature, batch=config.gen_batch, seed=config.seed,
                           samples_per_prompt=config.samples_per_prompt,
                           max_minutes=config.gen_max_minutes)
        print(f"{added} new responses in {answers}")
        if config.stage == "data":
            return out

    records = read_records(answers)
    if not records:
        raise ValueError(f"no training data in {answers}: run the data stage first (--stage data or all)")
    if config.eval_set:
        train_records = records
        eval_ids = [encode_prompt(tokenizer, p.text) for p in load_prompts([config.eval_set], config.data_dir)]
        eval_ids = eval_ids[: config.eval_prompts]
    else:
        train_records, held = split_held_out(records, config.eval_prompts, config.seed)
        eval_ids = [r.prompt_ids for r in held]
    dataset = TrainingSet(train_records, config.max_seq_len)
    data_id = fingerprint(train_records)
    if state and state["data"] != data_id:
        raise ValueError(f"the training data in {answers} changed since this run started: resume needs the same data")
    gamma = config.gamma or default_gamma(draft_config.block_size)
    total_steps = max(1, math.ceil(config.epochs * dataset.steps_per_epoch(config.batch_size)))
    budget = config.max_minutes * 60 if config.max_minutes else None

    torch.manual_seed(config.seed)
    drafter = trainable_drafter(draft_config).to(device)
    drafter.check_target(target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, fused=device.type == "cuda")
    step, train_seconds = 0, 0.0
    if state:
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        step, train_seconds = state["step"], state["train_seconds"]
    elif config.init_from:
        initial = read_state_dict(init_folder)
        check_state_dict(drafter, initial, config.init_from)
        drafter.load_state_dict(initial)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def progress(steps: int) -> float:
        """Of the run after `steps`, by steps or by time, whichever runs out first (the schedule follows it)."""
        return max(steps / total_steps, train_seconds / budget if budget else 0.0)

    last: dict[str, float] = {}

    def checkpoint() -> None:
        save_state(state_path, {
            "config": dataclasses.asdict(config), "drafter_config": draft_config.to_dict(),
            "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
            "step": step, "train_seconds": train_seconds, "data": data_id,
        })
        export_drafter(drafter, out)
        entry = {"step": step, **last, "train_minutes": round(train_seconds / 60, 3)}
        if eval_ids:
            tau, per_position = held_out_tau(target, out, eval_ids, max_new_tokens=config.eval_max_tokens, eos=eos)
            last["tau"] = entry["tau"] = tau
            entry["acceptance_per_position"] = [round(a, 4) for a in per_position]
            tqdm.write(f"step {step}: held-out tau {tau:.3f} over {len(eval_ids)} prompts")
        with open(out / LOG_NAME, "a") as f:
            f.write(json.dumps(entry) + "\n")

    params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {draft_config.num_hidden_layers} layers, {params / 1e6:.2f} M parameters, block "
          f"{draft_config.block_size}, target layers {list(draft_config.target_layer_ids)}, mask id "
          f"{draft_config.mask_token_id}; {len(dataset)} training sequences, {len(eval_ids)} eval prompts")
    if step == 0 and config.eval_every:
        checkpoint()  # the untrained baseline (τ near 1) — the metric must move from there
    started_at = step
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    with stop_signals() as stop_requested:
        while (progress(step) < 1 and not stop_requested
               and (config.stop_after_steps is None or step - started_at < config.stop_after_steps)):
            t0 = time.monotonic()
            lr = config.lr * lr_factor(progress(step + 1), config.warmup_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = dataset.batch(step, config.batch_size, config.anchors, config.seed).to(device)
            with torch.no_grad(), autocast:
                _, features = target.forward_with_features(batch.input_ids, use_cache=False, logits_to_keep=1)
            with autocast:
                hidden = draft_blocks(drafter, target, batch, features)
                loss, metrics = block_loss(drafter, target, hidden, batch, gamma)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
            optimizer.step()
            step += 1
            train_seconds += time.monotonic() - t0  # metrics were read back: the GPU work is in it
            last.update(lr=lr, **metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", block_tau=f"{metrics['block_tau']:.2f}", lr=f"{lr:.1e}",
                            tau=f"{last.get('tau', math.nan):.2f}", min=f"{train_seconds / 60:.1f}")
            if config.eval_every and step % config.eval_every == 0:
                t0 = time.monotonic()
                checkpoint()
                train_seconds += time.monotonic() - t0
    bar.close()
    if not (config.eval_every and step % config.eval_every == 0 and step > started_at):
        checkpoint()
    done = "finished" if progress(step) >= 1 else f"stopped at step {step} of {total_steps}; --resume continues"
    print(f"{done}: drafter in {out} (held-out tau {last.get('tau', math.nan):.3f})")
    return out
