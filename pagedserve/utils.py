"""vLLM's `vllm.utils` names that example scripts import."""

from __future__ import annotations

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser for scripts (EngineArgs.add_cli_args(parser) fills it); pagedserve's flags also take
    underscores (--max_model_len) on its own commands."""
