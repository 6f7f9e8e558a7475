"""Continuing a stream on another replica: what the client has, the request for the rest, the rewriting.

The rewriting makes the second replica's events read as the first one's.

Nothing here runs while a stream is healthy: the router only keeps the whole SSE events it forwarded, and
reads them back when a replica fails after the first token. The continuation is textual (the OpenAI API
has no portable way to send token ids back): a chat request gets the text so far as a final assistant
message with vLLM's `continue_final_message`, a completion request gets it appended to its prompt, and
`max_tokens` shrinks by the tokens already sent, so the continued answer ends where the uncut one would.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

ENVELOPE_KEYS = ("id", "created", "model", "system_fingerprint")
"""The fields one stream keeps on every event: a continued stream carries the first replica's values."""

_SEPARATORS = (b"\n\n", b"\r\n\r\n")


def split_whole_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` cut after its last complete SSE event: (whole events, the incomplete rest).

    Only whole events are forwarded, so a replica that dies mid-event never leaves half an event at the
    client for the continuation to follow.
    """
    cut = max(data.rfind(sep) + len(sep) if data.rfind(sep) >= 0 else 0 for sep in _SEPARATORS)
    return data[:cut], data[cut:]


def _payloads(data: bytes) -> Iterable[bytes]:
    for line in data.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                yield payload


@dataclass(slots=True)
class SentSoFar:
    """What the client has received of one stream, read back from the events forwarded to it."""

    text: str = ""
    """The answer's text so far (chat deltas' content, or completions' text)."""
    tokens: int = 0
    """Token events sent: one SSE event with text carries one token in vLLM's streams."""
    finished: bool = False
    """A choice already carried its `finish_reason`: nothing is left to generate."""
    envelope: dict[str, Any] = field(default_factory=dict)
    """The first event's id, created, model and system_fingerprint."""


def read_sent(sent: Iterable[bytes]) -> SentSoFar:
    """What the client has of the answer, from the whole SSE events forwarded to it (in order)."""
    so_far = SentSoFar()
    parts: list[str] = []
    for chunk in sent:
        for payload in _payloads(chunk):
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if not so_far.envelope:
                so_far.envelope = {key: event[key] for key in ENVELOPE_KEYS if key in event}
            choices = event.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                continue  # the usage event, or an error
            choice = choices[0]
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str) and piece:
                # An event with no text (vLLM's opening role event, a closing finish event) is no token.
                parts.append(piece)
                so_far.tokens += 1
            if choice.get("finish_reason"):
                so_far.finished = True
    so_far.text = "".join(parts)
    return so_far


class NotContinuableError(ValueError):
    """This request cannot be continued by text (several choices, echo, a prompt of token ids...)."""


def continuation_body(body: bytes, so_far: SentSoFar, *, chat: bool) -> bytes:
    """The request that asks another replica for the rest of the answer: the prompt plus what was sent."""
    try:
        request: Any = json.loads(body)
    except ValueError as exc:
        raise NotContinuableError(str(exc)) from exc
    if not isinstance(request, dict):
        msg = "the body is not a JSON object"
        raise NotContinuableError(msg)
    if request.get("n", 1) != 1 or request.get("best_of", 1) != 1:
        msg = "a request for several choices is not continued"
        raise NotContinuableError(msg)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = request.get(key)
        if isinstance(limit, int) and limit > 0:
            # The continued answer may use only what the first replica left of the budget.
            request[key] = max(1, limit - so_far.tokens)
    if chat:
        _continue_chat(request, so_far.text)
    else:
        _continue_completion(request, so_far.text)
    return json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode()


def _continue_chat(request: dict[str, Any], text: str) -> None:
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        msg = "the chat request has no messages"
        raise NotContinuableError(msg)
    last = messages[-1]
    if request.get("continue_final_message") is True and isinstance(last, dict):
        # The client itself continued an assistant message: the answer so far extends that message.
        content = last.get("content")
        if not isinstance(content, str):
            msg = "the continued final message has no text content"
            raise NotContinuableError(msg)
        messages = [*messages[:-1], {**last, "content": content + text}]
    else:
        messages = [*messages, {"role": "assistant", "content": text}]
    request["messages"] = messages
    request["continue_final_message"] = True
    request["add_generation_prompt"] = False


def _continue_completion(request: dict[str, Any], text: str) -> None:
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or request.get("echo") or request.get("suffix"):
        msg = "only a single text prompt, without echo or suffix, is continued"
        raise NotContinuableError(msg)
    request["prompt"] = prompt + text


class LegRewriter:
    """Makes a continuing replica's events read as the rest of the first replica's stream.

    The envelope (id, created, model, system_fingerprint) is the first event's, and the usage event counts
    the whole answer: the tokens already sent are completion tokens, not prompt tokens. An event is
    re-encoded only when something in it changes, so a backend that already agrees passes byte for byte.
    """

    def __init__(self, so_far: SentSoFar) -> None:
        self._envelope = so_far.envelope
        self._moved = so_far.tokens

    def rewrite(self, data: bytes) -> bytes:
        """The same whole SSE events, with envelope and usage made those of the one stream."""
        out = [
            self._event(block) if block.startswith(b"data:") and block[5:].strip() not in {b"", b"[DONE]"} else block
            for block in data.split(b"\n\n")
        ]
        return b"\n\n".join(out)

    def _event(self, block: bytes) -> bytes:
        try:
            event = json.loads(block[5:])
        except ValueError:
            return block
        if not isinstance(event, dict):
            return block
        changed = False
        for key, value in self._envelope.items():
            if key in event and event[key] != value:
                event[key] = value
                changed = True
        usage = event.get("usage")
        if isinstance(usage, dict) and self._moved:
            completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if isinstance(completion, int) and isinstance(prompt, int):
                usage["completion_tokens"] = completion + self._moved
                usage["prompt_tokens"] = max(0, prompt - self._moved)
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                changed = True
        if not changed:
            return block
        return b"data: " + json.dumps(event, separators=(",", ":")).encode()
