"""The routing key and replica order of the Ray Serve deployment (entrypoints/ray_serve/routing.py; no ray)."""

from __future__ import annotations

import json
import random

from pagedserve.entrypoints.ray_serve.routing import forwarded_headers, prompt_text, rank_replicas, routing_key

CHAT = "/v1/chat/completions"


def key(body: object, path: str = CHAT, headers: dict | None = None, prefix_chars: int = 32) -> str | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return routing_key(path, headers or {}, raw, prefix_chars)


def test_prompts_sharing_their_first_characters_share_a_key():
    shared = "You are a terse assistant. " * 3
    first = key({"messages": [{"role": "system", "content": shared}, {"role": "user", "content": "hi"}]})
    second = key({"messages": [{"role": "system", "content": shared}, {"role": "user", "content": "bye"}]})
    other = key({"messages": [{"role": "system", "content": "Another prompt entirely."}]})
    assert first == second != other


def test_the_prefix_length_decides_what_counts_as_shared():
    a, b = {"prompt": "abcdefgh-one"}, {"prompt": "abcdefgh-two"}
    assert key(a, "/v1/completions", prefix_chars=8) == key(b, "/v1/completions", prefix_chars=8)
    assert key(a, "/v1/completions", prefix_chars=10) != key(b, "/v1/completions", prefix_chars=10)


def test_session_header_then_user_then_prompt():
    body = {"user": "alice", "prompt": "hello"}
    assert key(body, "/v1/completions", headers={"x-session-id": "s1"}) == "session:s1"
    assert key(body, "/v1/completions") == "user:alice"
    assert key({"prompt": "hello"}, "/v1/completions") == "prefix:hello"


def test_no_key_without_a_prompt_to_key_on():
    assert key(b"{not json") is None
    assert key([1, 2]) is None
    assert key({"messages": []}) is None
    assert key({"prompt": "x"}, "/v1/embeddings") is None
    assert routing_key("/health", {}, b"", 32) is None


def test_prompt_text_of_each_prompt_shape():
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"prompt": [[4, 5], [6]]}) == "4 5"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert prompt_text(parts) == "user\nab\n"


def test_ranking_is_deterministic_and_independent_of_list_order():
    replicas = ["r1", "r2", "r3", "r4"]
    shuffled = random.Random(0).sample(replicas, len(replicas))
    for k in ("prefix:a", "user:bob", "session:42"):
        assert rank_replicas(k, replicas) == rank_replicas(k, shuffled)


def test_keys_spread_over_replicas_and_a_lost_replica_moves_only_its_keys():
    replicas = ["r1", "r2", "r3"]
    keys = [f"prefix:{i}" for i in range(300)]
    first = {k: rank_replicas(k, replicas)[0] for k in keys}
    counts = {r: list(first.values()).count(r) for r in replicas}
    assert min(counts.values()) > 50, counts  # 100 each expected
    after = {k: rank_replicas(k, ["r1", "r3"])[0] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != "r2")
    # ... and each of r2's keys goes to the replica it ranked second before.
    assert all(after[k] == rank_replicas(k, replicas)[1] for k in keys if first[k] == "r2")


def test_a_body_request_id_is_not_overridden_by_ray_s_x_request_id():
    """Ray's proxy adds X-Request-Id (a uuid) to every request and the header wins over the body's request_id, so
    behind --replicas a client's request_id never became the response's id."""
    headers = [(b"host", b"h"), (b"x-request-id", b"8241fc2a-ray"), (b"content-type", b"application/json")]
    named = json.dumps({"prompt": "x", "request_id": "mine"}).encode()
    assert forwarded_headers(headers, named) == [(b"host", b"h"), (b"content-type", b"application/json")]
    for body in (b'{"prompt": "x"}', b'{"request_id": 7}', b'{"request_id": "x"', b"[]", b""):
        assert forwarded_headers(headers, body) == headers, body  # no id of its own: Ray's (or the client's) stays
