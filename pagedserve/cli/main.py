"""`pagedserve` command line: one sub-command per module in this package.

Each sub-command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. Add a module to SUBCOMMANDS to expose it.
"""

from __future__ import annotations

import argparse
import functools
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):  # often a vLLM flag pagedserve does not have
            message += ("\n(`pagedserve COMMAND --help` lists each command's flags, serve's last section the vLLM "
                        "flags taken without effect; any other flag is refused, never ignored)")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedserve",
        description="Self-hosted LLM inference server: paged KV cache, continuous batching, OpenAI API.",
    )
    from pagedserve import __version__

    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    # No prefix matching of flags (argparse's allow_abbrev): `--config` read as `--config-format`, a flag added
    # later could change what an abbreviation means. vLLM's parser does not abbreviate either.
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND",
                                       parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    for name in SUBCOMMANDS:
        importlib.import_module(f"pagedserve.cli.{name}").register(subparsers)
    return parser


def option_dests(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """Each sub-command's option strings (`-tp`, `--tensor-parallel-size`, `--no-enable-prefix-caching`, ...) ->
    their argparse action (the setting they set, the values they take), so a --config file knows which of its keys
    the command line gave already, and where its positional model is."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {option: action for action in sub._actions for option in action.option_strings}
            for name, sub in subparsers.choices.items()}


def main(argv: list[str] | None = None) -> int:
    from pagedserve.cli.argv import normalize

    parser = build_parser()
    args = parser.parse_args(normalize(sys.argv[1:] if argv is None else list(argv), option_dests(parser)))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
