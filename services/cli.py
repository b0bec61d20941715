"""`dflash` command line."""

from __future__ import annotations

import argparse
import sys

import torch


def _inspect(args: argparse.Namespace) -> int:
    from services.models import CheckpointError, TargetLoadError, TargetModel, load_drafter

    try:
        drafter = load_drafter(args.drafter, revision=args.revision)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = drafter.config
    params = sum(p.numel() for p in drafter.parameters())
    kinds = ", ".join(
        f"{i}:{'swa' if cfg.layer_window(i) else 'full'}/{'causal' if cfg.layer_is_causal(i) else 'bidir'}"
        for i in range(cfg.num_hidden_layers)
    )
    print(f"drafter          {args.drafter}")
    print(f"parameters       {params / 1e6:.1f} M ({cfg.dtype})")
    print(f"block size       {cfg.block_size} (drafts {cfg.block_size - 1} tokens per round)")
    print(f"mask token id    {cfg.mask_token_id}")
    print(f"target layers    {list(cfg.target_layer_ids)} (F={cfg.num_features})")
    print(f"hidden size      {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim}")
    print(f"layers           {kinds}" + (f" (window {cfg.sliding_window})" if cfg.sliding_window else ""))
    print(f"rope             {cfg.rope.rope_type}, theta {cfg.rope.theta:g}")
    if args.target:
        try:
            target = TargetModel.from_pretrained(args.target, cfg.target_layer_ids, dtype=torch.float32)
            drafter.check_target(target)
        except (TargetLoadError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"target           {args.target}: {target.num_layers} layers, {target.embedding_rows} embedding rows - compatible")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash speculative decoding server")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="load a z-lab-format drafter, describe it, check it against a target")
    inspect.add_argument("drafter", help="drafter folder or hub repo id (e.g. z-lab/Qwen3-8B-DFlash-b16)")
    inspect.add_argument("--target", help="target model folder or hub repo id to check compatibility with")
    inspect.add_argument("--revision", help="hub revision of the drafter (pin it: z-lab retrains repos in place)")
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
