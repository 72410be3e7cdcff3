"""Incremental detokenization: never emits half a UTF-8 character; cuts stop strings that span tokens."""

from __future__ import annotations

from typing import Any

from pagedserve.sampling_params import SamplingParams

# Prompt tokens decoded as left context, so tokenizers that drop a leading space (SentencePiece)
# still produce it for the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens  # stop strings count from the token after these (vLLM's rule)
        self.detokenize = params.detokenize  # False: token ids only, the text stays empty
        self.num_output_tokens = 0
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = self._whole_characters_end() if self.detokenize else len(self.ids)
        self.output_text = ""
        # While streaming, hold back text that may be the start of a stop string.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self._num_emitted = 0

    def _whole_characters_end(self) -> int:
        """How many of the prompt's last tokens decode to whole characters: a prompt that ends inside a character
        (a reply cut there, sent back as token ids) leaves its last bytes for the first output token to complete,
        and that character is output text, as vLLM's DecodeStream primed with the prompt gives it (it was lost,
        and the logprobs' text_offset counted it; QA-Z). UTF-8 takes at most 4 bytes: 3 tokens back at most."""
        end = len(self.ids)
        while end > max(0, len(self.ids) - 3) and self._decode(self.ids[:end]).endswith("\ufffd"):
            end -= 1
        return end

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (the text is cut before it): in the text of
        a token past the first min_tokens, or spanning into it."""
        if not self.detokenize:
            self.num_output_tokens += len(new_token_ids)
            return None
        for token_id in new_token_ids:
            self.ids.append(token_id)
            self.num_output_tokens += 1
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                new_text = full_text[len(prefix_text):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self.output_text += new_text
                stop = self._find_stop(len(new_text)) if self.num_output_tokens > self.min_tokens else None
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, num_new_chars: int) -> str | None:
        for stop in self.stop:
            # Only the new text, plus enough before it to catch a stop string spanning tokens.
            begin = max(0, len(self.output_text) - num_new_chars - len(stop) + 1)
            index = self.output_text.find(stop, begin)
            if index != -1:
                end = index + len(stop) if self.include_stop else index
                self.output_text = self.output_text[:end]
                return stop
        return None

    def text_to_emit(self, finished: bool) -> str:
        """Text not yet emitted (for streaming deltas), holding back a possible partial stop string. Tokens held back
        as an incomplete character when the output ends are dropped, as vLLM's detokenizer drops them (a cut through
        a multi-byte character ends the text before it, not with a replacement character)."""
        end = len(self.output_text) if finished else max(self._num_emitted,
                                                         len(self.output_text) - self.holdback)
        delta = self.output_text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def visible_text(self, finished: bool) -> str:
        """The whole output text that may be shown now."""
        if finished:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - self.holdback)]

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
