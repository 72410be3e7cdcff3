"""`pagedserve` command line: one sub-command per module in this package.

Each sub-command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. Add a module to SUBCOMMANDS to expose it.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import os
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


_UNRECOGNIZED_HINT = ("(`pagedserve COMMAND --help` lists each command's flags, serve's last section the vLLM flags "
                      "taken without effect; any other flag is refused, never ignored)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):  # often a vLLM flag pagedserve does not have
            message += "\n" + _UNRECOGNIZED_HINT
        super().error(message)


class _CommandParser(argparse.ArgumentParser):
    """A sub-command's parser. Its errors show one usage line, not argparse's whole usage (serve's runs to 130
    lines above the message), and flags are never matched by a prefix of their name (argparse's allow_abbrev:
    `--config` read as `--config-format`; a flag added later could change what an abbreviation means; vLLM's parser
    does not abbreviate either)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"usage: {self.prog} [flags]   (`{self.prog} --help` lists them)\n{self.prog}: error: {message}\n")

    def unrecognized(self, extras: list[str]) -> None:
        """The error for flags this command does not have, each with the closest flag it has, if one is close."""
        options = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        notes = []
        for extra in extras:
            name = extra.split("=", 1)[0]
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.8) if name.startswith("--") else []
            if close:
                notes.append(f"{name}: did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}\n" + "".join(n + "\n" for n in notes)
                   + _UNRECOGNIZED_HINT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedserve",
        description="Self-hosted LLM inference server: paged KV cache, continuous batching, OpenAI API.",
    )
    from pagedserve import __version__

    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
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
    args, extras = parser.parse_known_args(normalize(sys.argv[1:] if argv is None else list(argv),
                                                     option_dests(parser)))
    if extras:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = subparsers.choices.get(getattr(args, "command", None) or "")
        if isinstance(command, _CommandParser):
            command.unrecognized(extras)
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C in generate, run-batch or bench: a line, not a traceback (serve: its own)
        print(f"pagedserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pagedserve watch | head -1`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EIO):
            raise
        print(f"pagedserve: error: the output could not be written ({exc.strerror})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
