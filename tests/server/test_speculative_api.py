"""`pagedserve serve --speculative-config` (vLLM's flag) with the openai client: the same text as a server
without speculation, streamed or not, and vLLM's spec_decode counters on /metrics; with n-gram lookup and with
a draft model (the target itself, the simplest draft that shares its tokenizer)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.server_utils import module_server, openai_client
from tests.server.test_api import metric_value

MODEL = "tiny"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["The quick brown fox", "Paris is the capital", "def square(x):", "In the beginning"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", weight_std=0.06)  # loops soon: drafts are accepted (tests/models/test_speculative.py)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_server(model_dir, tmp_path_factory, request):
    spec = SPEC if request.param == "ngram" else {"model": model_dir, "num_speculative_tokens": 4}
    yield from module_server(model_dir, "--served-model-name", MODEL, "--max-model-len", "512", "--dtype", "float32",
                             "--speculative-config", json.dumps(spec), tmp_path_factory=tmp_path_factory)


@pytest.fixture(scope="module")
def plain_server(model_dir, tmp_path_factory):
    yield from module_server(model_dir, "--served-model-name", MODEL, "--max-model-len", "512", "--dtype", "float32",
                             tmp_path_factory=tmp_path_factory)


def completions(server, stream: bool) -> list[str]:
    client = openai_client(server)
    texts = []
    for prompt in PROMPTS:
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0)
        if stream:
            texts.append("".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                                 if chunk.choices))
        else:
            texts.append(client.completions.create(**kwargs).choices[0].text)
    return texts


def test_text_and_usage_equal_the_plain_server(spec_server, plain_server):
    expected = completions(plain_server, stream=False)
    assert completions(spec_server, stream=False) == expected
    assert completions(spec_server, stream=True) == expected
    client, plain = openai_client(spec_server), openai_client(plain_server)
    messages = [{"role": "user", "content": "Say something repetitive"}]
    ours = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    ref = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0.0,
                                        logprobs=True, top_logprobs=2)
    assert ours.choices[0].message.content == ref.choices[0].message.content
    assert ours.usage.completion_tokens == ref.usage.completion_tokens
    assert len(ours.choices[0].logprobs.content) == ours.usage.completion_tokens
    for a, b in zip(ours.choices[0].logprobs.content, ref.choices[0].logprobs.content):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4


def test_metrics_count_drafts_under_vllms_names(spec_server):
    completions(spec_server, stream=False)
    drafts = metric_value(spec_server, "vllm:spec_decode_num_drafts_total", model_name=MODEL)
    draft_tokens = metric_value(spec_server, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL)
    accepted = metric_value(spec_server, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    first = metric_value(spec_server, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL,
                         position="0")
    assert 0 < accepted <= draft_tokens and drafts > 0
    assert 0 < first <= drafts
    # every position's counter exists from the start (at 0 until a draft there is accepted), as vLLM's
    assert metric_value(spec_server, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL,
                        position="3") >= 0


def test_bad_config_is_refused_with_the_fix(model_dir):
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", model_dir, "--speculative-config",
                             '{"method": "ngram"}'], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "num_speculative_tokens must be an integer >= 1" in result.stderr
    assert '"method": "ngram", "num_speculative_tokens": 5' in result.stderr


def test_bench_serve_reports_the_acceptance_rate(spec_server, plain_server):
    from pagedserve.benchmarks.report import format_table
    from pagedserve.benchmarks.serve import ServeBenchConfig, run_serve_bench_sync

    def bench(server):
        return run_serve_bench_sync(ServeBenchConfig(base_url=server.url, num_prompts=4, input_len=16, output_len=32,
                                                     max_concurrency=1, show_progress=False))

    result = bench(spec_server)
    assert result.summary.num_completed == 4
    assert 0 < result.spec_accepted_tokens <= result.spec_draft_tokens
    assert f"{result.spec_acceptance_rate:.1%}" in format_table(result)
    plain = bench(plain_server)
    assert plain.spec_draft_tokens is None and "Draft acceptance rate" not in format_table(plain)
