"""`dflash generate`: the engine in this process on one prompt; prints the text and the acceptance."""

from __future__ import annotations

import argparse
import sys

from dflash_serve.services.cli.flags import add_engine_flags, auto_device, given_config_flags, model_pair
from dflash_serve.services.config import EngineConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="run the engine in-process on one prompt and print text and acceptance")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int)
    add_engine_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dflash_serve.services.engine.loader import build_engine
    from dflash_serve.services.engine.sampling_params import SamplingParams
    from dflash_serve.services.models import CheckpointError, TargetLoadError
    from dflash_serve.services.models.default_pair import DefaultPairError

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    try:
        flags = given_config_flags(args, EngineConfig)
        config = EngineConfig.load(flags, defaults={"device": auto_device(), **model_pair(flags)})
        params.validate(max_tokens_limit=config.max_tokens_limit)
        engine = build_engine(config)
    except (CheckpointError, TargetLoadError, ValueError, DefaultPairError) as err:
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
    if config.drafter:
        accepted = ", ".join(f"{c / stats.rounds:.2f}" for c in stats.accepted_per_position) if stats.rounds else "-"
        print(f"-- tau (mean accepted length incl. bonus) {stats.mean_acceptance_length:.2f} over {stats.rounds} rounds",
              file=sys.stderr)
        print(f"-- acceptance per draft position: {accepted}", file=sys.stderr)
    return 0
