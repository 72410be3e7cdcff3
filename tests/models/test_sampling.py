"""Sampling behaviour end to end on a tiny model."""

from __future__ import annotations

import math

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)


def texts(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_output_independent_of_batch_companions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.2, max_tokens=25, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], seeded)
    crowded = llm.generate(["Paris is", "The quick brown fox", "def square(x):", "你好"],
                           [other, seeded, other, seeded.clone(seed=99)])
    assert crowded[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    again = llm.generate(["The quick brown fox"], seeded)
    assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_unseeded_random_sampling_varies(llm):
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(["The quick brown fox"] * 4, params)
    assert len({tuple(t) for t in texts(outputs)}) > 1


def test_top_k_1_equals_greedy(llm):
    prompts = ["The quick brown fox", "Paris is the capital of"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(temperature=0.9, top_k=1, seed=3, max_tokens=12, ignore_eos=True))
    assert texts(top1) == texts(greedy)


def test_stop_string_is_cut(llm):
    greedy = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = greedy[0].outputs[0].text
    stop = text[10:13]  # a substring from the middle, likely spanning tokens
    assert stop and stop.strip(), text
    cut = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))
    completion = cut[0].outputs[0]
    assert completion.text == text[:text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    kept = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop],
                                                                include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:text.index(stop) + len(stop)]


def test_n_gives_n_completions(llm):
    outputs = llm.generate(["The quick brown fox"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                                                                   ignore_eos=True))
    completions = outputs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1


def test_logprobs_and_prompt_logprobs_shapes(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == 5
    for token_id, step in zip(completion.token_ids, completion.logprobs):
        assert step[token_id].rank == 1  # greedy picks the most likely token
        assert 3 <= len(step) <= 4
    assert math.isclose(completion.cumulative_logprob,
                        sum(s[t].logprob for t, s in zip(completion.token_ids, completion.logprobs)))
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == 4
    for token_id, entry in zip([6, 7, 8], output.prompt_logprobs[1:]):
        assert token_id in entry and 2 <= len(entry) <= 3


def test_prompt_logprobs_same_when_chunked(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    whole = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256).generate(prompt, params)[0]
    chunked = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256,
                  max_num_batched_tokens=7).generate(prompt, params)[0]
    assert len(chunked.prompt_logprobs) == 37
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[k].logprob - b[k].logprob) < 1e-4 for k in a)


def test_penalties_and_logit_bias_change_output(llm):
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = texts(llm.generate(["The quick"], base))[0]
    penalised = texts(llm.generate(["The quick"], base.clone(repetition_penalty=3.0, frequency_penalty=2.0)))[0]
    assert len(set(penalised)) >= len(set(plain))
    assert penalised != plain or len(set(plain)) == len(plain)
    biased = texts(llm.generate(["The quick"], base.clone(logit_bias={42: 100.0})))[0]
    assert biased == [42] * 24


def test_min_tokens_blocks_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    base = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={eos: 100.0})
    assert texts(llm.generate(["Hi"], base))[0] == [eos]  # EOS is forced and ends the request
    forced = base.clone(min_tokens=4)
    tokens = texts(llm.generate(["Hi"], forced))[0]
    assert len(tokens) == 5 and eos not in tokens[:4] and tokens[4] == eos
    # With ignore_eos too, as vLLM's (EOS is among the stop ids min_tokens bans): no EOS before min_tokens, then
    # EOS does not end the request.
    ignored = texts(llm.generate(["Hi"], forced.clone(ignore_eos=True)))[0]
    assert len(ignored) == 6 and eos not in ignored[:4] and ignored[4:] == [eos, eos]


def test_min_tokens_blocks_generation_config_eos(tiny_model_dir, tmp_path):
    """generation_config.json's extra EOS ids (Llama 3's <|eot_id|>) end a request only after min_tokens, and with
    ignore_eos are still banned before it (vLLM's all_stop_token_ids), as the tokenizer's EOS is."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    extra = 7
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra]}))
    llm = LLM(str(model), dtype="float32", max_model_len=256)
    assert extra in llm.engine.eos_token_ids
    forced = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={extra: 100.0}, min_tokens=3)
    tokens = texts(llm.generate(["Hi"], forced))[0]
    assert len(tokens) == 4 and extra not in tokens[:3]
    ignored = texts(llm.generate(["Hi"], forced.clone(ignore_eos=True)))[0]
    assert len(ignored) == 6 and extra not in ignored[:3] and ignored[3:] == [extra] * 3


def test_invalid_parameters_raise(llm):
    for bad in (dict(temperature=-0.1), dict(top_p=1.5), dict(top_k=-3), dict(min_p=2.0),
                dict(presence_penalty=3.0), dict(max_tokens=0), dict(logprobs=-2), dict(n=0),
                dict(repetition_penalty=0.0), dict(n=True), dict(max_tokens=True), dict(seed=True)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    # vLLM's spellings: True logprobs are 1, seed -1 is no seed, logprobs -1 the vocabulary (within --max-logprobs)
    assert (SamplingParams(logprobs=True, prompt_logprobs=True).logprobs, SamplingParams(seed=-1).seed) == (1, None)
    assert SamplingParams(logprobs=False).logprobs is None
    one = llm.generate(["Hi"], SamplingParams(max_tokens=2, logprobs=True, prompt_logprobs=True))[0]
    assert all(len(step) in (1, 2) for step in one.outputs[0].logprobs) and one.prompt_logprobs[0] is None
    with pytest.raises(ValueError,
                       match=r"logprobs must be at most 20 \(--max-logprobs.*got -1 \(the whole vocabulary, 512\)"):
        llm.generate(["Hi"], SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match=r"logprobs must be at most 20 \(--max-logprobs"):  # the engine's cap
        llm.generate(["Hi"], SamplingParams(logprobs=25))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([{"prompt_token_ids": [1] * 300}], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [100000]}], SamplingParams())
    # The engine is still healthy afterwards.
    assert len(llm.generate(["ok"], SamplingParams(max_tokens=2))) == 1


def test_chat_applies_template(llm):
    tokenizer = llm.get_tokenizer()
    outputs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=4))
    expected_prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    assert outputs[0].prompt_token_ids == expected_prompt
    assert outputs[0].prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # vLLM's: the text


def test_chat_takes_another_template(llm, tmp_path):
    tokenizer = llm.get_tokenizer()
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    expected = tokenizer.encode("[user] Hi\n", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    assert llm.chat([{"role": "user", "content": "Hi"}], params, chat_template=template)[0].prompt_token_ids == expected
    path = tmp_path / "t.jinja"
    path.write_text(template)  # or a file's path, as serve's --chat-template
    assert llm.chat([{"role": "user", "content": "Hi"}], params, chat_template=str(path))[0].prompt_token_ids == expected
    with pytest.raises(ValueError, match=r"^LLM\.chat\(chat_template=\.\.\.\) 'no-such\.jinja': no such file"):
        llm.chat([{"role": "user", "content": "Hi"}], params, chat_template="no-such.jinja")  # names no CLI flag


def test_generate_without_params_samples_with_the_model_s_defaults(tiny_model_dir, llm):
    tuned = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256,
                override_generation_config='{"temperature": 0.0, "max_new_tokens": 3}')
    assert (tuned.get_default_sampling_params().temperature, tuned.get_default_sampling_params().max_tokens) == (0.0, 3)
    out = tuned.generate(["Hello there"])[0].outputs[0]
    greedy = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 3
    assert llm.get_default_sampling_params() == SamplingParams()  # no generation_config defaults: the neutral ones


def test_logprobs_dicts_put_the_sampled_token_first_as_vllm(llm):
    """vLLM builds each step's dict from [sampled, *top]: the first entry is the sampled (or prompt) token's, then
    the top ones by rank. Code reading next(iter(step.values())) summed the top-1 logprobs instead."""
    params = SamplingParams(temperature=2.0, seed=3, max_tokens=24, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate(["The quick brown fox jumps"], params)[0]
    sample = out.outputs[0]
    assert [next(iter(step)) for step in sample.logprobs] == sample.token_ids
    assert sum(next(iter(step.values())).logprob for step in sample.logprobs) == pytest.approx(
        sample.cumulative_logprob, abs=1e-4)
    assert any(step[token].rank > 2 for step, token in zip(sample.logprobs, sample.token_ids))  # not always top-k
    for step in sample.logprobs:
        ranks = [lp.rank for token_id, lp in list(step.items())[1:]]
        assert ranks == sorted(ranks) and set(ranks) <= {1, 2}
    assert [next(iter(step)) for step in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]


def test_bad_words_as_vllm_s(llm, tiny_model_dir):
    """vLLM's bad_words: a word's last token is banned where the output ends with the tokens before it (the word
    as it reads alone and after a space). Greedy tokens equal transformers' greedy with that rule as a logits
    processor over the output tokens, and the word taken from the unbanned output changes it."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    prompt = "The quick brown fox"
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = llm.generate(prompt, greedy)[0]
    tokenizer = llm.get_tokenizer()
    generated = plain.outputs[0].token_ids
    # candidate words: the text of each run of 1-3 output tokens (a random model's text rarely re-encodes as
    # it was generated; the first whose tokens, alone or after a space, occur in the output is taken)
    words = [tokenizer.decode(generated[i:i + n]).strip() for n in (1, 2, 3) for i in range(len(generated))]
    words = [w for w in dict.fromkeys(words) if w and "\ufffd" not in w]

    def token_ids_of(word: str) -> list[list[int]]:
        params = SamplingParams(bad_words=[word])
        params.update_from_tokenizer(tokenizer, llm.llm_engine.model_config.hf_config.vocab_size)
        return params.bad_words_token_ids

    def occurs(ids: list[int], output: list[int]) -> bool:
        return any(output[i:i + len(ids)] == ids for i in range(len(output) - len(ids) + 1))

    # a word of several tokens: its ban depends on the output before its last token
    word = next(w for w in words if any(len(ids) > 1 and occurs(ids, generated) for ids in token_ids_of(w)))
    banned = token_ids_of(word)
    out = llm.generate(prompt, greedy.clone(bad_words=[word]))[0].outputs[0].token_ids
    assert out != generated and not any(occurs(ids, out) for ids in banned), (word, banned, out)

    class BadWords(LogitsProcessor):
        def __init__(self, start: int) -> None:
            self.start = start

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            output = input_ids[0, self.start:].tolist()
            for ids in banned:
                if not ids[:-1] or output[len(output) - len(ids) + 1:] == ids[:-1] and len(output) >= len(ids) - 1:
                    scores[0, ids[-1]] = float("-inf")
            return scores

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    prompt_ids = torch.tensor([plain.prompt_token_ids])
    with torch.no_grad():
        reference = model.generate(prompt_ids, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                   logits_processor=LogitsProcessorList([BadWords(prompt_ids.shape[1])]))
    assert out == reference[0, prompt_ids.shape[1]:].tolist()


def test_bad_words_hold_in_verification_rows(tiny_model_dir):
    """With n-gram speculation, each verification row bans by the output and the drafts before it: the greedy
    tokens equal speculation off (a random model that repeats itself, so drafts are proposed and accepted)."""
    from tests.models.test_speculative import totals

    model_dir = tiny_model_dir("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]}
    plain_llm = LLM(model_dir, dtype="float32", max_model_len=256)
    tokenizer = plain_llm.get_tokenizer()
    out = plain_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0]
    word = tokenizer.decode(out.token_ids[2:4]).strip() or "x"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=[word, "the"])
    expected = plain_llm.generate(prompt, params)[0].outputs[0].token_ids
    del plain_llm
    fast = LLM(model_dir, dtype="float32", max_model_len=256, speculative_config=spec)
    assert fast.generate(prompt, params)[0].outputs[0].token_ids == expected
    assert totals(fast).num_accepted_tokens > 0  # verification rows ran
