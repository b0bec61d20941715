"""`dflash fetch-default`: obtain the default target once, into the model cache."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("fetch-default", help="obtain the default target (SmolLM2-135M-Instruct) once into "
                                                  "$DFLASH_CACHE or ~/.cache/dflash-serve")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dflash_serve.services.models.default_pair import DefaultPairError, default_drafter, fetch_default_target, target_dir

    try:
        folder = fetch_default_target(target_dir())
    except DefaultPairError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"default target   {folder}")
    try:
        print(f"default drafter  {default_drafter()}")
    except DefaultPairError as err:
        print(f"default drafter  missing: {err}")
    return 0
