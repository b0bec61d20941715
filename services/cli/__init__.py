"""`dflash` command line: one module per command; flags.py generates the flags that mirror config fields."""

from __future__ import annotations

import argparse

from dflash_serve.services.cli import bench, client, fetch_default, generate, inspect, serve, train

COMMANDS = (inspect, generate, serve, client, fetch_default, bench, train)  # in the help's order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash speculative decoding server")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
