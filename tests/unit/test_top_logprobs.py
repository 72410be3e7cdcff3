"""layers/sampler.top_logprobs: the top logprobs of a row do not depend on the rows beside it, ties included."""

from __future__ import annotations

import pytest
import torch

from pagedserve.layers.sampler import top_logprobs


def _expected(row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The rule written plainly: largest first, equal values in ascending token id."""
    return sorted(((float(v), i) for i, v in enumerate(row.tolist())), key=lambda e: (-e[0], e[1]))[:k]


@pytest.mark.parametrize("k", [1, 3, 20, 60])
def test_ties_go_in_token_id_order_and_a_straddling_tie_takes_the_lowest_ids(k):
    torch.manual_seed(k)
    rows = torch.randint(-4, 0, (8, 5000)).float()  # few distinct values: ties everywhere, across the k-th place too
    rows[3] = torch.linspace(-1, 0, 5000)  # and a row without ties
    values, ids = top_logprobs(rows, k)
    for r in range(8):
        assert list(zip(values[r].tolist(), ids[r].tolist())) == _expected(rows[r], k), f"row {r}"
    # torch.topk's own order among equal values differs (what the rule fixes): not a test of ours, a check that
    # this case has ties it orders otherwise
    if k == 20:
        plain_ids = rows.topk(k, dim=-1).indices
        assert not torch.equal(plain_ids, ids)


def test_a_row_alone_and_in_a_batch_gets_the_same_entries():
    torch.manual_seed(1)
    batch = torch.randint(-6, 0, (16, 3000)).float().log_softmax(dim=-1)
    together = top_logprobs(batch, 5)
    for r in range(16):
        alone = top_logprobs(batch[r:r + 1], 5)
        assert torch.equal(alone[0][0], together[0][r]) and torch.equal(alone[1][0], together[1][r])


def test_edges():
    row = torch.tensor([[0.0, -1.0, -1.0, -3.0, -1.0, -2.0]])
    assert top_logprobs(row, 0)[1].shape == (1, 0)
    assert top_logprobs(row, 6)[1].tolist() == [[0, 1, 2, 4, 5, 3]]  # the whole vocabulary
    assert top_logprobs(row, 3)[1].tolist() == [[0, 1, 2]]  # -1 at ids 1, 2 and 4: the lowest two
    assert top_logprobs(torch.tensor([[-float("inf")] * 3 + [0.0]]), 2)[1].tolist() == [[3, 0]]  # masked tokens


def test_chat_top_logprobs_are_at_most_the_number_asked_when_the_sampled_token_ties():
    """A sampled token outside the top ones that ties the top one shares its rank 1: top_logprobs 1 gave two
    entries (a QA sweep); OpenAI gives exactly N. The top one is kept."""
    from pagedserve.entrypoints.openai.chat_format import chat_logprobs
    from pagedserve.outputs import Logprob

    step = {7: Logprob(-2.336, 1, "Hello"), 3: Logprob(-2.336, 1, "I"), 9: Logprob(-2.5, 2, "We")}
    content = chat_logprobs([7], [step], 1, lambda token_id: b"x")["content"][0]
    assert content["token"] == "Hello" and [t["token"] for t in content["top_logprobs"]] == ["I"]
    two = chat_logprobs([7], [step], 2, lambda token_id: b"x")["content"][0]
    assert [t["token"] for t in two["top_logprobs"]] == ["I", "Hello"]


def test_reasoning_effort_reaches_the_chat_template():
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedserve.entrypoints.openai.serving import _template_kwargs

    messages = [{"role": "user", "content": "x"}]
    assert _template_kwargs(ChatCompletionRequest(messages=messages)) is None
    assert _template_kwargs(ChatCompletionRequest(messages=messages, reasoning_effort="low")) == {
        "reasoning_effort": "low"}
    assert _template_kwargs(ChatCompletionRequest(messages=messages, reasoning_effort="low", chat_template_kwargs={
        "reasoning_effort": "high", "x": 1})) == {"reasoning_effort": "high", "x": 1}  # the request's own kwargs win


def test_the_responses_api_s_reasoning_effort_is_chat_s():
    from pagedserve.entrypoints.openai.protocol import ResponsesRequest
    from pagedserve.entrypoints.openai.serving import _template_kwargs
    from pagedserve.entrypoints.openai.serving_responses import to_chat_request

    chat = to_chat_request(ResponsesRequest(input="x", reasoning={"effort": "medium"}))
    assert _template_kwargs(chat) == {"reasoning_effort": "medium"}
    assert _template_kwargs(to_chat_request(ResponsesRequest(input="x", reasoning={"summary": "auto"}))) is None
