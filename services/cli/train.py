"""`dflash train`: train a DFlash drafter for a target (services/training)."""

from __future__ import annotations

import argparse
import sys

from dflash_serve.services.cli.flags import auto_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="train a DFlash drafter for a target: regenerate answers with the target, "
                                          "train, write a z-lab checkpoint (dflash-spec §4)")
    parser.add_argument("--target", required=True, help="HF causal LM folder or hub repo id")
    parser.add_argument("--target-revision", help="the target's hub commit or tag (default: the repo's default branch)")
    parser.add_argument("--output", required=True, help="folder for the checkpoint, training state, log and data")
    parser.add_argument("--stage", choices=["all", "data", "train"], help="data: only regenerate answers; "
                        "train: only train on the answers already there; all (default): both")
    data = parser.add_argument_group("data")
    data.add_argument("--prompts", help="comma-separated prompt sets, NAME, NAME:COUNT or NAME[START:STOP] each: sharegpt, stdlib, sitepackages, "
                                        "gsm8k, mbpp, humaneval, math500, alpaca, spec-bench, or a .jsonl file with 'prompt' "
                                        "(default sharegpt,gsm8k,mbpp)")
    data.add_argument("--data-dir", help="the bench-data folder (default ../shared/bench-data)")
    data.add_argument("--answers", help="the regenerated answers, JSON lines (default OUTPUT/answers.jsonl)")
    data.add_argument("--max-new-tokens", type=int, help="answer length cap when regenerating (default 512)")
    data.add_argument("--gen-temperature", type=float, help="0 (default): greedy answers, as greedy serving sees")
    data.add_argument("--gen-batch", type=int, help="sequences decoded at once (default 256)")
    data.add_argument("--samples-per-prompt", type=int, help="answers per prompt (default 1); more need "
                      "--gen-temperature > 0, and a greedy run's answers count as each prompt's first")
    data.add_argument("--gen-max-minutes", type=float, help="stop regenerating after this long; run again to finish")
    model = parser.add_argument_group("drafter (a resumed run keeps its own)")
    model.add_argument("--block-size", type=int, help="default 16")
    model.add_argument("--num-layers", type=int, help="draft layers (default 2)")
    model.add_argument("--num-features", type=int, help="target layers fed to the drafter (default: --num-layers)")
    model.add_argument("--target-layer-ids", help="comma-separated; default: the spec's rule for --num-features")
    model.add_argument("--intermediate-size", type=int, help="MLP width (default: the target's)")
    model.add_argument("--mask-token-id", type=int, help="default: an unused embedding row or spare special token")
    model.add_argument("--init-from", help="start from this drafter checkpoint (folder or hub repo id), e.g. to "
                                           "train a served drafter further on new data; its architecture wins")
    model.add_argument("--init-from-revision", help="the --init-from drafter's hub commit or tag")
    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--gamma", type=float, help="position-weight decay (default 7 for B=16, 5 for B=10, 4 for B=8)")
    opt.add_argument("--lr", type=float, help="peak AdamW learning rate (default 6e-4)")
    opt.add_argument("--warmup-ratio", type=float, help="default 0.04, then cosine to 0")
    opt.add_argument("--grad-clip", type=float, help="default 1.0")
    opt.add_argument("--anchors", type=int, help="blocks per sequence, re-drawn every epoch (default 64)")
    opt.add_argument("--max-seq-len", type=int, help="prompt + answer tokens (default 2048)")
    opt.add_argument("--batch-size", type=int, help="sequences per step (default 16)")
    opt.add_argument("--epochs", type=float, help="default 6")
    opt.add_argument("--max-minutes", type=float, help="training-time budget; the schedule ends at whichever of "
                                                        "epochs or time runs out first")
    opt.add_argument("--stop-after-steps", type=int, help="end this invocation after N steps; --resume continues")
    ev = parser.add_argument_group("held-out tau (the saved checkpoint driving the engine, greedy)")
    ev.add_argument("--eval-every", type=int, help="steps between checkpoint + tau (default 500; 0: at the end)")
    ev.add_argument("--eval-prompts", type=int, help="how many prompts (default 32)")
    ev.add_argument("--eval-set", help="a prompt set to measure on (e.g. humaneval); default: prompts held out "
                                       "from the training data")
    ev.add_argument("--eval-max-tokens", type=int, help="default 256")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output (its saved settings win)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", default=auto_device())
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                        help="auto (default): bf16 autocast on GPU, float32 on CPU")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from dflash_serve.services.models import CheckpointError, TargetLoadError
    from dflash_serve.services.training import TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for name in ("prompts", "target_layer_ids"):
        if name in values:
            values[name] = tuple(int(x) if name == "target_layer_ids" else x for x in values[name].split(","))
    try:
        train(TrainConfig(**values))
    except (ValueError, CheckpointError, TargetLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
