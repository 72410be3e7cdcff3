"""`bench serve` against a tiny fake OpenAI-compatible server (FastAPI in a thread on 127.0.0.1).

The fake tokenizes by whitespace (one word = one token, BOS id 0 added to text) and streams one
word per chunk. The model name picks a behaviour: honest, no usage, early stop, wrong usage, flaky.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pagedserve.benchmarks.datasets import build_random_prompts
from pagedserve.benchmarks.serve import ServeBenchConfig, run_serve_bench_sync
from pagedserve.benchmarks.startup import free_port
from pagedserve.cli import bench

MODELS = ["fake", "fake-no-usage", "fake-early-stop", "fake-bad-usage", "fake-flaky", "fake-no-tokenize",
          "fake-speculating", "fake-broken"]
EARLY_STOP_TOKENS = 3


class WordTokenizer:
    """Whitespace tokenizer that grows its vocabulary; id 0 is BOS."""

    def __init__(self) -> None:
        self.word_ids: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = [0]
        for word in text.split():
            if word not in self.word_ids:
                self.word_ids[word] = len(self.word_ids) + 1
                self.words[self.word_ids[word]] = word
            ids.append(self.word_ids[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if i != 0)


def make_app() -> FastAPI:
    app = FastAPI()
    tokenizer = WordTokenizer()
    app.state.prompt_lengths = []  # content tokens of every completion prompt received
    app.state.bodies = []  # every request body served, with its prompt's content ids
    app.state.spec = [0, 0]  # draft tokens, accepted tokens (fake-speculating: every draft accepted)
    counter = itertools.count()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        drafts, accepted = app.state.spec
        return PlainTextResponse(f'vllm:spec_decode_num_draft_tokens_total{{model_name="x"}} {drafts}\n'
                                 f'vllm:spec_decode_num_accepted_tokens_total{{model_name="x"}} {accepted}\n')

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model"} for name in MODELS]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("model") == "fake-no-tokenize":
            return JSONResponse({"error": "not found"}, status_code=404)
        tokens = tokenizer.encode(body["prompt"])
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        return {"prompt": tokenizer.decode((await request.json())["tokens"])}

    async def stream(body: dict[str, Any], num_prompt_tokens: int, is_chat: bool) -> Any:
        model, max_tokens = body["model"], body["max_tokens"]
        num_tokens = min(max_tokens, EARLY_STOP_TOKENS) if model == "fake-early-stop" else max_tokens
        kind = "chat.completion.chunk" if is_chat else "text_completion"
        if is_chat:
            yield _sse({"object": kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        per_chunk = 2 if model == "fake-speculating" else 1  # a verified draft arrives with its token
        for index in range(0, num_tokens, per_chunk):
            await asyncio.sleep(0.002)
            last = index + per_chunk >= num_tokens
            finish = ("length" if num_tokens == max_tokens else "stop") if last else None
            text = "".join(f" word{i}" for i in range(index, min(index + per_chunk, num_tokens)))
            if per_chunk > 1:
                app.state.spec[0] += 1
                app.state.spec[1] += 1
            choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
            yield _sse({"object": kind, "choices": [{**choice, "finish_reason": finish}]})
        if model != "fake-no-usage" and body.get("stream_options", {}).get("include_usage"):
            completion_tokens = num_tokens + 2 if model == "fake-bad-usage" else num_tokens
            usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion_tokens}
            yield _sse({"object": kind, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    def respond(body: dict[str, Any], prompt_ids: list[int], is_chat: bool) -> Any:
        if body["model"] == "fake-flaky" and next(counter) % 2:
            return JSONResponse({"error": {"message": "flaky"}}, status_code=500)
        if body["model"] == "fake-broken":
            return JSONResponse({"error": {"message": "this model refuses every request"}}, status_code=400)
        app.state.prompt_lengths.append(len([i for i in prompt_ids if i != 0]))
        app.state.bodies.append({**body, "prompt_ids": [i for i in prompt_ids if i != 0]})
        return StreamingResponse(stream(body, len(prompt_ids), is_chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        prompt = body["prompt"]
        return respond(body, prompt if isinstance(prompt, list) else tokenizer.encode(prompt), is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        return respond(body, tokenizer.encode(body["messages"][-1]["content"]), is_chat=True)

    return app


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FastAPI]]:
    app = make_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(timeout=10)


def config(base_url: str, **overrides: Any) -> ServeBenchConfig:
    values: dict[str, Any] = dict(
        base_url=base_url,
        input_len=12,
        output_len=5,
        num_prompts=6,
        max_concurrency=3,
        warmup_requests=1,
        ignore_eos=True,
        show_progress=False,
    )
    values.update(overrides)
    return ServeBenchConfig(**values)


def test_honest_server_every_figure_present_and_tokens_equal_usage(fake_server: tuple[str, FastAPI]) -> None:
    base_url, app = fake_server
    app.state.prompt_lengths.clear()
    result = run_serve_bench_sync(config(base_url))
    summary = result.summary
    assert result.model == "fake"  # first id of /v1/models
    assert (summary.num_completed, summary.num_failed) == (6, 0)
    assert summary.total_output_tokens == 6 * 5
    assert summary.total_input_tokens == summary.total_planned_input_tokens == 6 * 12
    assert app.state.prompt_lengths == [12] * 7  # token-exact prompts, warm-up included
    for record in result.records:
        assert record.success and record.output_tokens == record.num_token_chunks == 5
        assert record.prompt_tokens == 12 and len(record.chunk_times) == 5
    for stats in (summary.ttft, summary.tpot, summary.itl, summary.e2e_latency):
        assert stats.count > 0
        assert None not in (stats.mean, stats.median, stats.std, stats.p90, stats.p99)
    assert summary.itl.count == 6 * 4
    assert summary.output_throughput > 0 and summary.request_throughput > 0
    assert summary.cold.num_warmup == 1 and summary.cold.first_request_e2e is not None
    assert sum(r.is_warmup for r in result.records) == 1
    assert (summary.num_usage_missing, summary.num_usage_mismatch, summary.num_early_stop) == (0, 0, 0)
    assert summary.warnings == []


@pytest.mark.parametrize(
    ("model", "field", "count"),
    [
        ("fake-no-usage", "num_usage_missing", 4),
        ("fake-bad-usage", "num_usage_mismatch", 4),
        ("fake-early-stop", "num_early_stop", 4),
    ],
)
def test_dishonest_server_is_flagged(fake_server: tuple[str, FastAPI], model: str, field: str, count: int) -> None:
    base_url, _ = fake_server
    summary = run_serve_bench_sync(config(base_url, model=model, num_prompts=3)).summary
    assert summary.num_completed == 3
    assert getattr(summary, field) == count  # steady and warm-up requests alike
    assert len(summary.warnings) == 1
    if model == "fake-early-stop":
        assert summary.total_output_tokens == 3 * EARLY_STOP_TOKENS
    if model == "fake-bad-usage":
        assert summary.total_output_tokens == 3 * (5 + 2)  # usage is what is counted, and it is flagged


def test_a_speculating_server_s_chunks_of_several_tokens_are_not_flagged(fake_server: tuple[str, FastAPI]) -> None:
    """Against a server that accepts drafts, a chunk carries a token and its verified drafts: usage above the chunk
    count is honest there (every request was flagged "usage != streamed chunks")."""
    base_url, _ = fake_server
    result = run_serve_bench_sync(config(base_url, model="fake-speculating", num_prompts=3))
    assert result.summary.num_usage_mismatch == 0 and not result.summary.warnings
    assert result.summary.total_output_tokens == 3 * 5 and result.spec_acceptance_rate == 1.0


def test_failed_requests_are_counted_and_excluded(fake_server: tuple[str, FastAPI]) -> None:
    base_url, _ = fake_server
    result = run_serve_bench_sync(
        config(base_url, model="fake-flaky", num_prompts=6, warmup_requests=0, max_concurrency=1)
    )
    summary = result.summary
    assert (summary.num_completed, summary.num_failed) == (3, 3)
    assert summary.total_output_tokens == 3 * 5
    assert list(summary.errors.values()) == [3] and "500" in next(iter(summary.errors))


def test_chat_endpoint_text_prompts_are_token_exact(fake_server: tuple[str, FastAPI]) -> None:
    base_url, app = fake_server
    app.state.prompt_lengths.clear()
    result = run_serve_bench_sync(config(base_url, endpoint="/v1/chat/completions", num_prompts=3, range_ratio=0.5))
    summary = result.summary
    assert summary.num_completed == 3 and summary.num_usage_mismatch == 0  # role-only chunk not counted
    planned = [r.planned_prompt_tokens for r in result.records]
    assert sorted(app.state.prompt_lengths) == sorted(planned)  # concurrent requests arrive in any order
    assert all(6 <= n <= 18 for n in planned)
    assert all(r.prompt_tokens == r.planned_prompt_tokens + 1 for r in result.records)  # + BOS


def test_without_tokenize_random_needs_tokenizer_but_jsonl_runs(
    fake_server: tuple[str, FastAPI], tmp_path: Any
) -> None:
    base_url, _ = fake_server
    with pytest.raises(RuntimeError, match="--tokenizer"):
        run_serve_bench_sync(config(base_url, model="fake-no-tokenize"))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "one two three", "max_tokens": 4}\n{"prompt": "four five"}\n')
    result = run_serve_bench_sync(
        config(
            base_url,
            model="fake-no-tokenize",
            dataset="jsonl",
            dataset_path=str(dataset),
            num_prompts=3,
            warmup_requests=0,
        )
    )
    assert [r.max_tokens for r in result.records] == [4, 5, 4]
    assert [r.prompt_tokens for r in result.records] == [4, 3, 4]
    assert result.summary.total_output_tokens == 13


def test_cli_prints_table_and_writes_raw_json(fake_server: tuple[str, FastAPI], tmp_path: Any, capsys: Any) -> None:
    base_url, _ = fake_server
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-prompts",
            "4",
            "--request-rate",
            "200",
            "--ignore-eos",
            "--no-progress",
            "--json",
            str(out),
            "--strict",
        ]
    )
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Median TTFT (ms):" in table and "(cold) vs median" in table
    payload = json.loads(out.read_text())
    assert payload["summary"]["num_completed"] == 4 and payload["summary"]["total_output_tokens"] == 16
    assert len(payload["records"]) == 4 and len(payload["warmup_records"]) == 1
    assert all(len(r["chunk_times"]) == 4 and r["ttft"] > 0 for r in payload["records"])
    args = parser.parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--model",
            "fake-no-usage",
            "--num-prompts",
            "2",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--no-progress",
            "--strict",
        ]
    )
    assert args.func(args) == 1  # --strict: a raised honesty flag fails the run
    assert "WARNING" in capsys.readouterr().out


class MergingTokenizer:
    """Text round-trips lose count: ids 1 ("a") and 2 ("b") re-tokenize as one id 3 ("ab")."""

    source = "merging test tokenizer"
    pieces = {1: "a", 2: "b", 3: "ab", 4: "c"}

    async def encode(self, text: str) -> list[int]:
        ids, index = [], 0
        while index < len(text):
            if text.startswith("ab", index):
                ids.append(3)
                index += 2
            else:
                if text[index] in "abc":  # every other character is dropped
                    ids.append({"a": 1, "b": 2, "c": 4}[text[index]])
                index += 1
        return ids

    async def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_text_prompts_are_adjusted_until_retokenizing_gives_the_planned_count() -> None:
    tokenizer = MergingTokenizer()
    prompts = asyncio.run(build_random_prompts(tokenizer, random.Random(1), [10, 7, 3], [2, 2, 2], as_text=True))
    for prompt, target in zip(prompts, [10, 7, 3]):
        assert prompt.planned_prompt_tokens == len(asyncio.run(tokenizer.encode(prompt.prompt)))
        assert prompt.planned_prompt_tokens == target


def test_an_unwritable_json_path_is_refused_before_the_run(capsys) -> None:
    """--json into a folder that does not exist was found after the whole run, as a traceback."""
    from pagedserve.cli.main import main

    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2",
                 "--json", "/nonexistent-folder/x.json"])
    assert code == 2 and "--json /nonexistent-folder/x.json" in capsys.readouterr().err


def test_save_result_makes_its_folder_and_a_failed_run_says_what_to_check(tmp_path, capsys) -> None:
    """QA-AG: --save-result into a new --result-dir was refused naming --json (never given); vLLM's bench makes the
    folder. No server at the address, or one that wants a key, was httpx's bare words."""
    import httpx

    from pagedserve.cli.bench import run_error
    from pagedserve.cli.main import main

    folder = tmp_path / "new" / "results"
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2", "--save-result",
                 "--result-dir", str(folder)])
    err = capsys.readouterr().err
    assert code == 1 and folder.is_dir() and "--json" not in err
    assert "cannot connect to http://127.0.0.1:1" in err and "is the server running there?" in err
    request = httpx.Request("GET", "http://server/v1/models")
    unauthorized = httpx.HTTPStatusError("401", request=request, response=httpx.Response(401, request=request))
    assert "pass --api-key" in run_error(unauthorized, "http://server", 60.0)
    assert run_error(RuntimeError("3 of 4 requests failed"), "http://server", 60.0) == "3 of 4 requests failed"
    # a file name with a folder that does not exist was said as --result-dir's; a missing dataset file was a bare
    # "[Errno 2]" (QA-C)
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--save-result", "--result-filename",
                 str(tmp_path / "nowhere" / "r.json")])
    assert code == 2 and f"--result-filename {tmp_path / 'nowhere' / 'r.json'}" in capsys.readouterr().err
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--dataset-name", "sharegpt",
                 "--dataset-path", str(tmp_path / "missing.json")])
    assert code == 2 and f"--dataset-path {tmp_path / 'missing.json'}: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("status,code,expected", [(404, None, "none"), (401, None, "raises"),
                                                  (404, "model_not_found", "names the model")])
def test_only_a_missing_tokenize_route_means_no_server_tokenizer(status, code, expected) -> None:
    """A wrong API key (401) and a wrong --model (404 model_not_found) were reported as "the server has no POST
    /tokenize"."""
    import asyncio

    import httpx

    from pagedserve.benchmarks.serve import resolve_tokenizer

    async def run():
        body = {"error": {"message": "The model `m` does not exist.", "code": code}}
        transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await resolve_tokenizer(client, "m", None)

    if expected == "none":
        assert asyncio.run(run()) is None
    elif expected == "raises":
        with pytest.raises(httpx.HTTPStatusError):
            asyncio.run(run())
    else:
        with pytest.raises(RuntimeError, match="the server serves no model 'm': The model `m` does not exist"):
            asyncio.run(run())


def test_a_vllm_bench_serve_command_line_runs_and_saves_vllm_s_result_file(fake_server, tmp_path, capsys) -> None:
    """vLLM's flags: --backend (its endpoint), --host/--port, --random-prefix-len (a prefix every prompt shares),
    --top-p, --burstiness, --disable-tqdm, and --save-result's file with vLLM's flat keys in ms."""
    base_url, app = fake_server
    port = base_url.rsplit(":", 1)[1]
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    app.state.bodies.clear()
    args = parser.parse_args(
        ["bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", port, "--model", "fake",
         "--dataset-name", "random", "--random-input-len", "6", "--random-output-len", "4", "--random-prefix-len",
         "3", "--num-prompts", "4", "--request-rate", "100", "--burstiness", "0.5", "--ignore-eos", "--top-p", "0.9",
         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--label", "run1", "--metadata", "gpu=none",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,75,99", "--goodput", "e2el:60000"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Request goodput (req/s):" in out and "vllm bench serve's format" in out
    assert "P75 TTFT (ms):" in out and "P75 E2EL (ms):" in out  # the asked percentiles the table lacks
    steady = app.state.bodies[1:]  # after the warm-up request
    assert all(b["top_p"] == 0.9 and "prompt" in b for b in steady)  # vllm: /v1/completions
    assert len({tuple(b["prompt_ids"][:3]) for b in app.state.bodies}) == 1 and all(
        len(b["prompt_ids"]) == 9 for b in app.state.bodies)
    [saved] = list(tmp_path.glob("run1-100.0qps-fake-*.json"))
    result = json.loads(saved.read_text())
    assert (result["backend"], result["label"], result["model_id"], result["gpu"]) == ("vllm", "run1", "fake", "none")
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 16
    assert result["output_lens"] == [4] * 4 and len(result["ttfts"]) == 4 and result["burstiness"] == 0.5
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
        assert result[f"p50_{metric}_ms"] == result[f"median_{metric}_ms"]
    assert result["median_e2el_ms"] < 60000


def test_sharegpt_prompts_are_read_as_vllm_reads_them(fake_server, tmp_path) -> None:
    """The first turn is the prompt, the answer's token count its max_tokens; too short turns are skipped."""
    base_url, app = fake_server
    words = " ".join(f"w{i}" for i in range(6))
    data = [{"id": "a", "conversations": [{"from": "human", "value": words}, {"from": "gpt", "value": "w0 w1 w2 w3"}]},
            {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words}]},
            {"id": "one-turn", "conversations": [{"from": "human", "value": words}]},
            {"id": "b", "conversations": [{"from": "human", "value": words + " w9"}, {"from": "gpt", "value": words}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    app.state.bodies.clear()
    result = run_serve_bench_sync(config(base_url, model="fake", dataset="sharegpt", dataset_path=str(path),
                                         num_prompts=2, warmup_requests=0, ignore_eos=True))
    assert result.summary.num_completed == 2
    assert sorted((len(b["prompt_ids"]), b["max_tokens"]) for b in app.state.bodies) == [(6, 4), (7, 6)]
    # a warm-up request on top of the 2 prompts: the usable conversations are reused (vLLM oversamples)
    app.state.bodies.clear()
    result = run_serve_bench_sync(config(base_url, model="fake", dataset="sharegpt", dataset_path=str(path),
                                         num_prompts=2, warmup_requests=1))
    assert result.summary.num_completed == 2 and len(app.state.bodies) == 3
    path.write_text(json.dumps(data[1:3]))
    with pytest.raises(ValueError, match="no usable conversations"):
        run_serve_bench_sync(config(base_url, model="fake", dataset="sharegpt", dataset_path=str(path)))


def test_a_first_request_that_fails_stops_the_run(fake_server, capsys) -> None:
    """As vLLM's initial test run: no load is sent to a server that refuses the first request, and the exit code
    says so (every request failing exited 0 before, the reason only in the JSON's warnings)."""
    base_url, app = fake_server
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    app.state.bodies.clear()
    args = parser.parse_args(["bench", "serve", "--base-url", base_url, "--model", "fake-broken", "--num-prompts",
                              "5", "--input-len", "4", "--output-len", "2", "--no-progress"])
    assert args.func(args) == 1
    assert "the first request failed, so no load was sent" in capsys.readouterr().err
    for bad, says in ((["--burstiness", "0"], "burstiness must be positive"),
                      (["--goodput", "ttft=5"], "--goodput 'ttft=5'"),
                      (["--percentile-metrics", "ttft,foo"], "--percentile-metrics 'foo'")):
        args = parser.parse_args(["bench", "serve", "--base-url", base_url, *bad])
        assert args.func(args) == 2 and says in capsys.readouterr().err
