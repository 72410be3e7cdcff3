"""The offline LLM API when the engine fails a request: the call raises RequestFailedError naming it, and the
engine is left empty and usable for the next call."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.entrypoints.llm import LLM
from pagedserve.exceptions import InvalidRequestError, RequestFailedError
from pagedserve.sampling_params import SamplingParams


def test_failed_model_step_raises_and_the_next_call_works(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128, fault_injection="step:*:1")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestFailedError, match="model step failed: InjectedFault"):
        llm.generate(["hello", "world"], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.usage == 0  # the failed step's blocks were freed
    outputs = llm.generate(["hello", "world"], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]


def test_a_dead_engine_keeps_no_retry_request_queued(tiny_model_dir):
    """A failed step and a failed retry: the engine is dead, and its retry's one-token request is not left
    queued (each later call ran it again beside its own: "model step failed for 2 requests")."""
    from pagedserve.exceptions import EngineDeadError

    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128, fault_injection="step:*:2")
    with pytest.raises(EngineDeadError, match="the retry step failed too"):
        llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_larger_than_the_whole_kv_pool_fails_instead_of_waiting_forever(tiny_model_dir, chunked):
    """With a pool smaller than max_model_len (--num-gpu-blocks-override), a prompt past the pool is refused when
    it is added, and a request that outgrows the pool alone while decoding fails: both waited, or preempted
    themselves, forever. A request that fits still runs beside them."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256, num_gpu_blocks_override=5,
              enable_chunked_prefill=chunked, max_num_batched_tokens=256)  # 4 blocks of 16: 64 tokens
    assert llm.engine.scheduler.kv.capacity_tokens == 64
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="more than the whole KV cache holds"):
        llm.generate([{"prompt_token_ids": list(range(10, 75))}], params)
    # Refused before it runs (its prefill was computed, its tokens generated, then thrown away with the 400) ...
    growing = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match=r"need the K/V of 69 tokens, more than the whole KV cache holds "
                                                  r"\(64 tokens\)"):
        llm.generate([{"prompt_token_ids": list(range(10, 40))}], growing)
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv.usage == 0
    # ... and without max_tokens, the request ends where the pool does, as at max_model_len: 30 + 35 tokens, the
    # last one's K/V never written. A request that fills the pool exactly runs.
    open_ended = llm.generate([{"prompt_token_ids": list(range(10, 40))}],
                              SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))[0].outputs[0]
    assert (len(open_ended.token_ids), open_ended.finish_reason) == (35, "length")
    full = llm.generate([{"prompt_token_ids": list(range(10, 74))}],
                        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))[0].outputs[0]
    assert len(full.token_ids) == 1
    outputs = llm.generate([{"prompt_token_ids": list(range(10, 40))}], params)
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_misused_offline_calls_name_the_argument(tiny_model_dir):
    """Mistakes in LLM calls are errors that say what to give (they were AttributeErrors and jinja's own)."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate("Hi", {"max_tokens": 3})
    with pytest.raises(InvalidRequestError, match="stop must be a list"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="messages must be a list"):
        llm.chat("hello")
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a string \"role\""):
        llm.chat([{"content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[1\].content must be a string"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": 5}])
    reply = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(reply[0].outputs[0].token_ids) == 2


def test_offline_chat_continues_the_final_message_as_vllm_s(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    open_ended = llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert llm.engine.tokenizer.decode(open_ended).endswith("Hello th")
    reply = llm.chat(messages, SamplingParams(max_tokens=2, ignore_eos=True), add_generation_prompt=False,
                     continue_final_message=True)
    assert reply[0].prompt_token_ids == open_ended
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(messages, continue_final_message=True)  # add_generation_prompt defaults to True, as in vLLM


def test_an_interrupted_call_leaves_no_request_behind(tiny_model_dir, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) during generate: its requests are aborted, so the next call runs only its own
    (they ran the interrupted call's to the end first)."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128)
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if calls == [1, 1, 1] and not outputs_seen:
            raise KeyboardInterrupt
        return step()

    outputs_seen = []

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello"] * 4, SamplingParams(max_tokens=100, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv.usage == 0
    calls.clear()
    outputs_seen.append(True)
    outputs = llm.generate(["world"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 3 and len(calls) <= 4


def test_vllm_s_llm_calls_run_unchanged(tiny_model_dir):
    """What vLLM scripts write: use_tqdm/lora_request arguments, chat's positional order, OpenAI content parts,
    llm.llm_engine, disable_log_stats, reset_prefix_cache, and the top-level names."""
    import pagedserve
    from pagedserve import CompletionOutput, EngineArgs, LLMEngine, PoolingParams, RequestOutput, TokensPrompt

    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128, disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, use_tqdm=False, lora_request=None)
    assert isinstance(out[0], RequestOutput) and isinstance(out[0].outputs[0], CompletionOutput)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("hi", params, lora_request=object())
    plain = llm.chat([{"role": "user", "content": "part one\npart two"}], params, False)  # use_tqdm=False
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                   {"type": "text", "text": "part two"}]}], params, use_tqdm=False)
    assert parts[0].prompt_token_ids == plain[0].prompt_token_ids  # joined by a newline, as vLLM's "string"
    ends = llm.engine.tokenizer.decode(plain[0].prompt_token_ids)
    assert ends.rstrip().endswith("assistant")  # the third positional is use_tqdm, not add_generation_prompt
    assert llm.llm_engine is llm.engine and isinstance(llm.engine, LLMEngine)
    assert llm.reset_prefix_cache() is True
    assert EngineArgs is pagedserve.EngineArgs and PoolingParams().dimensions is None


def test_vllm_s_other_sampling_fields(tiny_model_dir):
    """detokenize, truncate_prompt_tokens, guided_decoding (structured_outputs' older name) as vLLM's; a blank bad
    word, logits_processors and best_of refused with what to use instead (they were TypeErrors)."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128)
    ids = list(range(10, 40))
    quiet = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False))
    assert quiet[0].outputs[0].text == "" and len(quiet[0].outputs[0].token_ids) == 3
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, truncate_prompt_tokens=8))
    assert cut[0].prompt_token_ids == ids[-8:]
    guided = llm.generate("x", SamplingParams(max_tokens=8, guided_decoding={"choice": ["yes", "no"]}))
    assert guided[0].outputs[0].text in ("yes", "no")
    for kwargs, words in (({"bad_words": [" "]}, "bad_words"), ({"logits_processors": [print]}, "not supported"),
                          ({"best_of": 3}, "cumulative_logprob"), ({"n": 2, "best_of": 1}, r"at least n \(2\)"),
                          ({"stop": ["x"], "detokenize": False}, "stop"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**kwargs)


def test_a_tokenizer_with_more_ids_than_the_model_has_rows_is_refused_at_start(tiny_model_dir, caplog):
    """--tokenizer with 453 tokens for a model of 256 rows: refused when the engine starts, naming both sizes (it
    started, and each prompt with an id from 256 up was then refused as out of range, QA-P). The model's own
    tokenizer that large is a warning; a padded vocabulary (more rows than tokens) is normal."""
    small = tiny_model_dir("llama", vocab_size=256)  # its own tokenizer has 453 tokens (the BPE's merges)
    with pytest.raises(ValueError, match=r"--tokenizer .* has 453 tokens, more than the 256 rows of the model's "
                                         r"vocabulary: ids from 256 up have no embedding"):
        LLM(small, tokenizer=tiny_model_dir("llama"), max_model_len=64)
    with caplog.at_level("WARNING"):
        LLM(small, max_model_len=64)
        LLM(small, tokenizer=small, max_model_len=64)  # --tokenizer naming the model's own: a warning too
    assert caplog.text.count("the tokenizer has 453 tokens, more than the 256 rows") == 2
    padded = LLM(tiny_model_dir("llama", vocab_size=600), tokenizer=tiny_model_dir("llama"), max_model_len=64)
    assert padded.generate("a b", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_engine_argument_messages_name_what_is_wrong(tiny_model_dir):
    """--quantization's refusal lists gguf too (it is taken for a GGUF); a model whose context length is 0 (a
    damaged GGUF's context_length) is called damaged, not told "use --max-model-len 0 or less" (QA-P)."""
    with pytest.raises(ValueError, match=r"--quantization fp8 is not supported; supported: int8, and gguf for a GGUF"):
        LLM(tiny_model_dir("llama"), quantization="fp8", max_model_len=64)
    with pytest.raises(ValueError, match=r"max_position_embeddings 0 .*: not a context length, so its metadata is "
                                         r"damaged"):
        LLM(tiny_model_dir("llama", max_position_embeddings=0), max_model_len=64)


def test_sampling_params_as_vllm_s_offline_engine_takes_them(tiny_model_dir):
    """QA of 12-07: n = best_of = 2 was refused by best_of's own check on each sample's copy (n=1, best_of 2); a
    max_tokens past the KV cache was refused though max_model_len caps it first (65536 ran, 65537 not); fields set
    after construction (top_k = -1, logprobs = True, logit_bias with string keys, stop_token_ids = None) were checked
    as given, not as the constructor reads them; numpy's scalars were refused; bytes ran as token ids."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64)
    ids = list(range(10, 20))
    both = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=2, best_of=2, max_tokens=3, temperature=0.0,
                                                                  ignore_eos=True))
    assert [len(o.token_ids) for o in both[0].outputs] == [3, 3]
    capacity = llm.engine.scheduler.kv.capacity_tokens
    assert capacity > 64
    huge = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=capacity + 1, temperature=0.0,
                                                                  ignore_eos=True))[0].outputs[0]
    assert (len(huge.token_ids), huge.finish_reason) == (64 - len(ids), "length")
    changed = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    changed.top_k, changed.logprobs, changed.logit_bias, changed.stop_token_ids = -1, True, {"42": 5.0}, None
    out = llm.generate({"prompt_token_ids": ids}, changed)[0].outputs[0]
    assert len(out.token_ids) == 4 and all(1 <= len(position) <= 2 for position in out.logprobs)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={42: 5.0})
    assert llm.generate({"prompt_token_ids": ids}, plain)[0].outputs[0].token_ids == out.token_ids
    numpy_params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_tokens=np.int64(3),
                                  seed=np.int64(7), ignore_eos=True)
    assert (type(numpy_params.temperature), type(numpy_params.max_tokens), type(numpy_params.seed)) == (float, int,
                                                                                                       int)
    seeded = [llm.generate({"prompt_token_ids": ids}, numpy_params)[0].outputs[0].token_ids for _ in range(2)]
    assert len(seeded[0]) == 3 and seeded[0] == seeded[1]
    for prompt in (b"Hello", [b"Hello"], {"prompt_token_ids": b"Hello"}):
        with pytest.raises(InvalidRequestError, match="got bytes"):
            llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
