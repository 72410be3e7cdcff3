"""`pagedserve` command line: one sub-command per module in this package.

Each sub-command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. Add a module to SUBCOMMANDS to expose it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Module names under pagedserve.cli, in the order they appear in `pagedserve --help`.
SUBCOMMANDS = [
    "serve",
    "plan",
    "generate",
    "run_batch",
    "bench",
    "doctor",
    "watch",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="Self-hosted LLM inference server: paged KV cache, continuous batching, OpenAI API.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"pagedserve.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
