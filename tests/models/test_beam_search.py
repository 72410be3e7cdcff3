"""LLM.beam_search and use_beam_search against a beam search written here on Hugging Face transformers' logits (the
same rules, pagedserve/beam_search.py's docstring): the same beams in the same order, cumulative log-probabilities
within float32 rounding, for several prompts searched in one batch, with and without the prefix cache."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from pagedserve import LLM
from pagedserve.sampling_params import BeamSearchParams
from tests.server.server_utils import module_server

PROMPTS = [[5, 17, 33, 90], [200, 11], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
MARGIN = 1e-3  # the reference's ranking must not hinge on a smaller gap than this (float32 noise is ~1e-5)


def reference_search(model, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float = 1.0
                     ) -> list[tuple[list[int], float]]:
    """Beam search on transformers' float64 log-softmax of each beam's whole sequence (no cache)."""
    beams = [(list(prompt), 0.0)]
    finished = []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                (finished if token == eos else candidates).append((tokens + [token], cum + logprob))
        candidates.sort(key=lambda b: b[1], reverse=True)
        if len(candidates) > width:
            assert candidates[width - 1][1] - candidates[width][1] > MARGIN, "a near tie: choose other prompts"
        beams = candidates[:width]

    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (1 if beam in finished else 0)) ** length_penalty

    ranked = sorted(finished + beams, key=score, reverse=True)
    return ranked[:width]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_beams_equal_a_search_on_transformers_logits(model_dir, hf_model, prefix_caching):
    llm = LLM(model_dir, dtype="float32", max_model_len=128, enable_prefix_caching=prefix_caching, block_size=4)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference_search(hf_model, prompt, 3, 6, eos=2)
        assert [b.tokens for b in output.sequences] == [tokens for tokens, _ in expected]
        for beam, (_, cum) in zip(output.sequences, expected):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert beam.text == llm.get_tokenizer().decode(beam.tokens)  # vLLM's: the prompt included
            assert len(beam.logprobs) == len(beam.tokens) - len(prompt)
    assert llm.engine.scheduler.kv.usage == 0.0  # every block back in the pool
    one_at_a_time = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params, concurrency_limit=1)
    assert [[b.tokens for b in o.sequences] for o in one_at_a_time] == [[b.tokens for b in o.sequences]
                                                                        for o in outputs]


def test_length_penalty_and_refusals(model_dir, hf_model):
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    for penalty in (0.0, 2.0):
        got = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(2, 5, length_penalty=penalty))
        expected = reference_search(hf_model, PROMPTS[0], 2, 5, eos=2, length_penalty=penalty)
        assert [b.tokens for b in got[0].sequences] == [tokens for tokens, _ in expected]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(2, 61))
    with pytest.raises(ValueError, match="beam_width 11 ranks each beam.s 22"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(11, 2))  # 22 candidates > 20
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["hi"], {"beam_width": 2})


def test_a_beam_ended_by_eos_keeps_it_only_with_include_stop_str_in_output(model_dir, hf_model, tmp_path):
    """As vLLM's LLM.beam_search: a finished beam's tokens and text end before its EOS unless
    include_stop_str_in_output (offline they always kept it, and the text showed the EOS token, QA-T). An extra EOS
    id from generation_config.json that the model writes early makes beams finish."""
    import shutil

    with torch.no_grad():
        greedy = hf_model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0].tolist()
    eos = greedy[len(PROMPTS[0]) + 1]
    ending = tmp_path / "model"
    shutil.copytree(model_dir, ending)
    config = json.loads((ending / "generation_config.json").read_text())
    (ending / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, eos]}))
    llm = LLM(str(ending), dtype="float32", max_model_len=64)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    cut, kept = (llm.beam_search(prompt, BeamSearchParams(3, 6, include_stop_str_in_output=keep))[0].sequences
                 for keep in (False, True))
    stopped = [(a, b) for a, b in zip(cut, kept) if a.finish_reason == "stop"]
    assert stopped, [b.finish_reason for b in cut]
    for without, with_eos in stopped:
        assert with_eos.tokens == without.tokens + [eos] and without.tokens[-1] != eos
        assert without.text == llm.get_tokenizer().decode(without.tokens)
        assert with_eos.text == llm.get_tokenizer().decode(with_eos.tokens)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from module_server(model_dir, "--max-model-len", "128", "--dtype", "float32", "--enable-prefix-caching",
                             tmp_path_factory=tmp_path_factory)


def test_use_beam_search_on_the_server(server, hf_model):
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "n": 3, "use_beam_search": True, "logprobs": 2}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    detokenize = lambda ids: httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]  # noqa: E731
    choices = reply["choices"]
    assert len(choices) == 6 and reply["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"])
                                                                             for c in choices)
    for p, prompt in enumerate(PROMPTS[:2]):
        expected = reference_search(hf_model, prompt, 3, 6, eos=2)
        assert [c["index"] for c in choices[3 * p:3 * p + 3]] == [3 * p, 3 * p + 1, 3 * p + 2]
        for choice, (tokens, cum) in zip(choices[3 * p:3 * p + 3], expected):
            generated = tokens[len(prompt):]
            ended = generated[-1] == 2
            assert choice["text"] == detokenize(generated[:-1] if ended else generated)
            assert choice["finish_reason"] == ("stop" if ended else "length")
            assert choice["stop_reason"] == (2 if ended else None)  # vLLM's beam search: the EOS id
            shown = sum(choice["logprobs"]["token_logprobs"])  # the EOS is not shown (nor counted), as vLLM's
            assert shown > cum if ended else shown == pytest.approx(cum, abs=1e-4)
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": PROMPTS[0], "stream": True},
                          timeout=120).text
    texts = {}
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in choices[:3]]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "use_beam_search": True},
        timeout=120).json()
    assert len(chat["choices"]) == 2


@pytest.mark.parametrize("field,value", [("stop", ["x"]), ("logit_bias", {"5": 1.0}), ("min_tokens", 2),
                                         ("response_format", {"type": "json_object"}), ("echo", True),
                                         ("n", 11), ("presence_penalty", 0.5)])
def test_fields_beam_search_cannot_honour_are_refused(server, field, value):
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "use_beam_search": True,
                                                             field: value}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_an_admitted_search_is_never_refused_half_way(model_dir, tmp_path):
    """Capacity 2 (one running, one waiting): a width-2 search takes both places at every step, and plain
    requests sent meanwhile take the places between its steps. The search, once admitted, ends with its beams
    (its later steps were refused with a 429 mid-way, a stream's error event after its 200)."""
    import threading

    from tests.server.server_utils import start_server

    server = start_server(model_dir, "--max-model-len", "128", "--dtype", "float32", "--max-num-seqs", "1",
                          "--max-waiting-requests", "1", log_dir=tmp_path)
    try:
        stop = threading.Event()
        statuses = []

        def crowd() -> None:
            while not stop.is_set():
                statuses.append(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                           timeout=60).status_code)

        thread = threading.Thread(target=crowd)
        thread.start()
        try:
            for stream in (False, True) * 3:
                reply = httpx.post(f"{server.url}/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": 12, "n": 2, "use_beam_search": True, "ignore_eos": True,
                    "stream": stream}, timeout=120)
                if reply.status_code == 429:
                    continue  # refused before it started: allowed
                assert reply.status_code == 200, reply.text
                assert "error" not in reply.text, reply.text
        finally:
            stop.set()
            thread.join()
        assert 200 in statuses
    finally:
        assert server.stop() == 0, server.log()
