"""Request bodies of the OpenAI-compatible API (pydantic). Fields OpenAI or vLLM define that pagedserve cannot
honour are refused by name when set (`_REFUSED`); other unknown fields are logged once and ignored, as OpenAI
clients send extras."""

from __future__ import annotations

import logging
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedserve.exceptions import InvalidRequestError
from pagedserve.sampling_params import MAX_INT64, BeamSearchParams, SamplingParams
from pagedserve.structured.params import StructuredOutputsParams


logger = logging.getLogger(__name__)

# Fields OpenAI or vLLM define that pagedserve does not honour -> their value with no effect (None: left out; a
# tuple: any of those). A request that sets another value gets a 400 naming the field, never output that ignores it.
_REFUSED: dict[str, Any] = {
    "logits_processors": None,
    "mm_processor_kwargs": None, "kv_transfer_params": None, "vllm_xargs": None, "audio": None,
    "modalities": (None, ["text"]), "web_search_options": None, "documents": None, "prompt_embeds": None,
    "structural_tag": None, "repetition_detection": None, "function_call": (None, "none", "auto"),
}
_REFUSED_WHY = {"modalities": "text only", "audio": "text only", "documents": "give the documents in the messages",
                "prompt_embeds": "prompts are text or token ids",
                "structural_tag": "vLLM's former field: give structured_outputs {\"structural_tag\": ...}",
                "function_call": "OpenAI's deprecated form of tool_choice: give tools and tool_choice",
                "chat_template": "a template from a request is not run: start the server with "
                                 "--trust-request-chat-template to allow it, or give the template with --chat-template"}
# Fields OpenAI or vLLM define that change nothing pagedserve generates: taken without a word.
_ACCEPTED_EXTRAS = frozenset({"store", "metadata", "service_tier", "prediction"})
# OpenAI's reasoning_effort values; the chat template gets it as a variable (vLLM's reasoning models read it)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
_WARNED: set[str] = set()  # unknown field names logged so far (at most _MAX_WARNED: clients choose the names)
_MAX_WARNED = 64


def refused_field(name: str) -> InvalidRequestError:
    """The 400 for a field OpenAI or vLLM define that pagedserve does not honour, saying what to do instead."""
    return InvalidRequestError(f"{name} is not supported by this server ({_REFUSED_WHY.get(name, 'leave it out')})",
                               param=name)


def generation_prompt(req: ChatCompletionRequest | TokenizeRequest) -> bool:
    """Whether the rendered chat ends with the assistant's generation prompt. continue_final_message leaves the
    final message open instead; asking for both is refused, as vLLM does (add_generation_prompt defaults to true,
    so only a request that sets it to true is)."""
    if not req.continue_final_message:
        return req.add_generation_prompt
    if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                                  "add_generation_prompt to false to continue the final message",
                                  param="continue_final_message")
    return False


class _Request(BaseModel):
    """A request body (or a part of one) whose explicit nulls on fields that cannot be null mean the default."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_nulls(cls, data: Any) -> Any:
        return _nulls_as_defaults(cls, data)


class StreamOptions(_Request):
    include_usage: bool = True  # vLLM's default: `"stream_options": {}` asks for the usage chunk
    continuous_usage_stats: bool = False


def _nulls_as_defaults(model: type[BaseModel], data: Any) -> Any:
    """A request body without the explicit nulls of fields that cannot be null: OpenAI's API and vLLM take
    `"n": null`, `"stream": null`, ... as the default (a client that writes every field sends them). A field that
    may be null keeps it (completions' `"max_tokens": null`: as much as the context leaves, not the default 16)."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if not (v is None and k in model.model_fields and not _nullable(model, k))}


def _nullable(model: type[BaseModel], name: str) -> bool:
    field_info = model.model_fields[name]
    return field_info.default is None or type(None) in typing.get_args(field_info.annotation)


class _SamplingFields(_Request):
    """Sampling fields shared by completions and chat: OpenAI's names plus vLLM's extras."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response's id ({prefix}-{request_id}); the engine's ids add a suffix
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: words never generated (SamplingParams.bad_words)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last N tokens (-1: max_model_len)
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only with the same salt
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs' tokens as "token_id:N" (None: the server's)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids in the response
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower is served first
    use_beam_search: bool = False  # vLLM's: n is the beam width (pagedserve/beam_search.py)
    length_penalty: float = 1.0  # vLLM's: beam search ranks by cumulative logprob / length ** length_penalty

    def check_fields(self, refused: dict[str, Any]) -> None:
        """A 400 naming a field OpenAI or vLLM define that pagedserve does not honour, where the request sets it
        to anything but its no-effect value (`refused`: name -> that value; also `_REFUSED`); other unknown
        fields are logged once each and ignored, as vLLM does."""
        extra = self.model_extra or {}
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise InvalidRequestError("length_penalty applies to beam search only: set use_beam_search",
                                      param="length_penalty")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        for name, inert in {**_REFUSED, **refused}.items():
            value = extra.get(name, getattr(self, name, inert))
            if value != inert and not (isinstance(inert, tuple) and value in inert):
                raise refused_field(name)
        for name in sorted(set(extra) - set(_REFUSED) - set(refused) - _ACCEPTED_EXTRAS - {"chat_template"}):
            name = name[:100]  # the client chooses it: a 2 MB name was a 2 MB log line, kept in _WARNED too
            if name not in _WARNED and len(_WARNED) < _MAX_WARNED and not name.startswith("guided_"):
                _WARNED.add(name)
                logger.warning("request field %r is not one pagedserve knows; it is ignored (logged once)", name)

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """use_beam_search's settings (n beams); a 400 naming a field that beam search would not honour."""
        unused = {"stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids),
                  "logit_bias": bool(self.logit_bias), "presence_penalty": self.presence_penalty != 0,
                  "frequency_penalty": self.frequency_penalty != 0, "min_tokens": self.min_tokens != 0,
                  "repetition_penalty": self.repetition_penalty not in (None, 1.0),
                  "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
                  "prompt_logprobs": getattr(self, "prompt_logprobs", None) is not None,
                  "echo": bool(getattr(self, "echo", False)),
                  "response_format" if self.response_format else "structured_outputs":
                      self.structured_params() is not None}
        for name, is_set in unused.items():
            if is_set:
                raise InvalidRequestError(f"{name} cannot be combined with use_beam_search: beam search ranks whole "
                                          "sequences by their log-probabilities", param=name)
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    temperature=0.0 if self.temperature is None else self.temperature,
                                    length_penalty=self.length_penalty,
                                    include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as exc:
            param = "n" if "beam_width" in str(exc) else str(exc).split(" ", 1)[0]
            raise InvalidRequestError(str(exc).replace("beam_width", "n"), param=param) from None

    def structured_params(self) -> StructuredOutputsParams | None:
        """The grammar the output must match, from response_format or structured_outputs (400 for both)."""
        old = sorted(k for k in (self.model_extra or {}) if k.startswith("guided_"))
        if old:  # ignoring them would silently return unconstrained text
            kinds = {f"guided_{kind}": kind for kind in ("json", "regex", "choice", "grammar")}
            name = next((key for key in old if key in kinds), old[0])  # the one that asks for a grammar
            raise InvalidRequestError(f"{name} is vLLM's former name; use structured_outputs, e.g. "
                                      f"{{\"structured_outputs\": {{\"{kinds.get(name, 'json')}\": ...}}}}",
                                      param=name)
        if self.structured_outputs is not None and self.response_format is not None:
            if StructuredOutputsParams.from_response_format(self.response_format) is not None:
                raise InvalidRequestError("give either response_format or structured_outputs, not both",
                                          param="structured_outputs")
        if self.structured_outputs is not None:
            return StructuredOutputsParams.from_request(self.structured_outputs)
        if self.response_format is not None:
            return StructuredOutputsParams.from_response_format(self.response_format)
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises InvalidRequestError naming the field for values out of range. `defaults`: the server's sampling
        defaults (--generation-config) for the fields this request leaves out; else SamplingParams' own."""
        defaults = defaults or {}

        def pick(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,  # keys checked by SamplingParams
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_params(), allowed_token_ids=self.allowed_token_ids,
            cache_salt=self.cache_salt, spaces_between_special_tokens=self.spaces_between_special_tokens,
            priority=self.priority, bad_words=self.bad_words)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (etc.) before a text prompt
    logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    prompt_logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    # at most --max-logprobs; le: a bigger one was refused as the engine's `logprobs` (QA of 12-07)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_INT64)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's: the template already writes BOS; True adds the tokenizer's too
    prompt_logprobs: int | None = None  # vLLM's: the rendered prompt's logprobs, in the (non-streamed) response
    reasoning_effort: ReasoningEffort | None = None  # OpenAI's; the chat template's variable (serving._template_kwargs)
    best_of: int | None = Field(default=None, ge=1)  # vLLM's; only best_of == n is served (check_best_of)
    echo: bool = False  # vLLM's: the final message's text before the reply where the reply continues it


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages with the chat fields that shape their prompt (tools included)."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template's own)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None  # as chat's
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Request):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None  # vLLM's: None is the model's own choice
    add_special_tokens: bool = True  # vLLM's: False embeds a text without the tokenizer's [CLS]/[SEP]
    user: str | None = None


class ScoreRequest(_Request):
    """vLLM's /score: text_1 (one text, or as many as text_2) against text_2; also its newer names queries and
    documents. Embedding models score a pair by cosine similarity."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None

    def sides(self) -> tuple[list[str], list[str], tuple[str, str]]:
        """(left texts, right texts, their field names); a 400 for a missing side or mixed names."""
        if self.queries is not None or self.documents is not None:
            if self.text_1 is not None or self.text_2 is not None:
                raise InvalidRequestError("give text_1 and text_2, or queries and documents, not both", param="text_1")
            left, right, names = self.queries, self.documents, ("queries", "documents")
        else:
            left, right, names = self.text_1, self.text_2, ("text_1", "text_2")
        for value, name in zip((left, right), names):
            if value is None:
                raise InvalidRequestError(f"{name} is required", param=name)
        return ([left] if isinstance(left, str) else list(left), [right] if isinstance(right, str) else list(right),
                names)


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Request):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents ranked by their score against the query."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True  # Jina's and Cohere's: False leaves each result's document out
    truncate_prompt_tokens: int | None = None
    user: str | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ResponsesRequest(_Request):
    """OpenAI's Responses API (POST /v1/responses), as far as a text model can answer it; serving_responses.py
    turns it into a chat request. Other fields pass through as the chat route's (vLLM's sampling extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
