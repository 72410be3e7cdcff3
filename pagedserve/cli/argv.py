"""vLLM's command-line conveniences, applied to argv before argparse reads it (vLLM's FlexibleArgumentParser), so a
`vllm serve` command line or config file runs unchanged:

- `--max_model_len 512` is `--max-model-len 512` (underscores in a flag's name);
- `--config FILE.yaml` (serve, plan, doctor, run-batch, generate): the file's keys are flags (`max_model_len: 512`,
  `enable_prefix_caching: true`, lists for flags that take several values, a mapping as JSON), and the command
  line's own flags win, under any of their names (`-tp`, `-q`);
(Human-readable sizes, `--max-model-len 32k`, are the flag's type: engine/arg_utils.human_readable_int.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CONFIG_COMMANDS = ("serve", "plan", "doctor", "run-batch", "generate")  # the sub-commands that take serve's flags


def normalize(argv: list[str], dests: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """argv with vLLM's flag spellings turned into pagedserve's, and a --config file's flags added. `dests`: each
    sub-command's option strings -> the setting they set (cli/main.option_dests), so a setting the command line
    gives under any of its names (`-tp`, `-q`) keeps the command line's value."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return _expand_config(out, (dests or {}).get(out[0] if out else "", {}))


def _expand_config(argv: list[str], dests: dict[str, Any]) -> list[str]:
    if not argv or argv[0] not in CONFIG_COMMANDS:
        return argv
    path, rest = None, [argv[0]]
    tokens = iter(argv[1:])
    for arg in tokens:
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise _error("--config is given twice; give one file (as vLLM takes one)")
            path = next(tokens, None) if arg == "--config" else arg.split("=", 1)[1]
            if path is None:
                raise _error("--config needs a YAML file of serve's flags")
        else:
            rest.append(arg)
    if path is None:
        return argv
    def dest(option: str) -> str:
        action = dests.get(option)
        return action.dest if action is not None else option.removeprefix("--no-").removeprefix("--")

    given = {dest(arg.split("=", 1)[0]) for arg in rest if arg.startswith("-")}
    config = _read_config(path)
    model = config.pop("model", None)
    added = []
    for key, value in config.items():
        name = str(key).replace("_", "-")
        if dests and f"--{name}" not in dests:
            raise _error(f"--config {path}: {key!r} is not a flag of `pagedserve {argv[0]}` "
                             f"(no --{name}; `pagedserve {argv[0]} --help` lists them)")
        if value is None:
            raise _error(f"--config {path}: {key!r} has no value; give one or leave the key "
                             "out")
        if dest(f"--{name}") in given:
            continue  # the command line's own value wins, under any of the flag's names, as in vLLM
        added += _as_flags(name, value)
    if model is not None and not _has_model(rest, dests):
        added += ["--model", str(model)]
    return rest + added


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise _error(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise _error(f"--config {path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise _error(f"--config {path} must be a YAML mapping of flags to values, e.g. "
                         "'max_model_len: 4096'")
    return config


def _as_flags(name: str, value: Any) -> list[str]:
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    if isinstance(value, list):
        return [f"--{name}", *(str(v) for v in value)]
    if isinstance(value, dict):
        return [f"--{name}", json.dumps(value)]
    return [f"--{name}", str(value)]


def _has_model(args: list[str], dests: dict[str, Any]) -> bool:
    """A model named on the command line: `--model`, or a positional argument (where the options' actions are known,
    anywhere: `run-batch -i IN -o OUT MODEL`; else first)."""
    if "--model" in args or any(a.startswith("--model=") for a in args):
        return True
    if not dests:
        return len(args) > 1 and not args[1].startswith("-")
    index = 1
    while index < len(args):
        token = args[index]
        index += 1
        if not token.startswith("-") or token == "-":
            return True  # not an option's value: the positional
        action = dests.get(token)
        if "=" in token or action is None or action.nargs == 0:
            continue
        if action.nargs in ("+", "*"):
            while index < len(args) and not args[index].startswith("-"):
                index += 1
        else:
            index += action.nargs if isinstance(action.nargs, int) else 1
    return False


def _error(message: str) -> SystemExit:
    """A usage error as argparse reports one: the message on stderr, exit status 2."""
    print(f"pagedserve: error: {message}", file=sys.stderr)
    return SystemExit(2)
