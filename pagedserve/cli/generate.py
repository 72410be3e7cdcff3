"""`pagedserve generate`: offline generation from the command line (no server)."""

from __future__ import annotations

import argparse
import json
import sys

from pagedserve.cli.common import USER_FACING_ERRORS, engine_args_from_cli, fail, setup_logging
from pagedserve.engine.arg_utils import EngineArgs


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="Generate text offline (no server).")
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.add_argument("--prompt", action="append", required=True,
                        help="Prompt (repeat for a batch). With --chat it is the user message.")
    parser.add_argument("--chat", action="store_true", help="Apply the model's chat template.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup_logging()
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        engine_args = engine_args_from_cli(args)
        llm = LLM(**vars(engine_args))
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (ValueError, *USER_FACING_ERRORS) as exc:  # the plan's table was logged already
        return fail(str(exc))
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text,
                              "finish_reason": completion.finish_reason,
                              "num_prompt_tokens": len(output.prompt_token_ids),
                              "num_output_tokens": len(completion.token_ids)}, ensure_ascii=False))
        else:
            print(completion.text)
    sys.stdout.flush()
    return 0
