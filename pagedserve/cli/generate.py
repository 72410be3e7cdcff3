"""`pagedserve generate`: offline generation from the command line (no server)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedserve.cli.common import USER_FACING_ERRORS, engine_args_from_cli, fail, setup_logging
from pagedserve.engine.arg_utils import EngineArgs


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="Generate text offline (no server).")
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.add_argument("--prompt", action="append", required=True,
                        help="Prompt (repeat for a batch). With --chat it is the user message.")
    parser.add_argument("--chat", action="store_true", help="Apply the model's chat template.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate at most (default: 64).")
    defaults = ("(default: the model's sampling defaults, as --generation-config and --override-generation-config "
                "give them; where those leave it out: %s)")
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy " + defaults % "0, greedy")
    parser.add_argument("--top-p", type=float, default=None, help=defaults % "1.0")
    parser.add_argument("--top-k", type=int, default=None, help=defaults % "0, off")
    parser.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    parser.set_defaults(func=run)


def _sampling_params(args: argparse.Namespace, model_defaults: dict) -> Any:
    """The model's sampling defaults (generation_config.json, --override-generation-config), then the flags given;
    greedy where neither says a temperature (as this command always was)."""
    from pagedserve.sampling_params import SamplingParams

    fields = {"temperature": 0.0, **model_defaults, "max_tokens": args.max_tokens}
    fields.update({name: getattr(args, name) for name in ("temperature", "top_p", "top_k")
                   if getattr(args, name) is not None})
    return SamplingParams(**fields)


def run(args: argparse.Namespace) -> int:
    setup_logging()
    from pagedserve.entrypoints.llm import LLM

    try:
        engine_args = engine_args_from_cli(args)
        _sampling_params(args, {})  # the flags' own values, checked before seconds of loading
        llm = LLM(**vars(engine_args))
        if llm.engine.config.model.task != "generate":
            raise ValueError(f"{engine_args.model or 'the model'} is an embedding model: it does not generate text "
                             "(serve it with `pagedserve serve` and ask /v1/embeddings)")
        params = _sampling_params(args, llm.engine.config.model.default_sampling)
        if args.chat:
            if getattr(llm.get_tokenizer(), "chat_template", None) is None:
                raise ValueError("this model's tokenizer has no chat template: leave out --chat to send the prompt "
                                 "as plain text")
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
