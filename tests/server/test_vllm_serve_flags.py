"""vLLM's `serve` flags for the chat template, the reply role and HTTP (TLS, CORS, X-Request-Id, docs), on one
real server started as a vLLM user would start it (with flags that have no effect here, which it logs)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.server_utils import free_port, module_server, start_server, tls_context

MODEL = "tiny"
TEMPLATE = "{% if tools %}<<tools:{{ tools | length }}>>{% endif %}{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\\n{% endfor %}{% if add_generation_prompt %}<<bot>>{% endif %}"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (openssl's command line)."""
    directory = tmp_path_factory.mktemp("tls")
    key, crt = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(key), str(crt)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, its generation_config.json recommending greedy sampling (as a model's authors would
    recommend temperature 0.7)."""
    directory = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_model_dir("llama"), directory)
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0, "top_k": 5, "do_sample": True}))
    # a BOS token before every text prompt (as Llama's tokenizer adds), so add_special_tokens shows
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {"type": "TemplateProcessing",
                                   "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                              {"Sequence": {"id": "A", "type_id": 0}}],
                                   "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                                   "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                       "tokens": ["<|im_start|>"]}}}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(directory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, cert):
    key, crt = cert
    yield from module_server(
        model_dir, "--override-generation-config", '{"max_new_tokens": 5}', "--served-model-name", MODEL, "--max-model-len", "256", "--dtype", "float32",
        "--chat-template", TEMPLATE, "--response-role", "bot", "--enable-request-id-headers",
        "--allowed-origins", json.dumps([ORIGIN]), "--disable-fastapi-docs", "--ssl-keyfile", key,
        "--ssl-certfile", crt, "--trust-remote-code", "--swap-space", "4", "--disable-log-requests",
        "--enable-log-requests", "--max-log-len", "12", "--enable-prompt-tokens-details", "--max-logprobs", "30",
        tmp_path_factory=tmp_path_factory, ca_file=crt, env={"PAGEDSERVE_LOG_STATS_INTERVAL": "0.2"})


@pytest.fixture
def http(server, cert):
    with httpx.Client(base_url=server.url, verify=tls_context(cert[1]), timeout=60) as client:
        yield client


def test_the_chat_template_flag_replaces_the_model_s(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    text = "<<system>>Be brief.\n<<user>>Hi\n<<bot>>"
    expected = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert rendered == expected["tokens"]


@pytest.mark.parametrize("fields", [{"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
                                    {"continue_final_message": True, "add_generation_prompt": False},
                                    {"chat_template_kwargs": {"unused": 1}}])
def test_tokenize_renders_messages_as_a_chat_completion_does(http, fields):
    """/tokenize with messages takes the fields that shape a chat prompt (it dropped tools and the rest)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1, **fields})
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages, "return_token_strs": True,
                                             **fields}).json()
    assert tokenized["count"] == chat.json()["usage"]["prompt_tokens"] == len(tokenized["token_strs"])
    plain = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert (plain["tokens"] != tokenized["tokens"]) == ("chat_template_kwargs" not in fields)
    refused = http.post("/tokenize", json={"model": MODEL, "messages": messages, "chat_template": "{{ 'x' }}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    reserved = http.post("/tokenize", json={"model": MODEL, "messages": messages,
                                            "chat_template_kwargs": {"tools": []}})
    assert reserved.status_code == 400 and "may not set tools" in reserved.json()["error"]["message"]


def test_replies_carry_the_response_role_streamed_or_not(server, cert):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=tls_context(cert[1])))
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert client.chat.completions.create(**kwargs).choices[0].message.role == "bot"
    first = next(iter(client.chat.completions.create(stream=True, **kwargs)))
    assert first.choices[0].delta.role == "bot"


def test_requests_that_leave_sampling_out_take_the_model_s_generation_config(http):
    """temperature 0 from generation_config.json (so the text is the greedy one), max_new_tokens 5 from
    --override-generation-config (capping every request's max_tokens, as vLLM's override_max_tokens); a request's
    own sampling values win."""
    def chat(**fields):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], **fields}
        return http.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()

    left_out = [chat() for _ in range(2)]
    greedy = chat(temperature=0, max_tokens=5)
    assert [r["usage"]["completion_tokens"] for r in left_out] == [5, 5]
    assert left_out[0]["choices"][0]["message"]["content"] == left_out[1]["choices"][0]["message"]["content"] \
        == greedy["choices"][0]["message"]["content"]
    assert chat(max_tokens=9)["usage"]["completion_tokens"] == 5 and chat(max_tokens=3)["usage"]["completion_tokens"] == 3
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Count", "max_tokens": 9,
                                                    "ignore_eos": True}).json()
    assert completion["usage"]["completion_tokens"] == 5
    sampled = {chat(temperature=1.0, top_k=0, seed=s)["choices"][0]["message"]["content"] for s in range(6)}
    assert len(sampled) > 1  # the request's temperature, not the default's 0


def test_every_response_carries_an_x_request_id(http):
    given = http.get("/v1/models", headers={"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    fresh = [http.get("/health").headers["x-request-id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(len(value) == 32 for value in fresh)
    assert http.get("/nope").headers["x-request-id"]  # errors too


def test_cors_answers_the_allowed_origin_only(http):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = http.options("/v1/chat/completions", headers={"Origin": "https://other.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    simple = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == ORIGIN


def test_docs_can_be_turned_off_and_plain_http_is_not_served(server, http):
    assert [http.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)


def test_flags_without_effect_are_logged_with_why(server):
    log = server.log()
    assert "--trust-remote-code has no effect: pagedserve runs its own model code" in log
    assert "--swap-space 4 has no effect" in log and "--disable-log-requests has no effect" in log
    assert "serving tiny on https://127.0.0.1" in log
    from pagedserve.entrypoints.openai.api_server import in_container  # a container's published port: --host

    assert ("inside a container: a published port cannot reach it; --host 0.0.0.0" in log) == in_container()
    assert ("requests that leave them out sample with temperature 0.0, top_k 5 (from the model's "
            "generation_config.json and --override-generation-config") in log
    assert "every request's max_tokens is at most 5 (max_new_tokens of --override-generation-config, as vLLM)" in log


@pytest.mark.parametrize("flags,message", [
    (["--chat-template", "missing.jinja"], "--chat-template 'missing.jinja': no such file"),
    (["--chat-template", "{% for m in messages %}"], "--chat-template: the template does not compile"),
    (["--allowed-origins", "https://app.example"], "--allowed-origins must be a JSON list of strings"),
    (["--allowed-origins", '["*"]', "--allow-credentials"], "name the origins"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["-pp", "2"], "--pipeline-parallel-size 2: pipeline parallelism is not supported"),
    (["--override-generation-config", '{"do_sample": true}'], "do_sample cannot be set there"),
    (["--override-generation-config", '{"top_p": 7}'], "top_p must be in (0, 1], got 7"),
    (["--generation-config", "/nonexistent"], "no generation_config.json there"),
])
def test_a_bad_flag_fails_before_the_port_opens(tiny_model_dir, flags, message):
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), "--port", str(port),
                             *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "loading_weights" not in result.stderr


def test_an_https_server_stops_at_once_with_a_client_idling_on_keep_alive(tiny_model_dir, tmp_path, cert):
    """Closing a TLS connection waits for the client's close_notify (asyncio allows 30 s); an idle keep-alive
    client never sends one. The server drops such connections once no request runs, so SIGTERM ends it well
    within the grace period (60 s here; server.stop kills it after 20 s, which would give exit -9)."""
    key, crt = cert
    server = start_server(tiny_model_dir("llama"), "--dtype", "float32", "--max-model-len", "256", "--ssl-keyfile",
                          key, "--ssl-certfile", crt, "--shutdown-grace-s", "60", log_dir=tmp_path, ca_file=crt)
    with httpx.Client(base_url=server.url, verify=tls_context(crt)) as idle:
        assert idle.get("/v1/models").status_code == 200  # the connection stays open, idle
        assert server.stop(timeout=20) == 0, server.log()


def test_the_stats_line_is_logged_while_there_is_work(server, http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in server.log().splitlines() if "Avg generation throughput" in line)
    assert "Avg prompt throughput: " in line and " reqs, KV cache usage: " in line


def test_requests_are_logged_with_their_prompt_cut_to_max_log_len(server, http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "A prompt longer than twelve characters",
                                       "max_tokens": 2, "request_id": "logme"})
    line = next(line for line in server.log().splitlines() if "Received request cmpl-logme" in line)
    assert "prompt: 'A prompt lon', params: SamplingParams(" in line and "max_tokens=2" in line
    assert "tokens)" in line
    # A chat request logs its rendered prompt (it was None), cut the same way.
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}],
                                            "max_tokens": 2, "request_id": "logchat"})
    line = next(line for line in server.log().splitlines() if "Received request chatcmpl-logchat" in line)
    prompt = line.split("prompt: ", 1)[1].split(", params:", 1)[0]
    assert prompt != "None" and len(eval(prompt)) > 0, line  # noqa: S307 - a repr() from our own log


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_served(http):
    prompt = list(range(10, 60))  # 50 token ids: three full 16-token blocks to hit
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    first = http.post("/v1/completions", json=body).json()["usage"]
    assert "prompt_tokens_details" not in first  # nothing cached yet: left out, as vLLM does
    again = http.post("/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 48}
    messages = [{"role": "user", "content": " ".join(["word"] * 40)}]
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    chunks = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                     "stream": True, "stream_options": {"include_usage": True}})
    usage = [json.loads(line[6:]) for line in chunks.text.splitlines() if line.startswith("data: {")][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16


def test_vllm_request_fields_act_or_are_refused_by_name(server, http):
    def complete(**fields):
        return http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4,
                                                 "ignore_eos": True, **fields})

    only = complete(allowed_token_ids=[42], temperature=1.0, top_k=0).json()  # sampled, yet only token 42 is allowed
    assert only["choices"][0]["text"] == http.post("/detokenize", json={"model": MODEL, "tokens": [42] * 4}).json()["prompt"]
    assert complete(allowed_token_ids=[10 ** 6]).json()["error"]["param"] == "allowed_token_ids"
    with_bos, without = complete().json()["usage"], complete(add_special_tokens=False).json()["usage"]
    assert with_bos["prompt_tokens"] == without["prompt_tokens"] + 1
    assert complete(truncate_prompt_tokens=2).json()["usage"]["prompt_tokens"] == 2
    assert complete(truncate_prompt_tokens=0).json()["error"]["param"] == "truncate_prompt_tokens"
    assert complete(bad_words=["x", "the"]).status_code == 200  # vLLM's, honoured (tests/models/test_sampling.py)
    for field, value in (("bad_words", [""]), ("priority", 3), ("length_penalty", 2.0),
                         ("modalities", ["audio"])):
        response = complete(**{field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, field
    assert complete(use_beam_search=False, bad_words=[], priority=0, modalities=["text"]).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    # echo (vLLM's): the final message's text before a reply that continues it, streamed as a chunk of its own
    plain = http.post("/v1/chat/completions", json={**chat, "echo": True, "temperature": 0}).json()
    assert plain["choices"][0]["message"]["content"] == http.post(
        "/v1/chat/completions", json={**chat, "temperature": 0}).json()["choices"][0]["message"]["content"]
    prefill = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "Well,"}], "temperature": 0,
               "continue_final_message": True, "add_generation_prompt": False}
    continued = http.post("/v1/chat/completions", json=prefill).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**prefill, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Well," + continued
    with http.stream("POST", "/v1/chat/completions", json={**prefill, "echo": True, "stream": True}) as response:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in response.iter_lines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert deltas[1] == {"content": "Well,"} and "".join(d.get("content", "") for d in deltas) == "Well," + continued
    # fields that would change the output, refused rather than ignored (a QA sweep found each ignored)
    for field, value in (("best_of", 3), ("prompt_embeds", "AAAA"), ("structural_tag", "{}"),
                         ("repetition_detection", {"max_pattern_size": 4}), ("function_call", {"name": "f"}),
                         ("reasoning_effort", "bogus")):
        response = http.post("/v1/chat/completions", json={**chat, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, field
    assert http.post("/v1/chat/completions", json={**chat, "best_of": 0}).json()["error"]["param"] == "best_of"
    fewer = http.post("/v1/chat/completions", json={**chat, "n": 2, "best_of": 1}).json()["error"]  # QA-AF
    assert fewer["param"] == "best_of" and "must be at least n (2)" in fewer["message"]
    assert http.post("/v1/chat/completions", json={**chat, "best_of": 1, "function_call": "none",
                                                   "reasoning_effort": "low"}).status_code == 200
    # null where OpenAI and vLLM allow it: the default
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "logprobs": None}
    assert http.post("/v1/chat/completions", json={**chat, **nulls}).status_code == 200
    assert complete(n=None, stream=None, echo=None, presence_penalty=None).status_code == 200
    assert complete(prompt=None).status_code == 400  # a required field stays required
    assert http.post("/v1/chat/completions", json={**chat, "stream": True,  # nested, and on the other routes
                                                   "stream_options": {"include_usage": None}}).status_code == 200
    assert http.post("/tokenize", json={"model": MODEL, "messages": chat["messages"], "add_generation_prompt": None,
                                        "return_token_strs": None}).status_code == 200
    # reasoning_effort: checked on /tokenize as on chat; the Responses API's reasoning.effort is chat's
    bogus = http.post("/tokenize", json={"model": MODEL, "messages": chat["messages"], "reasoning_effort": "x"})
    assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "reasoning_effort"
    responses = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    assert http.post("/v1/responses", json={**responses, "reasoning": {"effort": "low"}}).status_code == 200
    assert http.post("/v1/responses", json={**responses, "reasoning": {"effort": "x"}}).status_code == 400
    assert http.post("/v1/chat/completions", json={**chat, "frobnicate": 1, "store": True}).status_code == 200
    assert server.log().count("request field 'frobnicate' is not one pagedserve knows") == 1
    http.post("/v1/chat/completions", json={**chat, "frobnicate": 2})
    assert server.log().count("request field 'frobnicate'") == 1  # once per field, not per request


def test_cache_salt_keeps_prefix_cache_blocks_apart(http):
    body = {"model": MODEL, "prompt": list(range(100, 150)), "max_tokens": 2}

    def cached(**fields):
        usage = http.post("/v1/completions", json={**body, **fields}).json()["usage"]
        return usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 48  # the same salt shares
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0  # another salt, or none, does not
    assert cached() == 48


def test_logprobs_can_name_tokens_by_id(http):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "logprobs": 2, "temperature": 0}
    named = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    ids = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    token_ids = [int(token.removeprefix("token_id:")) for token in ids["tokens"]]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": token_ids}).json()["prompt"] == "".join(named["tokens"])
    assert ids["text_offset"] == named["text_offset"] and ids["token_logprobs"] == named["token_logprobs"]
    assert all(key.startswith("token_id:") for top in ids["top_logprobs"] for key in top)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert all(item["token"].startswith("token_id:") and item["top_logprobs"][0]["token"].startswith("token_id:")
               for item in content)


def test_max_logprobs_raises_the_cap(http):
    # tokens by id: the legacy format keys top_logprobs by token text, which two byte-level tokens can share
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logprobs": 25, "return_tokens_as_token_ids": True}
    top = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(step) >= 25 for step in top)
    assert http.post("/v1/completions", json={**body, "logprobs": 31}).json()["error"]["param"] == "logprobs"


def test_return_token_ids_gives_the_prompt_s_and_each_choice_s_ids_as_vllm(http):
    """vLLM's return_token_ids (RL frameworks read them): prompt_token_ids and each choice's token_ids, streamed
    as each chunk's new ids (those of chunks held back too), the prompt's with the first chunk."""
    def sse(response) -> list[dict]:
        return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]

    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = http.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()["tokens"]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 5
    assert "token_ids" not in http.post("/v1/completions", json={**body, "return_token_ids": None}).json()["choices"][0]
    chunks = sse(http.post("/v1/completions", json={**body, "stream": True}))
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks if "prompt_token_ids" in c["choices"][0]] == [
        prompt_ids]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reply = http.post("/v1/chat/completions", json=chat).json()
    assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
    assert len(reply["choices"][0]["token_ids"]) == 5
    chunks = sse(http.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    assert [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]] == reply["choices"][0]["token_ids"]


def test_legacy_top_logprobs_list_the_chosen_token_first_as_vllm(http):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 12, "logprobs": 1, "temperature": 2.0,
            "seed": 3, "ignore_eos": True, "echo": True}
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    steps = list(zip(logprobs["tokens"], logprobs["top_logprobs"]))[1:]  # the first prompt token has none
    assert all(next(iter(top)) == token for token, top in steps)
    assert any(len(top) == 2 for _, top in steps)  # some chosen tokens were not the top one


def test_a_client_s_request_id_is_the_response_s_id_as_vllm(http):
    """vLLM's ids are {prefix}-{request_id}; pagedserve's carried a suffix, which the engine's ids keep (two
    requests may share a client's id)."""
    import concurrent.futures

    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "request_id": "abc"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: http.post("/v1/completions", json=body).json(), range(2)))
    assert [r["id"] for r in replies] == ["cmpl-abc", "cmpl-abc"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "xyz"}
    assert http.post("/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-xyz"
    chunks = http.post("/v1/chat/completions", json={**chat, "stream": True}).text
    assert '"id":"chatcmpl-xyz"' in chunks.replace(" ", "")
    # the X-Request-Id header first, as vLLM's
    assert http.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr"}).json()["id"] == "cmpl-hdr"
    assert http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "hdr"}).json()["id"] == "chatcmpl-hdr"
    response = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                "request_id": "resp_mine"}).json()
    assert response["id"] == "resp_mine"


def test_response_shapes_carry_vllm_s_keys(http):
    """A model card's permission list and the responses' system_fingerprint (null), as vLLM's (a QA sweep)."""
    card = http.get("/v1/models").json()["data"][0]
    assert [p["object"] for p in card["permission"]] == ["model_permission"] and card["root"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).json()["system_fingerprint"] is None
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    assert "system_fingerprint" in completion and completion["system_fingerprint"] is None
