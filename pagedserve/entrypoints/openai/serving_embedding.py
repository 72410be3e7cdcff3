"""POST /v1/embeddings in OpenAI's format, for engines started with task "embed".

Each input becomes one engine request (PoolingParams), so inputs of one call are batched with every
other request by the scheduler's token budget. Response: {"object": "list", "data": [{"object":
"embedding", "index": i, "embedding": [...] | "<base64>"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}; base64 is the little-endian float32 bytes of the vector, as OpenAI sends it.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from pagedserve.engine.prompt_checks import check_pooling_prompt
from pagedserve.entrypoints.openai.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedserve.entrypoints.openai.serving import OpenAIServing, _merge, _Prompt, consume_unless_disconnected
from pagedserve.exceptions import InvalidRequestError, check_text
from pagedserve.outputs import PoolingRequestOutput
from pagedserve.pooling_params import PoolingParams, check_truncated, tokenize_for_pooling
from pagedserve.scoring import check_pairs, cosine_scores

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class OpenAIServingEmbedding(OpenAIServing):
    """The serving layer of an embedding model: /v1/embeddings, plus /tokenize and /detokenize."""

    without_chat_template = "give the text as `prompt` (/tokenize) or `input` (/v1/embeddings)"

    async def create_embedding(self, req: EmbeddingRequest, raw: Request) -> JSONResponse:
        self.check_model(req.model)
        if (req.model_extra or {}).get("priority") not in (None, 0):
            raise InvalidRequestError("priority is not supported for embeddings (they are scheduled as they come)",
                                      param="priority")
        params = self._pooling_params(req)
        prompts = await self._embedding_prompts(req.input, params.truncate_prompt_tokens,
                                                add_special_tokens=req.add_special_tokens)
        request_id = f"embd-{uuid.uuid4().hex}"
        vectors = await self._embed(request_id, prompts, params, raw, [(f"input {i}", "input")
                                                                        for i in range(len(prompts))])
        data = [{"object": "embedding", "index": i, "embedding": encode_embedding(vector, req.encoding_format)}
                for i, vector in enumerate(vectors)]
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": self.served_model_names[0], "data": data,
                             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}})

    async def create_score(self, req: ScoreRequest, raw: Request) -> JSONResponse:
        """vLLM's /score for an embedding model: each pair's cosine similarity (scoring.py's pairing rule)."""
        self.check_model(req.model)
        left, right, names = req.sides()
        check_pairs(left, right, names)
        request_id = f"score-{uuid.uuid4().hex}"
        scores, num_prompt = await self._scores(request_id, left, right, names, req.truncate_prompt_tokens, raw)
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": self.served_model_names[0],
                             "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}})

    async def create_rerank(self, req: RerankRequest, raw: Request) -> JSONResponse:
        """vLLM's /rerank for an embedding model: documents by cosine similarity to the query, best first,
        the first top_n (0: all)."""
        self.check_model(req.model)
        documents = req.document_texts()
        check_pairs([req.query], documents, ("query", "documents"))
        request_id = f"rerank-{uuid.uuid4().hex}"
        scores, num_prompt = await self._scores(request_id, [req.query], documents, ("query", "documents"),
                                                req.truncate_prompt_tokens, raw)
        order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
        results = [{"index": i, **({"document": {"text": documents[i]}} if req.return_documents else {}),
                    "relevance_score": scores[i]} for i in order[:req.top_n or len(order)]]
        return JSONResponse({"id": request_id, "model": self.served_model_names[0], "results": results,
                             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}})

    async def _scores(self, request_id: str, left: list[str], right: list[str], names: tuple[str, str],
                      truncate_prompt_tokens: int | None, raw: Request) -> tuple[list[float], int]:
        """Cosine scores of the pairs, embedded in one batch, and the prompt tokens embedded (a single left text
        once). Empty texts are embedded as the tokenizer encodes them, as vLLM's."""
        if len(left) + len(right) > MAX_INPUTS:
            raise InvalidRequestError(f"{names[0]} and {names[1]} hold {len(left) + len(right)} texts together; this "
                                      f"server embeds at most {MAX_INPUTS} per request (OpenAI's limit on inputs)",
                                      param=names[1])
        for texts, name in zip((left, right), names):
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(f"{name}: every text must be a string", param=name)
        k = self._checked_truncation(truncate_prompt_tokens)
        params = PoolingParams(truncate_prompt_tokens=k)  # InvalidRequestError -> 400
        prompts = (await self._embedding_prompts(left, k, names[0], allow_empty=True)
                   + await self._embedding_prompts(right, k, names[1], allow_empty=True))
        labels = [(f"{names[0]}[{i}]", names[0]) for i in range(len(left))]
        labels += [(f"{names[1]}[{i}]", names[1]) for i in range(len(right))]
        vectors = await self._embed(request_id, prompts, params, raw, labels)
        return cosine_scores(vectors[:len(left)], vectors[len(left):]), sum(len(p.token_ids) for p in prompts)

    async def _embed(self, request_id: str, prompts: list[_Prompt], params: PoolingParams, raw: Request,
                     labels: list[tuple[str, str]]) -> list[list[float]]:
        """Each prompt's vector, in order: one engine request per prompt, batched with every other request.
        `labels`: each prompt's name in an error and its request field."""
        vocab_size = self.engine.engine.config.model.hf_config.vocab_size
        for prompt, (label, param) in zip(prompts, labels, strict=True):
            check_pooling_prompt(prompt.token_ids, self.max_model_len, vocab_size, label=label, param=param)
        arrival = time.monotonic()
        # At most `window` of them in the engine at once, the next one entering as one ends: a call of OpenAI's
        # 2048 inputs fits a queue of fewer (a 400 past --max-num-seqs + --max-waiting-requests before), and
        # requests that come meanwhile are scheduled beside it instead of waiting behind all of it. Twice the
        # running batch keeps the next step's batch queued. The room is checked whole, once (429 before anything
        # runs, never half-way).
        window = min(len(prompts), self.engine.capacity, 2 * self.engine.engine.config.scheduler.max_num_seqs)
        reservation = self.engine.check_room(window)
        slots = asyncio.Semaphore(window)

        async def windowed(i: int, prompt: _Prompt) -> AsyncIterator[PoolingRequestOutput]:
            async with slots:
                async for output in self.engine.generate(
                        f"{request_id}-{i}", {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}, params,
                        arrival, admitted=True, reservation=reservation):
                    yield output

        streams = _merge([windowed(i, p) for i, p in enumerate(prompts)])
        return [o.outputs.embedding for o in await _gather(streams, raw, len(prompts))]

    def _pooling_params(self, req: EmbeddingRequest) -> PoolingParams:
        k = self._checked_truncation(req.truncate_prompt_tokens)
        params = PoolingParams(dimensions=req.dimensions, truncate_prompt_tokens=k,  # InvalidRequestError -> 400
                               normalize=req.normalize)
        self.engine.engine.validate_dimensions(req.dimensions)  # reads the frozen config only
        return params

    def _checked_truncation(self, k: int | None) -> int | None:
        if k is not None and k > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens {k} exceeds this model's maximum context length of "
                                      f"{self.max_model_len} tokens", param="truncate_prompt_tokens")
        return k

    async def _embedding_prompts(self, value: Any, truncate_prompt_tokens: int | None, name: str = "input",
                                 allow_empty: bool = False, add_special_tokens: bool = True) -> list[_Prompt]:
        """str | list[str] | list[int] | list[list[int]] -> one prompt per input (token ids truncated if asked)."""
        if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
            value = [value]  # one input
        if not value:
            raise InvalidRequestError(f"{name} must not be empty", param=name)
        if len(value) > MAX_INPUTS:
            raise InvalidRequestError(f"{name} has {len(value)} items; this server takes at most {MAX_INPUTS} per "
                                      "request (OpenAI's limit)", param=name)
        if not allow_empty and any(len(item) == 0 for item in value):
            raise InvalidRequestError(f"{name} must not contain an empty string or an empty list of tokens",
                                      param=name)
        texts = [v for v in value if isinstance(v, str)]
        for text in texts:  # transformers' tokenizers answer a lone surrogate with a TypeError (a 500)
            check_text(text, name, param=name)
        encoded = iter(await self.in_tokenizer_pool(self._tokenize_texts, texts, truncate_prompt_tokens,
                                                    add_special_tokens) if texts else [])
        prompts = []
        for item in value:
            if isinstance(item, str):
                prompts.append(_Prompt(item, next(encoded)))
            else:
                prompts.append(_Prompt(None, tokenize_for_pooling(self.tokenizer, list(item), truncate_prompt_tokens,
                                                                  self.max_model_len)))
        return prompts

    def _tokenize_texts(self, texts: list[str], truncate_prompt_tokens: int | None,
                        add_special_tokens: bool = True) -> list[list[int]]:
        k = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        kwargs = {} if k is None else {"truncation": True, "max_length": k}
        encoded = self.tokenizer(texts, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]
        check_truncated(encoded, k)
        return encoded


async def _gather(streams: AsyncIterator[tuple[int, PoolingRequestOutput]], raw: Request, num_inputs: int
                  ) -> list[PoolingRequestOutput]:
    """Each input's result, in input order; aborts every request if the client goes away meanwhile."""
    results: dict[int, PoolingRequestOutput] = {}

    async def consume() -> None:
        async for index, output in streams:
            if output.finished:
                results[index] = output

    # An input the engine refused raises here; errors.py maps it to its status.
    await consume_unless_disconnected(consume(), streams, raw)
    return [results[i] for i in range(num_inputs)]
