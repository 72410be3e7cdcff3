"""vLLM's offline examples and documented Python API, ported by changing the imports only (a sweep ran them): what
runs unchanged, and what is refused by name instead of failing on an AttributeError or a KeyError."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128)


def test_the_generate_example_s_argument_parsing(tiny_model_dir):
    """examples/offline_inference/basic/generate.py: EngineArgs.add_cli_args, then LLM(**vars(args)); --model
    went to a hidden `model_flag` (a TypeError, or the default model served in its place)."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="not-this-one")
    args = vars(parser.parse_args(["--model", tiny_model_dir("llama"), "--max-model-len", "64", "--dtype", "float32"]))
    assert args["model"] == tiny_model_dir("llama") and "model_flag" not in args
    llm = LLM(**args)
    assert llm.llm_engine.model_config.max_model_len == 64
    with pytest.raises(SystemExit):  # no positional MODEL on a script's parser, as vLLM's
        parser.parse_args(["positional"])


def test_engine_outputs_and_tokenizer_as_vllm_s(llm, tiny_model_dir):
    output = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert output.finished and output.outputs[0].finished() is True  # a method on CompletionOutput, as vLLM's
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.engine.tokenizer and engine.get_num_unfinished_requests() == 0
    assert engine.get_model_config().max_model_len == 128 and engine.abort_request("nothing") == []
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("Hello there").input_ids
    assert ids == tokenizer.encode("Hello there")
    assert tokenizer("Hi", return_tensors="pt")["input_ids"].shape[0] == 1
    assert tokenizer.batch_decode([ids])[0] == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert tokenizer.tokenize("Hello") and tokenizer.padding_side in ("left", "right")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], return_dict=True)
    assert chat["input_ids"] == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    unseeded = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len="64", seed=None)  # a torch error before
    assert unseeded.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    assert unseeded.llm_engine.model_config.max_model_len == 64  # vLLM's size strings ("1k", "32K") read too


def test_a_packaged_model_name_as_the_tokenizer():
    from pagedserve.engine.setup import load_tokenizer
    from tests.models.real_models import packaged_model

    by_name = load_tokenizer("smollm2-135m-instruct")  # as --model takes it ("not an existing directory" before)
    assert by_name.encode("Hello") == load_tokenizer(str(packaged_model("smollm2-135m-instruct"))).encode("Hello")


def test_chat_takes_a_tuple_of_messages(llm):
    message = {"role": "user", "content": "hi"}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert llm.chat((message,), params)[0].prompt_token_ids == llm.chat([message], params)[0].prompt_token_ids


def test_vllm_s_names_import(llm):
    from pagedserve import EmbeddingRequestOutput, PoolingRequestOutput, PromptType, ScoringRequestOutput  # noqa
    from pagedserve.lora.request import LoRARequest
    from pagedserve.outputs import ScoringRequestOutput as FromOutputs
    from pagedserve.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    assert FromOutputs is ScoringRequestOutput and GuidedDecodingParams is StructuredOutputsParams
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("Hi", lora_request=LoRARequest("adapter", 1, "/tmp/adapter"))


def test_what_is_not_served_is_refused_by_name(llm):
    for prompt, field in (({"prompt": "x", "multi_modal_data": {"image": None}}, "multi_modal_data"),
                          ({"prompt_embeds": [0.0]}, "prompt_embeds"),
                          ({"encoder_prompt": "x", "decoder_prompt": "y"}, "decoder_prompt")):
        with pytest.raises(ValueError, match=f"prompt field '{field}' is not supported"):
            llm.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="LLM.classify is not supported"):
        llm.classify(["x"])
    with pytest.raises(ValueError, match=r"got -1 \(the whole vocabulary"):
        llm.generate("x", SamplingParams(max_tokens=2, logprobs=-1))
    with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[0])
    assert not llm.engine.has_unfinished_requests()


def test_token_ids_may_be_numpy_integers_and_others_are_named(llm):
    """vLLM takes numpy arrays and numpy integers as token ids; anything else that is not an integer is refused as
    such (it was "token id 5 is out of range", about an id in range)."""
    import numpy as np

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    for ids in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7]):
        assert llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == expected
        assert llm.generate([list(ids)], params)[0].outputs[0].token_ids == expected
    assert SamplingParams(stop_token_ids=[np.int64(9)], allowed_token_ids=np.array([3, 4])).stop_token_ids == [9]
    for bad in (["5", "6"], [5.0], [True]):
        with pytest.raises(ValueError, match="prompt: token ids must be integers"):
            llm.generate({"prompt_token_ids": bad}, params)
    with pytest.raises(ValueError, match="stop_token_ids: token ids must be integers, got '5'"):
        SamplingParams(stop_token_ids=["5"])
    for prompt in (5, None, [3.5]):
        with pytest.raises(ValueError, match="a prompt is a string, a list of token ids or a dict"):
            llm.generate(prompt, params)
    # a prompt field given as None is not given (vLLM's TypedDicts leave them out)
    output = llm.generate({"prompt": "Hi", "multi_modal_data": None}, params)[0]
    assert output.outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()
    # vLLM's fields a script may print, None for a decoder-only model without LoRA (an AttributeError, QA-C)
    assert (output.encoder_prompt, output.encoder_prompt_token_ids, output.lora_request,
            output.kv_transfer_params) == (None, None, None, None)


def test_cache_salt_in_the_prompt_as_vllm_s_prompts_carry_it(llm):
    prompt = list(range(20, 60))  # two full blocks of 16 reusable

    def cached(salt=None, **params):
        item = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        return llm.generate(item, SamplingParams(max_tokens=1, **params))[0].num_cached_tokens

    assert cached("tenant-a") == 0 and cached("tenant-a") == 32  # the same salt shares
    assert cached("tenant-b") == 0 and cached() == 0  # another salt, or none, does not
    assert cached(None, cache_salt="tenant-a") == 32  # pagedserve's SamplingParams(cache_salt=...) is the same salt
    with pytest.raises(ValueError, match="cache_salt is given twice, 'x' in the prompt and 'y' in SamplingParams"):
        cached("x", cache_salt="y")


def test_the_resolved_configuration_under_vllm_s_names(llm, tiny_model_dir):
    from pagedserve.engine.arg_utils import EngineArgs

    config = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", max_model_len=128).create_engine_config()
    assert config.model.max_model_len == 128 and config.memory_plan.fits  # headers only: nothing loaded
    assert llm.llm_engine.vllm_config is llm.llm_engine.config and llm.llm_engine.vllm_config.model.dtype == "float32"
    vllm_config = llm.llm_engine.vllm_config  # VllmConfig's names for its parts
    assert vllm_config.model_config.max_model_len == 128 and vllm_config.model_config.get_vocab_size() == 512
    assert vllm_config.cache_config.block_size == llm.llm_engine.cache_config.block_size == 16
    assert vllm_config.cache_config.num_gpu_blocks == vllm_config.cache.num_blocks > 0
    assert vllm_config.scheduler_config.max_num_seqs == vllm_config.scheduler.max_num_seqs
    assert vllm_config.parallel_config.tensor_parallel_size == 1 and vllm_config.device_config.device == "cpu"


def test_more_of_vllm_s_offline_surface(llm, tiny_model_dir):
    """vLLM's: LLM(dtype=torch.bfloat16), chat(mm_processor_kwargs=None), PoolingParams(task="embed"),
    `pagedserve.logprobs` (vllm.logprobs) for Logprob; set_tokenizer refused by name, not an AttributeError."""
    import torch

    from pagedserve.logprobs import Logprob, PromptLogprobs, SampleLogprobs
    from pagedserve.outputs import Logprob as FromOutputs
    from pagedserve.pooling_params import PoolingParams

    assert Logprob is FromOutputs and PromptLogprobs and SampleLogprobs
    typed = LLM(tiny_model_dir("llama"), dtype=torch.float32, max_model_len=64)
    assert typed.llm_engine.model_config.dtype == "float32"
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert llm.chat([{"role": "user", "content": "hi"}], params, mm_processor_kwargs=None)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="mm_processor_kwargs: multimodal inputs are not supported"):
        llm.chat([{"role": "user", "content": "hi"}], params, mm_processor_kwargs={"size": 4})
    assert PoolingParams(task="embed").task == "embed"
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        PoolingParams(task="classify")
    with pytest.raises(ValueError, match="LLM.set_tokenizer is not supported"):
        llm.set_tokenizer(llm.get_tokenizer())


def test_get_metrics_counts_what_the_calls_did(tiny_model_dir):
    """vLLM's LLM.get_metrics() (disable_log_stats=False): the vllm:* series the server exports, as vLLM's reader
    types, counting the calls' tokens and requests; off by default, as vLLM's, with an error naming the switch."""
    from pagedserve.metrics_reader import Counter, Gauge, Histogram

    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64).get_metrics()
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128, disable_log_stats=False)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 7, 12)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    outputs += llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    metrics = llm.get_metrics()
    by_name: dict[str, list] = {}
    for m in metrics:
        by_name.setdefault(m.name, []).append(m)
        assert m.name.startswith("vllm:")
    (prompt_tokens,) = by_name["vllm:prompt_tokens"]
    (generated,) = by_name["vllm:generation_tokens"]
    assert isinstance(prompt_tokens, Counter) and prompt_tokens.labels["engine"] == "0"
    assert prompt_tokens.value == 3 + 7 + 12 + 3
    assert generated.value == sum(len(o.outputs[0].token_ids) for o in outputs) == 4 * 3 + 2
    success = {m.labels["finished_reason"]: m.value for m in by_name["vllm:request_success"]}
    assert success == {"stop": 0, "length": 4, "abort": 0}
    (running,) = by_name["vllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0
    (e2e,) = by_name["vllm:e2e_request_latency_seconds"]
    assert isinstance(e2e, Histogram) and e2e.count == 4 and e2e.sum > 0
    assert e2e.buckets["+Inf"] == 4 and list(e2e.buckets.values()) == sorted(e2e.buckets.values())
    # the engine's own first-token times, though the offline outputs arrive only when a request finishes
    (ttft,), (decode,) = by_name["vllm:time_to_first_token_seconds"], by_name["vllm:request_decode_time_seconds"]
    assert ttft.count == decode.count == 4 and 0 < ttft.sum < e2e.sum and decode.sum > 0
    assert abs(ttft.sum + decode.sum - e2e.sum) < 0.05 * e2e.sum
    (prompt_lengths,) = by_name["vllm:request_prompt_tokens"]
    assert prompt_lengths.sum == 3 + 7 + 12 + 3 and prompt_lengths.buckets["10.0"] == 3  # 3, 7 and 3 tokens
    # per-step histograms need per-step outputs: left empty offline rather than filled with whole requests
    assert by_name["vllm:iteration_tokens_total"][0].count == by_name["vllm:inter_token_latency_seconds"][0].count == 0

    # an interrupted call (Ctrl-C in the third step) aborts its requests: counted so, and the gauges show it
    step = llm.engine.step
    steps = iter(range(100))

    def interrupted():
        if next(steps) == 2:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts[:2], SamplingParams(max_tokens=20, ignore_eos=True))
    del llm.engine.step
    after = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert after[("vllm:request_success", "abort")].value == 2
    assert after[("vllm:num_requests_running", None)].value == 0
    assert after[("vllm:kv_cache_usage_perc", None)].value == 0


def test_metrics_snapshot_gives_per_position_counters_as_one_vector():
    from types import SimpleNamespace

    from pagedserve.metrics import EngineMetrics
    from pagedserve.metrics_reader import Vector, get_metrics_snapshot
    from prometheus_client import CollectorRegistry

    metrics = EngineMetrics("m", CollectorRegistry(), max_model_len=64)
    metrics._observe_spec_decode(SimpleNamespace(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                                                 accepted_per_pos=[2, 0, 2]))
    metrics._observe_spec_decode(SimpleNamespace(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=1,
                                                 accepted_per_pos=[1, 0, 0]))
    snapshot = {m.name: m for m in get_metrics_snapshot(metrics.registry)}
    per_position = snapshot["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_position, Vector) and per_position.values == [3, 0, 2]
    assert per_position.labels == {"model_name": "m", "engine": "0"}
    assert snapshot["vllm:spec_decode_num_draft_tokens"].value == 9


def test_dropping_an_llm_frees_its_engine_then_trims_the_heap(tiny_model_dir, monkeypatch):
    """`del llm` frees the engine at once (nothing holds it in a cycle) and then returns the freed heap to the system
    (glibc kept it: a 0.5B model's ~350 MiB stayed resident until another model loaded)."""
    import weakref

    from pagedserve.entrypoints import llm as llm_module

    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64, disable_log_stats=False)
    llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))
    engine = weakref.ref(llm.llm_engine)
    trims = []
    monkeypatch.setattr(llm_module, "release_free_heap", lambda: trims.append(engine() is None))
    del llm
    assert trims == [True]
    # A script that kept the engine: the heap is handed back when it lets the engine go (QA-X: 606 MiB stayed).
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64)
    kept = llm.llm_engine
    engine = weakref.ref(kept)
    del llm
    assert trims == [True] and engine() is not None
    del kept
    assert trims == [True, True]


def test_two_threads_share_one_llm(llm):
    """Calls from two threads are served one after the other: each stepped the engine and took the other's
    outputs (KeyError, QA-X)."""
    import threading

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [["Hello there", "One two"], ["Three four", "Five six seven"]]
    alone = [[o.outputs[0].token_ids for o in llm.generate(p, greedy)] for p in prompts]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = [[o.outputs[0].token_ids for o in llm.generate(prompts[i], greedy)] for _ in range(3)]
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {i: [alone[i]] * 3 for i in range(2)}, results


def test_a_script_parser_takes_vllm_s_engine_flags(tiny_model_dir):
    """EngineArgs.add_cli_args returns the parser and takes vLLM's other engine flags, as vLLM's does: a script run
    with --trust-remote-code stopped at "unrecognized arguments" (QA-X)."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.set_defaults(max_model_len=64)
    args = vars(parser.parse_args(["--model", tiny_model_dir("llama"), "--dtype", "float32", "--trust-remote-code",
                                   "--disable-log-stats", "--swap-space", "4", "--tokenizer-mode", "auto",
                                   "--load-format", "auto"]))
    llm = LLM(**args)
    assert llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):  # --disable-log-stats given: no metrics
        llm.get_metrics()


def test_keyword_mistakes_are_named_before_loading(tiny_model_dir, monkeypatch):
    from pagedserve.engine import llm_engine
    from pagedserve.engine.arg_utils import AUTO_SIZE, EngineArgs, read_keywords

    monkeypatch.setattr(llm_engine.LLMEngine, "from_engine_args", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="seed must be an integer or None, got str 'abc'"):
        LLM(tiny_model_dir("llama"), seed="abc")  # loaded the model, then torch's RuntimeError
    with pytest.raises(ValueError, match="max_model_len: invalid int value: 'big'"):
        LLM(tiny_model_dir("llama"), max_model_len="big")  # argparse's ArgumentTypeError, no ValueError
    with pytest.raises(TypeError, match="did you mean 'gpu_memory_utilization'"):
        LLM(tiny_model_dir("llama"), gpu_memory_utilisation=0.5)
    assert read_keywords(EngineArgs, {"max_model_len": "auto", "seed": None, "enforce_eager": 1}) == {
        "max_model_len": AUTO_SIZE, "seed": None, "enforce_eager": 1}  # "auto" was refused (QA-X)
    # vLLM's keyword for the KV cache's bytes, the flag's other name (a TypeError "did you mean kv_cache_memory")
    assert read_keywords(EngineArgs, {"kv_cache_memory_bytes": "1G"}) == {"kv_cache_memory": 1 << 30}
    with pytest.raises(ValueError, match="kv_cache_memory_bytes and kv_cache_memory name one setting"):
        read_keywords(EngineArgs, {"kv_cache_memory": 1, "kv_cache_memory_bytes": 2})
    from pagedserve.entrypoints.llm import _check_keyword_names

    _check_keyword_names({"kv_cache_memory_bytes": 1 << 30})  # LLM's own check of the names let it by too
    from pagedserve.engine.vllm_compat import split_keywords

    assert split_keywords({"hf_overrides": {}})[0] == {}  # vLLM's default: asks for nothing
    with pytest.raises(ValueError, match="hf_overrides"):
        split_keywords({"hf_overrides": {"rope_theta": 1.0}})


def test_vllm_s_smaller_calls(llm):
    params = SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=None, seed=3)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (1.0, 1.0, None, 3)
    ids = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                                               detokenize=False))[0]
    assert ids.outputs[0].text == "" and ids.outputs[0].logprobs
    assert all(lp.decoded_token is None for step in ids.outputs[0].logprobs for lp in step.values())
    assert all(lp.decoded_token is None for step in ids.prompt_logprobs[1:] for lp in step.values())
    for name in ("sleep", "wake_up", "collective_rpc", "apply_model", "start_profile", "stop_profile"):
        with pytest.raises(ValueError, match=f"LLM.{name} is not supported"):
            getattr(llm, name)()
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*maximum context length"):  # which prompt of the batch
        llm.generate(["short", "long " * 400], SamplingParams(max_tokens=2))
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match=r"LLM\(\.\.\., scheduling_policy=\"priority\"\)"):
        llm.generate(["a"], SamplingParams(max_tokens=1), priority=[1])
