"""Benchmark prompts: token-exact random prompts and JSONL files, plus the tokenizers they need.

A random prompt of N tokens really has N tokens: ids are drawn from the server's own vocabulary
(`POST /tokenize` of a fixed English corpus) or from a local Hugging Face tokenizer, then sent as
token ids (exact by construction) or detokenized and re-tokenized until the count matches.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

# Word pool for the vocabulary sample; varied enough to give a few hundred distinct token ids.
_CORPUS_WORDS = (
    "the of and to in is was for on that with as by at from his her they this are be have had not "
    "but which one were all their there been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my "
    "now such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go came right "
    "used take three house river mountain garden window paper music light water stone forest city "
    "market engine signal memory thread kernel vector matrix cache block token prompt server "
    "network packet socket buffer queue batch model layer weight tensor gradient sample random "
    "number letter yellow purple orange silver golden quiet loud quick slow bright dark gentle "
    "ancient modern simple complex honest careful curious distant familiar hidden narrow"
).split()
_MAX_TEXT_ADJUSTMENTS = 8


class PromptTokenizer(Protocol):
    """Whatever can turn text into token ids and back (the server's or a local one)."""

    source: str

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, token_ids: list[int]) -> str: ...


class ServerTokenizer:
    """The server's `POST /tokenize` and `POST /detokenize` (vLLM request and response bodies)."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client = client
        self.model = model
        self.source = "server /tokenize"

    async def encode(self, text: str) -> list[int]:
        response = await self.client.post("/tokenize", json={"model": self.model, "prompt": text})
        response.raise_for_status()
        return list(response.json()["tokens"])

    async def decode(self, token_ids: list[int]) -> str:
        response = await self.client.post("/detokenize", json={"model": self.model, "tokens": token_ids})
        response.raise_for_status()
        return response.json()["prompt"]


class LocalTokenizer:
    """A Hugging Face tokenizer from a local directory (transformers is imported only here)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.source = f"local tokenizer {path}"

    async def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    async def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


@dataclass
class BenchPrompt:
    """One prompt to send: text or token ids, with its planned content length and max_tokens."""

    prompt: str | list[int]
    planned_prompt_tokens: int  # content tokens (special tokens the tokenizer adds not counted); 0 = unknown
    max_tokens: int


@dataclass
class TokenSpace:
    """Ids to draw prompts from, and the ids the tokenizer adds on its own (BOS/EOS)."""

    pool_ids: list[int]
    special_ids: set[int]

    def content(self, token_ids: list[int]) -> list[int]:
        return [token_id for token_id in token_ids if token_id not in self.special_ids]


async def probe_token_space(tokenizer: PromptTokenizer) -> TokenSpace:
    """Tokenize '' (only added special tokens) and the corpus (a sample of ordinary ids)."""
    special_ids = set(await tokenizer.encode(""))
    corpus_ids = await tokenizer.encode(" ".join(_CORPUS_WORDS))
    pool_ids = sorted(set(corpus_ids) - special_ids)
    if not pool_ids:
        raise ValueError(f"{tokenizer.source} returned no ordinary token ids for an English corpus")
    return TokenSpace(pool_ids=pool_ids, special_ids=special_ids)


def sample_lengths(rng: random.Random, num: int, length: int, range_ratio: float) -> list[int]:
    """Uniform integer lengths in [length*(1-r), length*(1+r)] (at least 1), like vLLM's random dataset."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be within [0, 1), got {range_ratio}")
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


async def _exact_text(
    tokenizer: PromptTokenizer, space: TokenSpace, token_ids: list[int], rng: random.Random
) -> tuple[str, int]:
    """Detokenize, re-tokenize and trim or pad until the text has len(token_ids) content tokens."""
    target = len(token_ids)
    text, count = "", 0
    for _ in range(_MAX_TEXT_ADJUSTMENTS):
        text = await tokenizer.decode(token_ids)
        content_ids = space.content(await tokenizer.encode(text))
        count = len(content_ids)
        if count == target:
            break
        if count > target:
            token_ids = content_ids[:target]
        else:
            token_ids = content_ids + rng.choices(space.pool_ids, k=target - count)
    return text, count  # count is the truth even if it never reached the target


async def build_random_prompts(
    tokenizer: PromptTokenizer,
    rng: random.Random,
    input_lens: list[int],
    output_lens: list[int],
    as_text: bool,
    prefix_len: int = 0,
) -> list[BenchPrompt]:
    """Random prompts of exactly `input_lens[i]` content tokens (token ids, or text checked by re-tokenizing),
    each after the same `prefix_len` random tokens (vLLM's --random-prefix-len: counted on top)."""
    space = await probe_token_space(tokenizer)
    prefix = rng.choices(space.pool_ids, k=prefix_len)
    prompts = []
    for input_len, output_len in zip(input_lens, output_lens):
        input_len += prefix_len
        token_ids = prefix + rng.choices(space.pool_ids, k=input_len - prefix_len)
        if as_text:
            text, count = await _exact_text(tokenizer, space, token_ids, rng)
            prompts.append(BenchPrompt(prompt=text, planned_prompt_tokens=count, max_tokens=output_len))
        else:
            prompts.append(BenchPrompt(prompt=token_ids, planned_prompt_tokens=input_len, max_tokens=output_len))
    return prompts


def read_jsonl_prompts(path: str | Path, num: int, default_output_len: int) -> list[BenchPrompt]:
    """`num` prompts from a JSONL file of {"prompt": str, "max_tokens"|"output_len": int (optional)}.

    Lines are used in order and reused from the top when the file has fewer than `num`.
    """
    entries: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as exc:  # json's own message named neither the file nor the line
                raise ValueError(f"{path}:{line_number}: not JSON ({exc})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                raise ValueError(f"{path}:{line_number}: expected an object with a string 'prompt'")
            output_len = entry.get("max_tokens", entry.get("output_len", default_output_len))
            if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"{path}:{line_number}: max_tokens/output_len must be an integer >= 1, got "
                                 f"{output_len!r}")
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no prompts")
    prompts = []
    for index in range(num):
        entry = entries[index % len(entries)]
        max_tokens = int(entry.get("max_tokens", entry.get("output_len", default_output_len)))
        prompts.append(BenchPrompt(prompt=entry["prompt"], planned_prompt_tokens=0, max_tokens=max_tokens))
    return prompts


# vLLM's ShareGPT filter: conversations whose prompt or answer is shorter than this are skipped, and those longer
SHAREGPT_MIN_TOKENS, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


async def read_sharegpt_prompts(path: str | Path, num: int, tokenizer: PromptTokenizer, rng: random.Random,
                                output_len: int | None = None) -> list[BenchPrompt]:
    """`num` prompts from a ShareGPT JSON file (a list of {"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}), as vLLM's ShareGPT dataset reads it: shuffled with the seed, each
    conversation's first turn the prompt and its second turn's token count the max_tokens (or `output_len`),
    conversations with a prompt or answer under 4 tokens, a prompt over 1024 or both over 2048 skipped; fewer
    usable than `num` are reused from the top."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not a ShareGPT JSON file ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}} entries")
    conversations = [entry.get("conversations") or entry.get("conversation") or []
                     for entry in data if isinstance(entry, dict)]
    pairs = [(turns[0].get("value"), turns[1].get("value")) for turns in conversations
             if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2])]
    pairs = [(q, a) for q, a in pairs if isinstance(q, str) and isinstance(a, str)]
    rng.shuffle(pairs)
    num_special = len(await tokenizer.encode(""))
    prompts: list[BenchPrompt] = []
    for question, answer in pairs:
        if len(prompts) == num:
            break
        prompt_len = len(await tokenizer.encode(question)) - num_special
        answer_len = output_len or len(await tokenizer.encode(answer)) - num_special
        if prompt_len < SHAREGPT_MIN_TOKENS or (output_len is None and answer_len < SHAREGPT_MIN_TOKENS):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + answer_len > SHAREGPT_MAX_TOTAL:
            continue
        prompts.append(BenchPrompt(prompt=question, planned_prompt_tokens=prompt_len, max_tokens=answer_len))
    if not prompts:
        raise ValueError(f"{path}: no usable conversations (a first turn of 4-1024 tokens and an answer of 4 or more, "
                         f"together at most 2048)")
    return [prompts[i % len(prompts)] for i in range(num)]  # reused from the top when short, as vLLM oversamples


async def count_prompt_tokens(tokenizer: PromptTokenizer, prompts: list[BenchPrompt]) -> None:
    """Fill planned_prompt_tokens of text prompts (content tokens, added special tokens not counted)."""
    num_special = len(await tokenizer.encode(""))
    for prompt in prompts:
        if isinstance(prompt.prompt, str):
            prompt.planned_prompt_tokens = len(await tokenizer.encode(prompt.prompt)) - num_special
