"""`dflash inspect`: load a z-lab-format drafter, describe it, and check it against a target."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("inspect", help="load a z-lab-format drafter, describe it, check it against a target")
    parser.add_argument("drafter", help="drafter folder or hub repo id (e.g. z-lab/Qwen3-8B-DFlash-b16)")
    parser.add_argument("--target", help="target model folder or hub repo id to check compatibility with")
    parser.add_argument("--revision", help="hub revision of the drafter (pin it: z-lab retrains repos in place)")
    parser.add_argument("--target-revision", help="hub revision of --target")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dflash_serve.services.models import CheckpointError, TargetLoadError, TargetModel, load_drafter

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
        import torch

        try:
            target = TargetModel.from_pretrained(args.target, cfg.target_layer_ids, dtype=torch.float32,
                                                 revision=args.target_revision)
            drafter.check_target(target)
        except (TargetLoadError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"target           {args.target}: {target.num_layers} layers, {target.embedding_rows} embedding rows - compatible")
    return 0
