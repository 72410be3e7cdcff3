"""`pagedserve run-batch`: an OpenAI Batch API file through the server's routes in-process, one output line per
input line in input order, errors as lines (vLLM's run-batch)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys


def test_a_batch_file_gets_one_answer_per_line_in_order(tiny_model_dir, tmp_path):
    requests = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}},
        {"custom_id": "cmpl", "url": "/v1/completions", "body": {"prompt": ["a", "b"], "max_tokens": 2,
                                                                 "ignore_eos": True, "temperature": 0}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/nope", "body": {}},
        {"custom_id": "bad-value", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 7}},
        {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
        {"custom_id": "surrogate", "url": "/v1/completions", "body": {"prompt": "x\ud800"}},  # a 500 ended the run
        {"custom_id": "bad-call", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "x"}]}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests) + "\nnot json\n")  # line 9, after a blank one
    target = tmp_path / "out.jsonl"
    # through a pipe (/dev/stdin here; `-i <(...)` alike), which reads once: the check's pass through the input
    # left nothing for the batch ("0 requests, 0 failed", exit 0)
    run = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", "/dev/stdin", "-o", str(target),
                          tiny_model_dir("llama"), "--dtype", "float32", "--max-model-len", "256"],
                         input=source.read_text(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "run-batch: 8 requests, 6 failed" in run.stderr
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["chat", "cmpl", "bad-url", "bad-value", "streamed", "surrogate",
                                                     "bad-call", None]
    assert [line["response"]["status_code"] for line in lines] == [200, 200, 400, 400, 400, 400, 400, 400]
    chat, cmpl = lines[0]["response"]["body"], lines[1]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    assert [c["index"] for c in cmpl["choices"]] == [0, 1] and cmpl["usage"]["completion_tokens"] == 4
    assert lines[0]["error"] is None and "url must be one of" in lines[2]["error"]["message"]
    assert lines[3]["response"]["body"]["error"]["param"] == "top_p" and "top_p" in lines[3]["error"]["message"]
    assert "stream is not available" in lines[4]["error"]["message"]
    assert "surrogate" in lines[5]["error"]["message"] and "tool_calls" in lines[6]["error"]["message"]
    assert "line 9 must be a JSON object" in lines[7]["error"]["message"]
    assert len({line["id"] for line in lines}) == 8


def test_embedding_score_and_rerank_lines(tmp_path):
    from tests.models.real_models import packaged_model

    requests = [
        {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": ["a cat", "a dog"]}},
        {"custom_id": "score", "url": "/v1/score", "body": {"text_1": "a cat", "text_2": ["a cat", "a dog"]}},
        {"custom_id": "rerank", "url": "/v1/rerank", "body": {"query": "a cat", "documents": ["stocks", "a cat"]}},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    run = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(source), "-o", str(target),
                          str(packaged_model("all-minilm-l6-v2"))], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    emb, score, rerank = (json.loads(line)["response"] for line in target.read_text().splitlines())
    assert [r["status_code"] for r in (emb, score, rerank)] == [200, 200, 200]
    assert len(emb["body"]["data"]) == 2
    scores = [d["score"] for d in score["body"]["data"]]
    assert abs(scores[0] - 1.0) < 1e-5 and scores[1] < scores[0]
    assert [r["index"] for r in rerank["body"]["results"]] == [1, 0]


def test_a_line_the_server_fails_on_is_a_500_line_and_the_rest_run():
    """A fault in the app while it answers one line (an exception out of a route) is that line's 500, with the
    other lines answered: it ended the whole batch, with no output file, before."""
    from fastapi import FastAPI

    from pagedserve.cli.run_batch import run_lines

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        if body.get("prompt") == "boom":
            raise RuntimeError("a fault")
        return {"echo": body["prompt"]}

    lines = [(n, json.dumps({"custom_id": p, "url": "/v1/completions", "body": {"prompt": p}}))
             for n, p in ((1, "a"), (3, "boom"), (4, "b"))]
    results = []
    assert asyncio.run(run_lines(app, lines, 2, results.append)) == (3, 1)
    assert [r["custom_id"] for r in results] == ["a", "boom", "b"]
    assert [r["response"]["status_code"] for r in results] == [200, 500, 200]
    assert results[2]["response"]["body"] == {"echo": "b"} and results[2]["error"] is None
    assert results[1]["response"]["body"] is None and results[1]["error"]["message"]


def test_custom_ids_are_required_and_unique_and_lines_are_written_as_they_finish():
    """vLLM's and OpenAI's batch lines carry a unique custom_id; output lines reach `write` in input order as the
    batch runs (a long batch's file grows; it was written only at the end, and lost if it could not be)."""
    from fastapi import FastAPI

    from pagedserve.cli.run_batch import run_lines

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return {"echo": body["prompt"]}

    def line(custom_id, prompt="p") -> str:
        return json.dumps({**({} if custom_id is None else {"custom_id": custom_id}), "url": "/v1/completions",
                           "body": {"prompt": prompt}})

    results = []
    lines = [(1, line("a")), (2, line(None)), (3, line("a", "again")), (4, line(7)), (5, line("b"))]
    assert asyncio.run(run_lines(app, iter(lines), 4, results.append)) == (5, 3)
    assert [r["response"]["status_code"] for r in results] == [200, 400, 400, 400, 200]
    assert "custom_id must be a non-empty string" in results[1]["error"]["message"]
    assert "custom_id 'a' repeats line 1's" in results[2]["error"]["message"]


def test_an_output_that_cannot_be_written_fails_before_the_model_loads(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n")
    run = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(source), "-o",
                          str(tmp_path / "missing" / "out.jsonl"), "/nonexistent/model"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "No such file or directory" in run.stderr and "Traceback" not in run.stderr
    assert "--output-file" in run.stderr


def test_a_model_that_does_not_start_keeps_an_earlier_output(tmp_path, capsys):
    """The output is emptied only once the model has loaded: a typo in its name kept nothing of the last run's.
    (In this process: each case ends before a model loads.)"""
    from pagedserve.cli.main import main

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n")
    target.write_text('{"earlier": "results"}\n')
    assert main(["run-batch", "-i", str(source), "-o", str(target), "smollm2-135m-instrct"]) == 2
    assert "Did you mean smollm2-135m-instruct" in capsys.readouterr().err
    assert target.read_text() == '{"earlier": "results"}\n'
    fresh = tmp_path / "new.jsonl"  # one that did not exist is not left behind empty
    assert main(["run-batch", "-i", str(source), "-o", str(fresh), "smollm2-135m-instrct"]) == 2
    assert not fresh.exists()
    capsys.readouterr()
    assert main(["run-batch", "-i", str(tmp_path), "-o", str(fresh), "smollm2-135m-instruct",
                 "--max-concurrency", "1"]) == 2
    assert f"--input-file {tmp_path}: Is a directory" in capsys.readouterr().err
    # the same file as input and output (here through a symlink): opening the output emptied the input, and the
    # batch ran nothing with exit 0
    alias = tmp_path / "alias.jsonl"
    alias.symlink_to(source)
    assert main(["run-batch", "-i", str(source), "-o", str(alias), "smollm2-135m-instruct"]) == 2
    assert f"--output-file {alias} is the --input-file" in capsys.readouterr().err
    assert source.read_text().startswith('{"custom_id": "a"')


def test_lines_are_read_as_the_batch_goes_and_nothing_is_kept():
    """A long file: at most twice --max-concurrency lines are read ahead of the oldest unwritten one (every line
    was read, and a task made for it, up front, and every output kept to the end: ~2 KB a line)."""
    from fastapi import FastAPI

    from pagedserve.cli.run_batch import run_lines

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        await asyncio.sleep(0)
        return {"echo": body["prompt"]}

    read = [0]
    ahead = []

    def lines():
        for number in range(1, 2001):
            read[0] += 1
            yield number, json.dumps({"custom_id": str(number), "url": "/v1/completions", "body": {"prompt": "p"}})

    written = []

    def write(result: dict) -> None:
        written.append(result["custom_id"])
        ahead.append(read[0] - len(written))

    assert asyncio.run(run_lines(app, lines(), 4, write)) == (2000, 0)
    assert written == [str(n) for n in range(1, 2001)] and max(ahead) <= 8


def test_input_and_output_may_be_urls_as_vllm_s_run_batch(tiny_model_dir, tmp_path):
    """-i URL is fetched (GET) and -o URL gets the output with PUT at the end, as vLLM's run-batch does; with
    --enable-metrics the batch serves /metrics meanwhile."""
    import http.server
    import threading

    from tests.server.server_utils import free_port

    request = {"custom_id": "a", "url": "/v1/completions",
               "body": {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}}
    uploads = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b"\xff\xfe not text" if self.path == "/latin1.jsonl" else (json.dumps(request) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self):  # noqa: N802
            uploads[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    metrics_port = free_port()
    try:
        run = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", f"{base}/in.jsonl", "-o",
                              f"{base}/out.jsonl", "--output-tmp-dir", str(tmp_path), "--enable-metrics", "--port",
                              str(metrics_port), tiny_model_dir("llama"), "--dtype", "float32", "--max-model-len",
                              "128"], capture_output=True, text=True, timeout=300)
        refused = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", f"{base}/latin1.jsonl", "-o",
                                  str(tmp_path / "out.jsonl"), "/nonexistent/model"],
                                 capture_output=True, text=True, timeout=120)
    finally:
        files.shutdown()
    assert refused.returncode == 2 and "latin1.jsonl: not UTF-8 text" in refused.stderr  # as a local file is
    assert run.returncode == 0, run.stderr
    assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in run.stderr
    [line] = [json.loads(text) for text in uploads["/out.jsonl"].decode().splitlines()]
    assert line["custom_id"] == "a" and line["response"]["body"]["usage"]["completion_tokens"] == 2
    assert not list(tmp_path.iterdir())  # the uploaded file's local copy is gone


def test_a_metrics_port_in_use_fails_before_the_model_loads_and_keeps_the_output(tmp_path):
    """It was a traceback after the output file had been emptied."""
    import socket

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n")
    target.write_text("the last run's output\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(source), "-o", str(target),
                              "--enable-metrics", "--port", str(port), "/nonexistent/model"],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"--port {port}:" in run.stderr and "Traceback" not in run.stderr
    assert target.read_text() == "the last run's output\n"
