"""`pagedserve run-batch`: an OpenAI Batch API file through the server's routes in-process, one output line per
input line in input order, errors as lines (vLLM's run-batch)."""

from __future__ import annotations

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
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests) + "not json\n")
    target = tmp_path / "out.jsonl"
    run = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(source), "-o", str(target),
                          tiny_model_dir("llama"), "--dtype", "float32", "--max-model-len", "256"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "run-batch: 6 requests, 4 failed" in run.stderr
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["chat", "cmpl", "bad-url", "bad-value", "streamed", None]
    assert [line["response"]["status_code"] for line in lines] == [200, 200, 400, 400, 400, 400]
    chat, cmpl = lines[0]["response"]["body"], lines[1]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    assert [c["index"] for c in cmpl["choices"]] == [0, 1] and cmpl["usage"]["completion_tokens"] == 4
    assert lines[0]["error"] is None and "url must be one of" in lines[2]["error"]["message"]
    assert lines[3]["response"]["body"]["error"]["param"] == "top_p" and "top_p" in lines[3]["error"]["message"]
    assert "stream is not available" in lines[4]["error"]["message"]
    assert "line 6 must be a JSON object" in lines[5]["error"]["message"]
    assert len({line["id"] for line in lines}) == 6
