"""Which replica a request prefers: the same session, user or prompt prefix always ranks the replicas the same way.

The key is, in this order: the `x-session-id` header (Ray Serve's session header), the body's `user` field
(OpenAI's end-user id), or the first `prefix_chars` characters of the prompt (a chat's messages as role and text,
in order, as its template lays them out). Requests sharing a key share a prompt prefix or a conversation, so the
replica that served the first holds its KV blocks in its prefix cache. The replicas are ranked by rendezvous
hashing (highest hash of key and replica id first): every router, in any process, ranks them the same, and a
replica that joins or leaves moves only the keys it wins or held. No key (a body that is not JSON, another
route): no preference, the least loaded replica serves.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence

SESSION_HEADER = "x-session-id"
PINNED_PREFIX = "replica:"  # a key naming one replica: the ingress's /health and /metrics fan-out
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")


def routing_key(path: str, headers: Mapping[str, str], body: bytes, prefix_chars: int) -> str | None:
    """The request's routing key, or None when it has no preference (headers with lower-case names)."""
    session = headers.get(SESSION_HEADER)
    if session:
        return f"session:{session}"
    if not path.endswith(ROUTED_PATHS) or not body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the replica answers it with its 400
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("user"), str) and request["user"]:
        return f"user:{request['user']}"
    text = prompt_text(request)
    return f"prefix:{text[:prefix_chars]}" if text else None


def forwarded_headers(headers: Sequence[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers a replica gets: without X-Request-Id where the body names its `request_id`. Ray's proxy puts an
    X-Request-Id (a new uuid) on every request, and the header wins over the field (as in vLLM), so behind
    --replicas a client's request_id was never the response's id."""
    if b'"request_id"' not in body:
        return list(headers)
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return list(headers)
    if not isinstance(request, dict) or not isinstance(request.get("request_id"), str):
        return list(headers)
    return [(name, value) for name, value in headers if name.lower() != b"x-request-id"]


def prompt_text(request: Mapping) -> str:
    """The prompt as text, far enough to key on: a completion's (first) prompt, or a chat's messages."""
    messages = request.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, Mapping))
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts goes where its first one goes
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _message_text(message: Mapping) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and
                          isinstance(p.get("text", ""), str))
    return f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n"


def rank_replicas(key: str, replica_ids: Sequence[str]) -> list[str]:
    """The replicas in the order `key` prefers them (rendezvous hashing; the same in every process)."""
    return sorted(replica_ids, key=lambda replica_id: _score(key, replica_id), reverse=True)


def _score(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


# The replica set as the router in this process last saw it, for the ingress's fan-out. It lives here, not in
# router.py: Ray pickles the router's module by value, so router.py's own globals would be a private copy.
_lock = threading.Lock()
_replicas: dict[tuple[str, str], list[dict]] = {}  # (app, deployment) -> [{"replica", "actor_name", "node_id"}]


def publish_replicas(app_name: str, deployment_name: str, replicas: list[dict]) -> None:
    with _lock:
        _replicas[(app_name, deployment_name)] = list(replicas)


def known_replicas(app_name: str, deployment_name: str) -> list[dict]:
    """The replicas the router in this process last heard of (empty before its first update)."""
    with _lock:
        return list(_replicas.get((app_name, deployment_name), []))
