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


def _generate(args: argparse.Namespace) -> int:
    from services.config import EngineConfig
    from services.engine.loader import build_engine
    from services.engine.sampling import SamplingParams
    from services.models import CheckpointError, TargetLoadError

    config = EngineConfig(
        target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype, cuda_graphs=not args.eager
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    try:
        params.validate(max_tokens_limit=config.max_tokens_limit)
        engine = build_engine(config)
    except (CheckpointError, TargetLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if tok is None:
        print("error: the target has no tokenizer; dflash generate needs one to read --prompt", file=sys.stderr)
        return 2
    if tok.chat_template and not args.raw:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt_ids = tok.encode(args.prompt)
    last = None
    for out in engine.stream(list(prompt_ids), params):
        print(out.new_text, end="", flush=True)
        last = out
    print()
    if last.error:
        print(f"error: {last.error}", file=sys.stderr)
        return 1
    stats = last.stats
    print(f"-- {last.num_output_tokens} tokens, finish: {last.finish_reason.value}", file=sys.stderr)
    if args.drafter:
        accepted = ", ".join(f"{c / stats.rounds:.2f}" for c in stats.accepted_per_position) if stats.rounds else "-"
        print(f"-- tau (mean accepted length incl. bonus) {stats.mean_acceptance_length:.2f} over {stats.rounds} rounds",
              file=sys.stderr)
        print(f"-- acceptance per draft position: {accepted}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash speculative decoding server")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="load a z-lab-format drafter, describe it, check it against a target")
    inspect.add_argument("drafter", help="drafter folder or hub repo id (e.g. z-lab/Qwen3-8B-DFlash-b16)")
    inspect.add_argument("--target", help="target model folder or hub repo id to check compatibility with")
    inspect.add_argument("--revision", help="hub revision of the drafter (pin it: z-lab retrains repos in place)")
    inspect.set_defaults(run=_inspect)

    gen = sub.add_parser("generate", help="run the engine in-process on one prompt and print text and acceptance")
    gen.add_argument("--target", required=True, help="target model folder or hub repo id")
    gen.add_argument("--drafter", help="DFlash drafter folder or hub repo id (omit: target-only decoding)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--eager", action="store_true", help="no CUDA graphs")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
