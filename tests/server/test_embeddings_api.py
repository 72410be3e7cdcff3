"""POST /v1/embeddings on real servers, through the official `openai` client: all-MiniLM-L6-v2 (BERT) and a
tiny random Qwen3 served with --runner pooling (Matryoshka `dimensions`)."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from tests.models.real_models import packaged_model
from tests.server.server_utils import openai_client, start_server

MODEL = "minilm"
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A monkey is playing drums.",
             "Paris is the capital of France.", "ok"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(packaged_model("all-minilm-l6-v2")), "--served-model-name", MODEL, "--dtype", "float32",
                       log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(server):
    return openai_client(server)


def as_array(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float64)


def decode_base64(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4").astype(np.float64)


def test_float_and_base64_give_the_same_vectors(server, client):
    floats = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    # Asked for explicitly, the openai client hands base64 back undecoded: read the raw body.
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": SENTENCES,
                                                          "encoding_format": "base64"}, timeout=60).json()
    assert all(isinstance(d["embedding"], str) for d in raw["data"])
    from_base64 = np.stack([decode_base64(d["embedding"]) for d in sorted(raw["data"], key=lambda d: d["index"])])
    vectors = as_array(floats)
    assert vectors.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(from_base64, vectors, rtol=0, atol=1e-7)  # float32 on the wire, both ways
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert floats.object == "list" and floats.model == MODEL and [d.index for d in floats.data] == list(range(5))
    # Without encoding_format the openai client asks for base64 itself and decodes it into floats.
    decoded = client.embeddings.create(model=MODEL, input=SENTENCES)
    np.testing.assert_allclose(as_array(decoded), vectors, atol=1e-7)


def test_vectors_match_sentence_transformers(client):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(packaged_model("all-minilm-l6-v2")), device="cpu").encode(SENTENCES)
    ours = as_array(client.embeddings.create(model=MODEL, input=SENTENCES))
    cosines = (ours * reference).sum(1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999, cosines
    assert ours[0] @ ours[1] > ours[0] @ ours[2]  # related pair above unrelated pair


def test_input_forms_and_usage(server, client):
    tokens = [httpx.post(f"{server.url}/tokenize", json={"prompt": s}).json()["tokens"] for s in SENTENCES[:2]]
    one = client.embeddings.create(model=MODEL, input=SENTENCES[0])
    many = client.embeddings.create(model=MODEL, input=SENTENCES[:2])
    ids = client.embeddings.create(model=MODEL, input=tokens[0])
    id_lists = client.embeddings.create(model=MODEL, input=tokens)
    assert one.usage.prompt_tokens == len(tokens[0]) == one.usage.total_tokens
    assert many.usage.prompt_tokens == id_lists.usage.prompt_tokens == len(tokens[0]) + len(tokens[1])
    np.testing.assert_allclose(as_array(one)[0], as_array(ids)[0], atol=1e-6)
    np.testing.assert_allclose(as_array(many), as_array(id_lists), atol=1e-6)
    np.testing.assert_allclose(as_array(many)[0], as_array(one)[0], atol=1e-5)  # batched = alone


def test_truncate_prompt_tokens(server, client):
    long_text = "word " * 400  # 402 tokens with [CLS] and [SEP], over the 256 limit
    response = client.embeddings.create(model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 10})
    assert response.usage.prompt_tokens == 10
    clipped = client.embeddings.create(model=MODEL, input="word " * 8)  # the same 10 tokens: [CLS] word x8 [SEP]
    np.testing.assert_allclose(as_array(response), as_array(clipped), atol=1e-6)
    # below the special tokens: a 400 (the [CLS] vector alone came back, its usage counted uncut)
    under = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": long_text,
                                                            "truncate_prompt_tokens": 1})
    assert under.status_code == 400 and "fewer than the special tokens" in under.json()["error"]["message"]
    # token ids keep their last k, as vLLM's
    ids = list(range(2000, 2030))
    last = client.embeddings.create(model=MODEL, input=ids, extra_body={"truncate_prompt_tokens": 10})
    np.testing.assert_allclose(as_array(last), as_array(client.embeddings.create(model=MODEL, input=ids[-10:])),
                               atol=1e-6)


def test_add_special_tokens_false_embeds_the_text_alone(server):
    """vLLM's add_special_tokens on /v1/embeddings (it was ignored): no [CLS]/[SEP]."""
    def embed(**fields):
        return httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "hello world", **fields}).json()

    plain, bare = embed(), embed(add_special_tokens=False)
    assert plain["usage"]["prompt_tokens"] == bare["usage"]["prompt_tokens"] + 2
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "hello world",
                                                     "add_special_tokens": False}).json()["tokens"]
    np.testing.assert_allclose(bare["data"][0]["embedding"], embed(input=ids)["data"][0]["embedding"], atol=1e-6)
    refused = embed(priority=3)
    assert refused["error"]["param"] == "priority"



def post_json(url: str, body: dict) -> httpx.Response:
    """POST `body` as JSON escaped to ASCII, as clients send it: httpx's own encoder cannot write a lone surrogate."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)

BAD_REQUESTS = [
    # (path, body, status, words the message must contain)
    ("/v1/embeddings", {"model": MODEL, "input": "word " * 400}, 400, ["256", "402"]),
    ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 64}, 400, ["matryoshka"]),
    ("/v1/embeddings", {"model": MODEL, "input": []}, 400, ["empty"]),
    ("/v1/embeddings", {"model": MODEL, "input": ["fine", ""]}, 400, ["empty"]),
    ("/v1/embeddings", {"model": MODEL, "input": [101, 999999, 102]}, 400, ["999999", "out of range"]),
    ("/v1/embeddings", {"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, ["encoding_format"]),
    ("/v1/embeddings", {"model": MODEL, "input": "x", "truncate_prompt_tokens": 1000}, 400, ["truncate_prompt_tokens"]),
    ("/v1/embeddings", {"model": MODEL, "input": ["x"] * 2049}, 400, ["2049", "at most"]),
    ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, ["does not exist"]),
    ("/v1/embeddings", {"model": MODEL}, 400, ["input"]),
    ("/v1/embeddings", {"model": MODEL, "input": "x", "normalize": "maybe"}, 400, ["normalize"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400,
     ["embeddings", "/v1/chat/completions"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, 400, ["embeddings", "/v1/completions"]),
    # a lone surrogate: the embedding model's transformers tokenizer raised a TypeError (a 500; QA-H)
    ("/v1/embeddings", {"model": MODEL, "input": "\udfff"}, 400, ["input holds a lone surrogate"]),
    ("/v1/embeddings", {"model": MODEL, "input": ["ok", "x\udfff"]}, 400, ["input holds a lone surrogate"]),
    ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, 400, ["prompt holds a lone surrogate"]),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400,  # not "use /v1/completions"
     ["no chat template", "`prompt` (/tokenize)", "`input` (/v1/embeddings)"]),
]


@pytest.mark.parametrize("path,body,status,words", BAD_REQUESTS,
                         ids=[f"{i}-{b[0].rsplit('/', 1)[-1]}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, client, path, body, status, words):
    response = post_json(f"{server.url}{path}", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in error["message"].lower(), error["message"]
    assert client.embeddings.create(model=MODEL, input="still fine").data  # the server keeps serving


def test_normalize_false_returns_the_pooled_vector(server):
    """vLLM's `normalize`: false skips the model's Normalize module, true (or absent) applies it."""
    def embed(**extra):
        body = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": SENTENCES[:3], **extra},
                          timeout=60).json()
        return np.array([d["embedding"] for d in body["data"]], dtype=np.float64)

    raw, default, explicit = embed(normalize=False), embed(), embed(normalize=True)
    norms = np.linalg.norm(raw, axis=1)
    assert np.abs(norms - 1.0).min() > 0.1, norms
    np.testing.assert_allclose(raw / norms[:, None], default, atol=1e-6)
    np.testing.assert_allclose(explicit, default, atol=0)


def st_cosines(pairs: list[tuple[str, str]]) -> list[float]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(packaged_model("all-minilm-l6-v2")), device="cpu")
    a = model.encode([p[0] for p in pairs], convert_to_numpy=True).astype(np.float64)
    b = model.encode([p[1] for p in pairs], convert_to_numpy=True).astype(np.float64)
    return ((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).tolist()


def test_score_and_rerank_are_cosine_similarities(server):
    """vLLM's /score and /rerank on an embedding model, against sentence-transformers' vectors."""
    query = "What is the capital of France?"
    score = httpx.post(f"{server.url}/score", json={"model": MODEL, "text_1": query, "text_2": SENTENCES},
                       timeout=60).json()
    expected = st_cosines([(query, s) for s in SENTENCES])
    assert [d["index"] for d in score["data"]] == list(range(5)) and score["data"][0]["object"] == "score"
    np.testing.assert_allclose([d["score"] for d in score["data"]], expected, atol=1e-4)
    paired = httpx.post(f"{server.url}/v1/score", json={"queries": SENTENCES[:2], "documents": SENTENCES[2:4]},
                        timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in paired["data"]], st_cosines(list(zip(SENTENCES[:2],
                                                                                          SENTENCES[2:4]))), atol=1e-4)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rerank = httpx.post(f"{server.url}{path}", json={"model": MODEL, "query": query, "top_n": 3,
                                                         "documents": SENTENCES[:4] + [{"text": SENTENCES[4]}]},
                            timeout=60).json()
        best = sorted(range(5), key=lambda i: expected[i], reverse=True)[:3]
        assert [r["index"] for r in rerank["results"]] == best, path
        assert [r["document"]["text"] for r in rerank["results"]] == [SENTENCES[i] for i in best]
        np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]], [expected[i] for i in best],
                                   atol=1e-4)
        assert rerank["usage"]["prompt_tokens"] == score["usage"]["prompt_tokens"]  # the query embedded once
    bare = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL, "query": query, "documents": SENTENCES,
                                                       "return_documents": False}, timeout=60).json()
    assert bare["results"] and all("document" not in r for r in bare["results"])  # Jina's and Cohere's


@pytest.mark.parametrize("path,body,param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "documents": ["c"]}, "text_1"),
    ("/rerank", {"query": "a", "documents": ["hello world " * 200]}, "documents"),  # documents[0] is too long
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    # a value of none of a union's types: the field, not a type's name ("documents.0.str", QA-T)
    ("/rerank", {"query": "a", "documents": [{"content": "b"}]}, "documents.0"),
    ("/score", {"text_1": "a", "text_2": [[101, 2000]]}, "text_2"),
    ("/score", {"text_1": "\ud800", "text_2": "b"}, "text_1"),  # lone surrogates: a 500 before (QA-H)
    ("/rerank", {"query": "a", "documents": ["b", "\udfff"]}, "documents"),
])
def test_score_and_rerank_bad_requests(server, path, body, param):
    response = post_json(f"{server.url}{path}", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_score_names_the_text_and_embeds_empty_ones(server):
    long = httpx.post(f"{server.url}/v1/score", json={"text_1": "q", "text_2": ["a", "b", "hello world " * 200]},
                      timeout=30).json()["error"]
    assert long["param"] == "text_2" and "text_2[2] has 402 tokens" in long["message"], long
    # An empty text is [CLS] [SEP] for BERT, as vLLM and sentence-transformers embed it.
    empty = httpx.post(f"{server.url}/v1/score", json={"text_1": "", "text_2": ["", "a"]}, timeout=30).json()
    assert abs(empty["data"][0]["score"] - 1.0) < 1e-5 and empty["usage"]["prompt_tokens"] == 2 + 2 + 3


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="completions"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=MODEL, input="x", dimensions=64)


def test_metrics_count_embedding_requests(server, client):
    def value(name: str) -> float:
        for line in httpx.get(f"{server.url}/metrics").text.splitlines():
            if line.startswith(name) and f'model_name="{MODEL}"' in line and 'finished_reason="stop"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    before = value("vllm:request_success_total")
    client.embeddings.create(model=MODEL, input=SENTENCES[:3])
    assert value("vllm:request_success_total") == before + 3
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="minilm"} 0.0' in httpx.get(f"{server.url}/metrics").text


def test_bench_serve_embeddings_endpoint(server, tmp_path):
    """`pagedserve bench serve --endpoint /v1/embeddings`: requests/s and latency percentiles, counted input."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "serve", "--base-url", server.url, "--endpoint", "/v1/embeddings",
         "--input-len", "16", "--num-prompts", "12", "--max-concurrency", "4", "--no-progress", "--strict",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Request throughput (req/s)" in result.stdout and "P99 E2EL (ms)" in result.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_completed"] == 12 and summary["num_failed"] == 0
    assert summary["total_input_tokens"] == 12 * 16  # token-id prompts: usage counts exactly what was sent
    assert summary["total_output_tokens"] == 0 and summary["request_throughput"] > 0
    assert summary["e2e_latency"]["count"] == 12 and summary["e2e_latency"]["p99"] >= summary["e2e_latency"]["median"]


# ---- a decoder served as an embedder ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_server(tiny_model_dir, tmp_path_factory):
    # vLLM's way to serve a generative model as an embedder; a small queue (2 running + 6 waiting)
    srv = start_server(tiny_model_dir("qwen3", is_matryoshka=True), "--runner", "pooling", "--convert", "embed",
                       "--served-model-name", "tiny-embed", "--dtype", "float32", "--max-num-batched-tokens", "32",
                       "--max-num-seqs", "2", "--max-waiting-requests", "6", log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_decoder_embedder_dimensions(qwen3_server):
    client = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="unused", max_retries=0)
    text = "The quick brown fox jumps over the lazy dog. " * 4  # longer than the 32-token step: chunked
    full = as_array(client.embeddings.create(model="tiny-embed", input=text))[0]
    short = as_array(client.embeddings.create(model="tiny-embed", input=text, dimensions=16))[0]
    assert full.shape == (64,) and short.shape == (16,)
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="between 1 and"):
        client.embeddings.create(model="tiny-embed", input=text, dimensions=100)
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        client.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)


def test_a_call_with_more_inputs_than_the_queue_holds(qwen3_server):
    """A call of more inputs than --max-num-seqs + --max-waiting-requests (8 here) runs them a few at a time (a 400
    before: a client batching at OpenAI's 2048 failed on a default server's 1280), in order, each vector as alone;
    a call that comes meanwhile is served beside it; /rerank takes as many documents."""
    import concurrent.futures

    client = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="unused", max_retries=0)
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'the sea'}" for i in range(30)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        many = pool.submit(client.embeddings.create, model="tiny-embed", input=texts)
        beside = pool.submit(client.embeddings.create, model="tiny-embed", input=texts[:2])
        vectors, pair = as_array(many.result(timeout=120)), as_array(beside.result(timeout=120))
    assert vectors.shape == (30, 64)
    for i in (0, 7, 29):
        alone = as_array(client.embeddings.create(model="tiny-embed", input=texts[i]))[0]
        np.testing.assert_allclose(vectors[i], alone, atol=1e-5)
    np.testing.assert_allclose(pair, vectors[:2], atol=1e-5)
    ranked = httpx.post(f"{qwen3_server.url}/rerank", json={"model": "tiny-embed", "query": texts[0],
                                                             "documents": texts}, timeout=120).json()
    assert ranked["results"][0]["index"] == 0 and len(ranked["results"]) == 30
    metrics = httpx.get(f"{qwen3_server.url}/metrics").text
    assert "vllm:num_requests_running" in metrics and qwen3_server.process.poll() is None
