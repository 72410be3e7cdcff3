"""Prompt shapes, as vLLM's `vllm.inputs` names them: generate() and embed() take these dicts (or a plain string,
or a list of token ids)."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
