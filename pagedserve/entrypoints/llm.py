"""The offline API, like vLLM's: LLM(model, ...).generate(prompts, sampling_params) / .chat(messages)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in input order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_ids.append(self.engine.add_request(None, prompt, params))
        except Exception:
            self.engine.abort_request(request_ids)  # all or nothing: queue none of this call's prompts
            raise
        return self._run(request_ids)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)
                   for c in conversations]
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))
        # The template already holds any BOS token: do not add special tokens again.
        return tokenizer.encode(text, add_special_tokens=False)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int
                    ) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one or one per prompt")
    return params
