"""The pure parts of streams that survive a replica: reading what was sent, the continuation request, the
rewriting of the continuing replica's events, the toy replica's continuation, and how `lanes requests`
shows a move (issue 44)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from lanes_cli.incident import affected_requests
from lanes_cli.router_cli import tries_text
from lanes_contract.events import RequestAttempt
from lanes_contract.jobs import FailoverPolicy, ServingSpec
from lanes_router.domain.continuation import (
    LegRewriter,
    NotContinuableError,
    SentSoFar,
    continuation_body,
    read_sent,
    split_whole_events,
)
from lanes_sandbox.toy_replica import Behaviour, ToyReplica


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(content: str, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": content} if role else {"content": content}
    envelope = {"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": "fp-a"}
    return _event(envelope | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_only_whole_events_are_cut_off_a_read() -> None:
    assert split_whole_events(b"data: a\n\ndata: b") == (b"data: a\n\n", b"data: b")
    assert split_whole_events(b"data: a\r\n\r\ndata") == (b"data: a\r\n\r\n", b"data")
    assert split_whole_events(b"data: half") == (b"", b"data: half")
    assert split_whole_events(b"data: a\n\n") == (b"data: a\n\n", b"")


def test_what_was_sent_is_read_back_as_text_tokens_and_the_envelope() -> None:
    sent = [_chunk("", role=True), _chunk("Hello") + _chunk(", world"), b": keep-alive\n\n"]
    so_far = read_sent(sent)
    assert so_far.text == "Hello, world"
    assert so_far.tokens == 2  # the opening role event carries no token
    assert not so_far.finished
    assert so_far.envelope == {"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": "fp-a"}
    assert read_sent([_chunk("end", finish="stop")]).finished
    completions = _event({"id": "cmpl-1", "choices": [{"index": 0, "text": "abc", "finish_reason": None}]})
    assert read_sent([completions]).text == "abc"


def test_a_chat_continues_its_answer_as_the_final_assistant_message_within_the_same_budget() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}).encode()
    continued = json.loads(continuation_body(body, SentSoFar(text="tok0 tok1 ", tokens=2), chat=True))
    assert continued["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "tok0 tok1 "},
    ]
    assert continued["continue_final_message"] is True
    assert continued["add_generation_prompt"] is False
    assert continued["max_tokens"] == 8  # 10 asked, 2 already sent


def test_a_chat_that_itself_continued_a_message_extends_that_message() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    body = json.dumps({"model": "m", "messages": messages, "continue_final_message": True}).encode()
    continued = json.loads(continuation_body(body, SentSoFar(text="one two", tokens=2), chat=True))
    assert continued["messages"][-1] == {"role": "assistant", "content": "Sure: one two"}
    assert len(continued["messages"]) == 2  # no message added


def test_a_completion_continues_with_its_prompt_extended() -> None:
    body = json.dumps({"model": "m", "prompt": ["Once upon"], "max_tokens": 3}).encode()
    continued = json.loads(continuation_body(body, SentSoFar(text=" a time", tokens=2), chat=False))
    assert continued["prompt"] == "Once upon a time"
    assert continued["max_tokens"] == 1


@pytest.mark.parametrize(
    ("request_body", "chat"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, True),
        ({"model": "m", "prompt": "x", "echo": True}, False),
        ({"model": "m", "prompt": [1, 2, 3]}, False),
        ({"model": "m", "messages": []}, True),
    ],
)
def test_requests_text_cannot_continue_are_refused(request_body: dict[str, Any], chat: bool) -> None:
    with pytest.raises(NotContinuableError):
        continuation_body(json.dumps(request_body).encode(), SentSoFar(text="x", tokens=1), chat=chat)


def test_the_continuing_replica_s_events_get_the_first_envelope_and_the_whole_answer_s_usage() -> None:
    so_far = read_sent([_chunk("a", role=True), _chunk("b")])
    rewriter = LegRewriter(so_far)
    theirs = _event({"id": "chatcmpl-2", "created": 9, "model": "m", "system_fingerprint": "fp-b", "choices": []})
    assert json.loads(rewriter.rewrite(theirs)[5:]) | {"choices": []} == so_far.envelope | {"choices": []}
    usage = _event({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    rewritten = json.loads(rewriter.rewrite(usage)[5:])
    assert rewritten["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    # An event that already agrees passes byte for byte (no re-encoding on the way).
    same = _chunk("c")
    assert rewriter.rewrite(same + b"data: [DONE]\n\n") == same + b"data: [DONE]\n\n"


async def _toy_stream(client: TestClient[Any, Any], body: dict[str, Any]) -> bytes:
    response = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "req-1"})
    assert response.status == 200  # HTTP OK
    return await response.read()


@pytest.mark.parametrize("cut_at", [1, 3, 7])
async def test_a_toy_stream_cut_and_continued_is_byte_for_byte_the_uncut_one(cut_at: int) -> None:
    # Two toy replicas (two processes' worth of state, one model and version) in this process.
    first = ToyReplica("m", "v1", Behaviour(tokens=8))
    second = ToyReplica("m", "v1", Behaviour(tokens=8))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "max_tokens": 8,
        "stream_options": {"include_usage": True},
    }
    async with TestClient(TestServer(first.application())) as a, TestClient(TestServer(second.application())) as b:
        uncut = await _toy_stream(a, body)
        events = [block + b"\n\n" for block in uncut.split(b"\n\n") if block]
        sent = events[:cut_at]
        so_far = read_sent(sent)
        continued_body = json.loads(continuation_body(json.dumps(body).encode(), so_far, chat=True))
        rest = await _toy_stream(b, continued_body)
    assert b"".join(sent) + LegRewriter(so_far).rewrite(rest) == uncut


async def test_the_toy_refuses_a_continuation_that_is_not_its_own_answer() -> None:
    toy = ToyReplica("m", "v1", Behaviour(tokens=8))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "tok0 tok2 "}]
    body = {"model": "m", "messages": messages, "continue_final_message": True, "stream": True}
    async with TestClient(TestServer(toy.application())) as client:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 400  # a doubled or lost token is the router's bug, told
        assert "not this model's answer" in (await response.json())["error"]["message"]


def test_the_serving_spec_continues_by_default_and_older_specs_stay_valid() -> None:
    spec = ServingSpec.model_validate({"model": "m", "version": "v1"})
    assert spec.continuation == "text"
    assert spec.failover == FailoverPolicy(
        connect_failure="retry_elsewhere", mid_stream="continue_elsewhere", max_continuations=2
    )
    assert ServingSpec(model="m", version="v1", continuation="none").continuation == "none"


def test_lanes_requests_shows_where_a_stream_moved() -> None:
    attempts = (
        RequestAttempt(replica="a", outcome="failed_mid_stream", elapsed_ms=1, first_token=0, tokens_sent=37),
        RequestAttempt(replica="b", outcome="ok", elapsed_ms=1, first_token=37, tokens_sent=23),
    )
    assert tries_text(attempts, moved=True) == "a:failed_mid_stream[0:37) > b:ok[37:60)"
    assert tries_text(attempts, moved=False) == "a:failed_mid_stream > b:ok"
    assert tries_text((), moved=False) == "-"


def test_the_incident_bundle_says_a_cut_stream_was_continued_and_where() -> None:
    attempts = [
        {"replica": "chat-a", "node": "n1", "outcome": "failed_mid_stream", "first_token": 0, "tokens_sent": 5},
        {"replica": "chat-b", "node": "n2", "outcome": "ok", "first_token": 5, "tokens_sent": 7},
    ]

    def row(request_id: str, status: str, continuations: int) -> dict[str, Any]:
        data = {
            "request_id": request_id,
            "replica": "chat-b",
            "status": status,
            "http_status": 200,
            "attempts": attempts,
            "continuations": continuations,
        }
        return {"time": "2026-01-01T00:00:00Z", "data": data}

    touched = affected_requests([row("moved", "ok", 1), row("cut", "failed", 0)], "chat-a")
    assert touched["outcomes"] == {"continued": 1, "failed_mid_stream": 1}
    moved = next(r for r in touched["requests"] if r["request_id"] == "moved")
    assert moved["moved_at_tokens"] == [5]
