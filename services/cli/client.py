"""`dflash client`: stream one completion from a running server over gRPC."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("client", help="stream a completion from a running server")
    parser.add_argument("--address", default="127.0.0.1:9000")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--api-key", help="sent as `authorization: Bearer KEY` (default: $DFLASH_API_KEY)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from dflash_serve.services.client import stream_completion

    sampling = {k: v for k, v in (("temperature", args.temperature), ("max_tokens", args.max_tokens),
                                   ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed)) if v is not None}
    request = {"chat": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    api_key = args.api_key or os.environ.get("DFLASH_API_KEY")
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    last = None
    try:
        for response in stream_completion(args.address, sampling=sampling, timeout=args.timeout, metadata=metadata,
                                          **request):
            print(response.text, end="", flush=True)
            last = response
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print()
    if last is not None and last.HasField("spec_stats"):
        stats = last.spec_stats
        print(f"-- {last.usage.completion_tokens} tokens; tau {stats.mean_acceptance_length:.2f} over "
              f"{stats.num_drafts} rounds", file=sys.stderr)
    return 0
