"""The OpenAI-compatible server, driven by the official `openai` client against a real process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.startup import PHASES

from tests.server.server_utils import module_server, openai_client

MODEL = "tiny"
ALIAS = "tiny-alias"  # a second --served-model-name: requests may use it, replies carry the first


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from module_server(tiny_model_dir("llama"), "--served-model-name", MODEL, ALIAS, "--max-model-len", "256",
                             "--dtype", "float32", "--max-waiting-requests", "64", "--disable-log-stats",
                             "--scheduling-policy", "priority",
                             tmp_path_factory=tmp_path_factory, env={"PAGEDSERVE_LOG_STATS_INTERVAL": "0.1"})


@pytest.fixture
def client(server):
    return openai_client(server)


def metric_value(server, name: str, **labels) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_health_went_503_then_200(server):
    # What the poller saw: 503 with a start-up phase until 200 "ready". A quick start can be over before the
    # first poll lands, so the poller may have seen only the 200; 503 while starting is checked without a race
    # in tests/browser/test_web_routes.py, and the server's own record below lists every phase.
    seen = server.health_statuses
    assert seen[-1] == (200, "ready") and all(status == 503 and phase in PHASES for status, phase in seen[:-1]), seen
    body = httpx.get(f"{server.url}/health").json()
    assert [p["name"] for p in body["phases"]] == list(PHASES), body
    # The memory gauges carry the start-up reading from ready on (they were empty until the first request).
    assert metric_value(server, "pagedserve:resident_memory_bytes", model_name=MODEL) > 0
    # HEAD, as load balancers and uptime checkers probe (it was a 405): the status, no body.
    for path in ("/health", "/ping", "/"):
        head = httpx.head(f"{server.url}{path}")
        assert head.status_code == 200 and head.content == b"", (path, head.status_code, head.content[:80])
    wrong = httpx.put(f"{server.url}/health")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "MethodNotAllowedError"
    assert "GET" in wrong.headers["allow"]  # RFC 9110: a 405 lists the methods the path takes
    # Bodies json.loads cannot read say why ("There was an error parsing the body" before, QA-U).
    headers = {"Content-Type": "application/json"}
    for body, extra, expected in ((b'{"prompt": "\xff"}', {}, "must be UTF-8"),
                                  (b"[" * 5000 + b"]" * 5000, {}, "nest fewer than 1000 levels"),
                                  (b'{"max_tokens": ' + b"1" * 5000 + b"}", {}, "more than 4300 digits"),  # QA-H
                                  (b"\x1f\x8b\x08\x00", {"Content-Encoding": "gzip"}, "Content-Encoding 'gzip'"),
                                  # compressed bytes that happen to be UTF-8 JSON got the syntax error (QA-V)
                                  (b'{"prompt": 1', {"Content-Encoding": "br"}, "Content-Encoding 'br'")):
        for path in ("/v1/completions", "/invocations"):  # /invocations reads its body itself
            response = httpx.post(f"{server.url}{path}", content=body, headers={**headers, **extra})
            assert response.status_code == 400 and expected in response.json()["error"]["message"], response.text
    response = httpx.post(f"{server.url}/invocations", content=b'{"prompt": ', headers=headers)
    assert response.status_code == 400 and "malformed JSON body" in response.json()["error"]["message"], response.text


def test_models_and_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ALIAS]
    assert client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2).model == MODEL
    assert models[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve(MODEL).model_dump() == models[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="`nope/tiny` does not exist"):
        client.models.retrieve("nope/tiny")
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert full.usage.completion_tokens == 20
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > 0
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Say something"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=6, n=2, temperature=1.0, seed=5,
                                    logprobs=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 6
        # OpenAI keys top_logprobs by token text; byte-fragment tokens that decode alike share a key.
        assert all(1 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
        assert any(len(top) >= 3 for top in choice.logprobs.top_logprobs)
        # the chosen token is always among them (OpenAI: up to logprobs + 1), sampled outside the top 3 or not
        assert all(top[token] == lp for token, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                                              choice.logprobs.top_logprobs))
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy


def test_logprobs_0_gives_the_chosen_token_alone(client):
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=5, temperature=2.0, seed=3, logprobs=0)
    logprobs = out.choices[0].logprobs
    assert logprobs.top_logprobs == [{t: lp} for t, lp in zip(logprobs.tokens, logprobs.token_logprobs)]


def test_prompt_logprobs_come_once_whatever_n(server):
    """n > 1 runs n sequences of one prompt: its logprobs were given once per sequence (n times as many)."""
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Paris is big"}).json()["tokens"]
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": chat}).json()["tokens"]
    for n in (1, 3):
        body = {"model": MODEL, "max_tokens": 2, "n": n, "temperature": 1.0, "prompt_logprobs": 1}
        completion = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "Paris is big"}).json()
        assert [len(c["prompt_logprobs"]) for c in completion["choices"]] == [len(prompt_ids)] * n
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": chat}).json()
        assert len(reply["prompt_logprobs"]) == len(rendered)
    echoed = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Paris is big", "n": 2,
                                                              "max_tokens": 2, "echo": True, "logprobs": 1,
                                                              "stream": True})
    chunks = [json.loads(line[6:]) for line in echoed.text.splitlines() if line.startswith("data: {")]
    for index in (0, 1):
        tokens = sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks if c["choices"][0]["index"] == index), [])
        assert len(tokens) == len(prompt_ids) + 2


def test_text_parts_of_a_message_are_joined_by_newlines_as_vllm_does(server):
    def tokens(content) -> list[int]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        return httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]

    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    assert tokens(parts) == tokens("part one\npart two") != tokens("part onepart two")


def test_prompt_forms_and_echo(client):
    ids = client.post("/../tokenize", cast_to=object, body={"model": MODEL, "prompt": "hello world"})["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["hello world", "the fox"], max_tokens=5, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == "hello world" + by_text.choices[0].text
    text = client.post("/../detokenize", cast_to=object, body={"model": MODEL, "tokens": ids})["prompt"]
    assert text == "hello world"


def test_concurrent_streams_match_alone(server, client):
    prompts = [f"Request number {i} says" for i in range(16)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in prompts]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), timeout=120)

    assert asyncio.run(all_at_once()) == alone


def test_disconnect_frees_blocks(server):
    body = {"model": MODEL, "prompt": "The quick brown fox " * 10, "max_tokens": 200, "stream": True,
            "extra_body": None, "ignore_eos": True}
    aborts_before = metric_value(server, "vllm:request_success_total", finished_reason="abort")
    e2e_before = metric_value(server, "vllm:e2e_request_latency_seconds_count")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            assert metric_value(server, "vllm:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 10
    while metric_value(server, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(server, "vllm:kv_cache_usage_perc") == 0
    assert metric_value(server, "vllm:num_requests_running") == 0
    assert metric_value(server, "vllm:request_success_total", finished_reason="abort") == aborts_before + 1
    # vLLM records finished requests only: the aborted one enters no latency histogram
    assert metric_value(server, "vllm:e2e_request_latency_seconds_count") == e2e_before


BAD_REQUESTS = [
    # (path, body or raw bytes, expected status, a word the message must contain)
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "256"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, "out of range"),
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "--enable-auto-tool-choice"),  # tool_choice defaults to "auto", which this server was not started with
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * (9 << 20)}, 413, "exceeds"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800"}', 400, "surrogate"),  # JSON allows it
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages[0].content holds a lone surrogate"),  # named the rendered template's position (QA-Z)
    ("/tokenize", b'{"model": "tiny", "prompt": "x\\ud800"}', 400, "surrogate"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 400, "surrogate"),  # was a 500 (its 404 text)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": "\\ud800"}', 400,
     "surrogate"),  # was a 500 from the block pool's hash
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "surrogate"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chat_template": "{{ 'x' }}"}, 400, "--chat-template"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "only allowed when stream is true"),
    *[("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                            {"role": "assistant", "tool_calls": calls}]}, 400,
       "tool_calls") for calls in ("x", ["x"], [{"function": "f"}], 5, [{"function": {"name": "f", "arguments": 1}}])],
    ("/v1/embeddings", {"model": MODEL, "input": "x"}, 400, "embed"),
    # Longer than any tokenization could fit: refused before tokenizing (a 4 MiB prompt took 16 s to refuse).
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 200_000}, 400, "characters long"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a" * 200_000}]}, 400,
     "the messages are"),
    ("/v1/score", {"model": MODEL, "text_1": "x", "text_2": "y"}, 400,
     "embedding model (e.g. --task embed) for /v1/score"),
    ("/rerank", {"model": MODEL, "query": "x", "documents": ["y"]}, 400,
     "embedding model (e.g. --task embed) for /rerank"),
    ("/detokenize", {"model": MODEL, "tokens": [-5]}, 400, "out of range"),
    *[(path, {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
              "continue_final_message": True, "add_generation_prompt": True}, 400, "add_generation_prompt to false")
      for path in ("/v1/chat/completions", "/tokenize")],
]


@pytest.mark.parametrize("path,body,status,word", BAD_REQUESTS, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_error_body(server, client, path, body, status, word):
    if isinstance(body, bytes):
        response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert word.lower() in error["message"].lower()
    ok = client.completions.create(model=MODEL, prompt="still fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3  # EOS ignored: a sampled EOS ended it at 2 once


def test_a_chunked_body_past_the_limit_is_a_413_before_it_is_read_whole(server, client):
    """A chunked body has no Content-Length: the limit is enforced as it arrives (it was read whole, 30 MB of
    prompt tokenized for a minute, then a 400 for its length), and a body within the limit still works."""
    sent = 0

    def chunks(total: int, piece: bytes):
        nonlocal sent
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        while sent < total:
            sent += len(piece)
            yield piece
        yield b'"}'
    response = httpx.post(f"{server.url}/v1/completions", content=chunks(64 << 20, b"ab " * 20000), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert "exceeds the limit" in response.json()["error"]["message"]
    sent = 0
    response = httpx.post(f"{server.url}/v1/completions", content=chunks(30, b"ab "), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2).usage.completion_tokens >= 1
    # A small Content-Length beside Transfer-Encoding: chunked: the body is read as chunked, so the limit counts it
    # (the header's 5 bytes passed a 20 MiB body)
    import socket

    body = b'{"model": "tiny", "max_tokens": 1, "prompt": "hi", "user": "' + b"a" * (9 << 20) + b'"}'  # valid but big
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):  # the server may answer and close before the whole body is sent
            for start in range(0, len(body), 1 << 16):
                piece = body[start:start + (1 << 16)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sock.sendall(b"0\r\n\r\n")
        status = sock.recv(4096).split(b"\r\n", 1)[0]
    assert b" 413 " in status, status


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_that_finish_early_finish_once(server, path):
    """n > 1, streamed: a choice that stops before the others sends its finish reason once (it was sent again
    every step after, and a required tool call's arguments with it); the streamed text is the whole answer's."""
    prompt = {"prompt": "The quick brown"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "The quick brown"}]}
    body = {"model": MODEL, **prompt, "n": 3, "temperature": 1.0, "seed": 3, "max_tokens": 12, "stop": ["e"]}
    whole = httpx.post(f"{server.url}{path}", json=body, timeout=60).json()
    streamed = httpx.post(f"{server.url}{path}", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    finishes: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    last_chunk: dict[int, int] = {}
    for number, chunk in enumerate(chunks):
        for choice in chunk["choices"]:
            index = choice["index"]
            texts[index] = texts.get(index, "") + (choice.get("text") or (choice.get("delta") or {}).get("content")
                                                   or "")
            if choice["finish_reason"]:
                finishes.setdefault(index, []).append(choice["finish_reason"])
            last_chunk[index] = number
    assert {i: len(f) for i, f in finishes.items()} == {0: 1, 1: 1, 2: 1}
    assert len(set(last_chunk.values())) > 1  # (the choices did end at different steps)
    for choice in whole["choices"]:
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert texts[choice["index"]] == text and finishes[choice["index"]] == [choice["finish_reason"]]


def test_metrics_parse_and_move(server, client):
    before = metric_value(server, "vllm:generation_tokens_total", model_name=MODEL)
    prompts_before = metric_value(server, "vllm:prompt_tokens_total", model_name=MODEL)
    ttft_before = metric_value(server, "vllm:time_to_first_token_seconds_count", model_name=MODEL)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric_value(server, "vllm:generation_tokens_total", model_name=MODEL) == before + 7
    assert metric_value(server, "vllm:prompt_tokens_total", model_name=MODEL) > prompts_before
    assert metric_value(server, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == ttft_before + 1
    # Counters that have not moved yet are exported as 0 from the start, as vLLM's (they had no sample)
    assert metric_value(server, "vllm:num_preemptions_total", model_name=MODEL) == 0
    assert metric_value(server, "vllm:prefix_cache_hits_total", model_name=MODEL) >= 0
    assert metric_value(server, "process_resident_memory_bytes") > 10 << 20  # the process collector, as vLLM's
    assert 1 <= metric_value(server, "pagedserve:cpu_threads", model_name=MODEL) <= max(1, os.cpu_count() or 1)
    names = {f.name for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:request_success", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert name in names


def test_the_metrics_vllm_s_dashboard_reads(server, client):
    """vLLM's stock Grafana dashboard's panels: per-request lengths, prefill/decode/inference times, TPOT under both
    of vLLM's names, the former cache-usage name, cache_config_info; vLLM's bucket edges; no *_created series."""
    def value(name: str, **labels) -> float:
        return metric_value(server, name, model_name=MODEL, **labels)

    names = ("vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_sum",
             "vllm:request_max_num_generation_tokens_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
             "vllm:request_time_per_output_token_seconds_count", "vllm:time_per_output_token_seconds_count",
             "vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum", "vllm:iteration_tokens_total_count",
             "vllm:iteration_tokens_total_sum")
    before = {name: value(name) for name in names}
    completions_ok = {"handler": "/v1/completions", "method": "POST", "status": "2xx"}
    http_before = metric_value(server, "http_requests_total", **completions_ok)
    response = client.completions.create(model=MODEL, prompt="count me", max_tokens=6, temperature=0, n=2,
                                         extra_body={"ignore_eos": True})
    after = {name: value(name) for name in names}
    # n=2: two choices counted as two requests, as vLLM's child requests (n and the longest choice once)
    assert after["vllm:request_prompt_tokens_count"] == before["vllm:request_prompt_tokens_count"] + 2
    assert after["vllm:request_generation_tokens_sum"] == before["vllm:request_generation_tokens_sum"] + 12  # 2 x 6
    assert after["vllm:request_max_num_generation_tokens_count"] == before[
        "vllm:request_max_num_generation_tokens_count"] + 1
    for name in names[3:7]:
        assert after[name] == before[name] + 2, name
    assert after["vllm:time_per_output_token_seconds_count"] > before["vllm:time_per_output_token_seconds_count"]
    assert after["vllm:request_params_n_sum"] == before["vllm:request_params_n_sum"] + 2
    assert after["vllm:request_params_max_tokens_sum"] == before["vllm:request_params_max_tokens_sum"] + 12
    # a step for each token at least (the choices may run apart), the first bringing each choice's prompt
    assert after["vllm:iteration_tokens_total_count"] >= before["vllm:iteration_tokens_total_count"] + 6
    iteration_tokens = after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"]
    assert iteration_tokens == 2 * response.usage.prompt_tokens + 12
    assert metric_value(server, "http_requests_total", **completions_ok) == http_before + 1
    text = httpx.get(f"{server.url}/metrics").text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"}' in text  # vLLM's edges
    assert 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="7680.0",model_name="tiny"}' in text
    assert "_created" not in text and "vllm:gpu_cache_usage_perc" in text
    assert 'vllm:cache_config_info{block_size="16",cache_dtype=' in text and 'engine="0"' in text


def test_disable_log_stats_keeps_the_stats_line_out_of_the_log(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=8)
    time.sleep(0.5)  # five periods of the stats line (PAGEDSERVE_LOG_STATS_INTERVAL)
    assert "Avg generation throughput" not in server.log()


def test_logprobs_past_max_logprobs_are_a_400_naming_the_flag(server, client):
    with pytest.raises(openai.BadRequestError, match=r"logprobs must be at most 20 \(--max-logprobs.*got 21"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="at most 20"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=25)
    huge = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2**63})  # past int64: it was refused naming the engine's "logprobs"
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "top_logprobs", huge.text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions",
                                                               {"messages": [{"role": "user", "content": "Hi"}]})):
        response = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 5, "ignore_eos": True,
                                                           "stream": True, "stream_options": options, **body})
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices") and "usage" in c]
        assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 5, (path, counts)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    # As vLLM counts it: each chunk the usage of its own choice and prompt; chat's role chunks 0 tokens so far.
    for path, body in (("/v1/completions", {"prompt": ["Hi", "Hello there friend"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        response = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 3, "ignore_eos": True,
                                                           "n": 2, "stream": True, "stream_options": options, **body})
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        seen: dict[int, list[int]] = {}
        prompt_tokens: dict[int, set[int]] = {}
        for chunk in chunks[:-1]:
            index = chunk["choices"][0]["index"]
            seen.setdefault(index, []).append(chunk["usage"]["completion_tokens"])
            prompt_tokens.setdefault(index, set()).add(chunk["usage"]["prompt_tokens"])
        for index, counts in seen.items():
            assert counts[-1] == 3 and counts == sorted(counts), (path, index, counts)
            assert len(prompt_tokens[index]) == 1  # its own prompt's, the same in every chunk
        if path == "/v1/completions":
            assert prompt_tokens[0] != prompt_tokens[2]  # two prompts of different lengths, not their sum
        else:
            assert [seen[i][0] for i in range(2)] == [0, 0]  # the role chunks
        assert chunks[-1]["usage"]["completion_tokens"] == (12 if path == "/v1/completions" else 6)
    # `"stream_options": {}` asks for the usage chunk, as vLLM's default include_usage (it was left out)
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "max_tokens": 2, "ignore_eos": True,
                                                               "prompt": "Hi", "stream": True, "stream_options": {}})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert all(c.get("usage") is None for c in chunks[:-1])  # continuous_usage_stats stays off


def test_sagemaker_ping_and_invocations(server):
    assert httpx.get(f"{server.url}/ping").status_code == 200 and httpx.post(f"{server.url}/ping").status_code == 200
    chat = httpx.post(f"{server.url}/invocations", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["model"] == MODEL
    completion = httpx.post(f"{server.url}/invocations", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    embedding = httpx.post(f"{server.url}/invocations", json={"input": "Hi"})
    assert embedding.status_code == 400 and "not embeddings" in embedding.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/invocations", json={"prompt": "Hi", "max_tokens": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    neither = httpx.post(f"{server.url}/invocations", json={"text": "Hi"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    # what any web page may post without a CORS preflight is refused, as on the other routes (it ran generations)
    plain = httpx.post(f"{server.url}/invocations", content='{"prompt": "Hi", "max_tokens": 2}',
                       headers={"Content-Type": "text/plain", "Origin": "https://evil.example"})
    assert plain.status_code == 400 and "Content-Type: application/json" in plain.json()["error"]["message"]
    deep = httpx.post(f"{server.url}/invocations", content='{"prompt": "Hi", "x": ' + "[" * 100000 + "]" * 100000 + "}",
                      headers={"Content-Type": "application/json"})
    assert deep.status_code == 400, deep.text  # a 500 (RecursionError) before


def test_echo_with_logprobs_covers_the_prompt_as_lm_eval_reads_it(server):
    """lm-evaluation-harness's loglikelihood: echo, logprobs 1, max_tokens 1; it sums token_logprobs over the
    prompt's continuation tokens, so they must be there, the first one null, offsets over the echoed text."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "ignore_eos": True}
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": body["prompt"]}).json()["tokens"]
    choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 1 and "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"][0] is None and all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    # the prompt's logprobs are the model's: the same as prompt_logprobs gives them, and streamed the same
    with_prompt = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False, "prompt_logprobs": 1})
    steps = with_prompt.json()["choices"][0]["prompt_logprobs"]
    assert steps[0] is None and len(steps) == len(prompt_ids)
    assert [steps[i][str(t)]["logprob"] for i, t in enumerate(prompt_ids) if i] == logprobs["token_logprobs"][1:-1]
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    merged = {key: sum((c["choices"][0]["logprobs"][key] for c in chunks if c["choices"][0]["logprobs"]), [])
              for key in ("tokens", "token_logprobs", "text_offset")}
    assert merged == {key: logprobs[key] for key in merged}


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2, "prompt_logprobs": 2}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()["tokens"]
    steps = reply["prompt_logprobs"]
    assert steps[0] is None and len(steps) == len(rendered) == reply["usage"]["prompt_tokens"]
    assert all(str(token) in step and len(step) >= 2 for token, step in zip(rendered[1:], steps[1:]))
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs_only(server):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 0, "logprobs": 1, "echo": True}
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": body["prompt"]}).json()["tokens"]
    reply = httpx.post(f"{server.url}/v1/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert reply["usage"]["completion_tokens"] == 0
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["prompt"]
    without_echo = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False})
    assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"


def test_priority_is_taken_where_the_policy_is_priority(client):
    """(Scheduling order itself: tests/unit/test_scheduler.py; a fcfs server refuses a priority: the flags test.)"""
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": -5, "ignore_eos": True})
    assert reply.usage.completion_tokens == 2


def test_continue_final_message_alone_leaves_the_final_message_open(server):
    """add_generation_prompt defaults to true, so continue_final_message alone must not need it set false (vLLM's
    rule: only both set true is refused); the prompt then ends with the final message's text."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    for fields in ({}, {"add_generation_prompt": False}):
        body = {"model": MODEL, "messages": messages, "continue_final_message": True, **fields}
        tokens = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
        text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
        assert text.endswith("Hello th"), text
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1}).json()
        assert reply["usage"]["prompt_tokens"] == len(tokens)


def test_logprob_bytes_and_offsets_follow_characters_split_across_tokens(server):
    """A character split across tokens: each piece's token text is U+FFFD, but its `bytes` are its own (joined,
    the text), and completions' text_offset counts the characters of the text (a split one where it ends)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "pets?"}], "logprobs": True, "top_logprobs": 1,
            "structured_outputs": {"choice": ["🐶🐱 ok"]}}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()["choices"][0]
    content = reply["logprobs"]["content"]
    assert reply["message"]["content"] == "🐶🐱 ok" and any(c["token"] == "\ufffd" for c in content)
    assert content[-1]["token"] == "<|im_end|>"  # the stop token has its logprob, as in vLLM (not its text)
    assert b"".join(bytes(c["bytes"]) for c in content[:-1]) == "🐶🐱 ok".encode()
    assert all(t["bytes"] == c["bytes"] for c in content for t in c["top_logprobs"] if t["token"] == c["token"]
               and t["logprob"] == c["logprob"])
    body = {"model": MODEL, "prompt": "日本語 🐶 test", "max_tokens": 3, "echo": True, "logprobs": 1,
            "temperature": 0, "ignore_eos": True}
    choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert "\ufffd" in tokens[:len(tokens) - 3]  # the prompt's emoji is split
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    whole = [(token, offset) for token, offset in zip(tokens, offsets) if "\ufffd" not in token]
    assert all(text[offset:offset + len(token)] == token for token, offset in whole), list(zip(tokens, offsets))
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert sum((c["choices"][0]["logprobs"]["text_offset"] for c in chunks), []) == offsets


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_counts_once_in_request_success(server, stream):
    """n > 1: a choice that finishes before the last one was left out of the counter (delta outputs carry a
    choice's finish once; only the final output's choices were counted)."""
    def counts() -> dict[str, float]:
        return {reason: metric_value(server, "vllm:request_success_total", finished_reason=reason)
                for reason in ("stop", "length")}

    before = counts()
    body = {"model": MODEL, "prompt": "Count", "n": 6, "max_tokens": 12, "temperature": 1.0, "seed": 3,
            "stop_token_ids": list(range(0, 512, 32)), "stream": stream}  # some choices stop early
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    else:
        reasons = [c["finish_reason"] for c in response.json()["choices"]]
    assert len(reasons) == 6 and set(reasons) == {"stop", "length"}  # some choices end before the others
    after = counts()
    assert {r: after[r] - before[r] for r in after} == {r: reasons.count(r) for r in after}, reasons


def test_a_body_that_is_not_json_says_how_to_send_it(server):
    """curl -d without a content type sends a form: the 400 says to send JSON (it said "body: Input should be a
    valid dictionary")."""
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x"}',
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]


def test_a_loopback_server_answers_only_its_own_host_names(server):
    """DNS rebinding: a page on attacker.example that resolves to 127.0.0.1 is same-origin with the server, so CORS
    never applies; the Host header gives it away (--allowed-hosts names others, e.g. a proxy's)."""
    port = server.url.rsplit(":", 1)[1]
    for host, status in ((f"attacker.example:{port}", 400), (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200),
                         ("LOCALHOST", 200)):
        response = httpx.get(f"{server.url}/v1/models", headers={"Host": host})
        assert response.status_code == status, (host, response.text)
    assert "--allowed-hosts" in httpx.get(f"{server.url}/health", headers={"Host": "evil"}).json()["error"]["message"]
    log = server.log()  # the operator is told too, once per name (a proxy forwarding its clients' Host)
    assert log.count("refused a request with Host 'attacker.example'") == 1
    assert "needs --allowed-hosts '[\"evil\"]'" in log
    import socket  # no Host at all (an HTTP/1.0 health check): no browser sends that, so no rebinding either

    with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert b" 200 " in sock.recv(4096).split(b"\r\n", 1)[0]


def test_allowed_hosts_flag():
    from pagedserve.entrypoints.openai.options import ServeOptions

    assert ServeOptions(allowed_hosts='["api.example", "[::2]"]').host_names() >= {"api.example", "::2", "localhost"}
    assert ServeOptions(allowed_hosts='["*"]').host_names() is None
    assert ServeOptions(host="0.0.0.0").host_names() is None
    with pytest.raises(ValueError, match="--allowed-hosts must be a JSON list"):
        ServeOptions(allowed_hosts="api.example").host_names()


def test_the_host_check_takes_the_server_s_own_address_and_no_host():
    from pagedserve.entrypoints.openai.api_server import _host_name
    from pagedserve.entrypoints.openai.options import ServeOptions

    assert "127.0.0.2" in ServeOptions(host="127.0.0.2").host_names()  # its own URL answered 400
    assert _host_name(b"LocalHost.:8000") == "localhost" and _host_name(b"[::1]:80") == "::1"


def test_tokenize_refuses_what_chat_refuses_and_an_ambiguous_body(server):
    """/tokenize took documents and mm_processor_kwargs without a word (chat refuses them: its tokens would not be
    the chat's), and prompt with messages (messages won)."""
    url, chat = f"{server.url}/tokenize", [{"role": "user", "content": "Hi"}]
    for extra, param in (({"prompt": "x"}, "prompt"), ({"documents": [{"text": "d"}]}, "documents"),
                         ({"mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs")):
        response = httpx.post(url, json={"model": MODEL, "messages": chat, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, extra
    assert httpx.post(url, json={"model": MODEL, "messages": chat, "documents": None}).status_code == 200


def test_the_server_parses_http_with_h11_even_where_httptools_is_installed():
    """uvicorn's "auto" takes httptools where it is installed (`.[ray]` brings it): there the 200 KB header below
    got a bare 400, not 431, and a chunked body past the limit 400, not 413 (the full run failed with ray
    installed)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from pagedserve.entrypoints.openai.http_protocol import http_protocol

    assert issubclass(http_protocol(0), H11Protocol) and issubclass(http_protocol(30), H11Protocol)


@pytest.mark.parametrize("request_head,status,words", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: " + b"a" * 200_000 + b"\r\n\r\n", 431,
     ["request's head", "over 16384 bytes"]),
    (b"NOT AN HTTP REQUEST\r\n\r\n", 400, ["malformed HTTP request"]),
    # a small bad head with a big body behind it: a 400, not a 431 (the body is not the head; QA-H)
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\nContent-Length: 30000\r\n\r\n"
     + b"x" * 30000, 400, ["malformed HTTP request"]),
    # a bad chunk to a route that answers without reading its body: the app's own reply is dropped, with no
    # traceback in the log ("Cannot call write() after write_eof()"; QA-H)
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
     ["malformed HTTP request"]),
], ids=["200 KB header", "garbage", "bad head, big body", "bad chunk"])
def test_a_request_that_does_not_parse_gets_a_json_error(server, client, request_head, status, words):
    """uvicorn answered both with a plain-text 400 "Invalid HTTP request received."."""
    import socket

    host, port = server.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # the server may close before all is sent
            sock.sendall(request_head)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].startswith(f"HTTP/1.1 {status} ".encode()), head
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == status and all(word in error["message"] for word in words), error
    assert client.completions.create(model=MODEL, prompt="still", max_tokens=2).choices  # the server keeps serving
    time.sleep(0.2)  # the app's reply to the bad-chunk request, dropped, is done by now
    assert "Traceback" not in server.log() and "ERROR" not in server.log()
