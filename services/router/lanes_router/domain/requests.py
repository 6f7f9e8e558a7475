"""What the router reads out of an OpenAI-style request body, and the answers it gives without a replica.

Bodies are passed through to the replica byte for byte; the router only reads `model`, `stream` and the
start of the prompt (for prefix affinity). A version is pinned with the `X-Lanes-Model-Version` header, or
with `"model": "name@version"` (then the body is rewritten to the bare name, which is what the replica
serves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lanes_contract.ids import is_valid_token
from lanes_contract.jobs import ProtectionMode, ServingSpec

VERSION_HEADER = "X-Lanes-Model-Version"
AFFINITY_PREFIX_CHARS = 256
"""How much of the prompt keys prefix affinity: a shared system prompt maps to the same replica (KV cache)."""


class BadRequestError(ValueError):
    """The request can never be routed as sent (HTTP 400); the message tells the client what to fix."""


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """The routing-relevant part of one completion request."""

    model: str
    version: str | None
    stream: bool
    body: bytes
    affinity_key: str | None


def parse_inference_request(body: bytes, pinned_header: str | None, *, affinity: bool) -> InferenceRequest:
    """Read model, pin and stream flag from a request body; raise BadRequestError when it cannot be routed."""
    try:
        parsed: Any = json.loads(body)
    except (ValueError, RecursionError) as exc:
        msg = f"the request body is not valid JSON: {exc}"
        raise BadRequestError(msg) from exc
    if not isinstance(parsed, dict):
        msg = "the request body must be a JSON object"
        raise BadRequestError(msg)
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        msg = "`model` is required and must be a string"
        raise BadRequestError(msg)
    stream = parsed.get("stream", False)
    if not isinstance(stream, bool):
        msg = "`stream` must be true or false"
        raise BadRequestError(msg)
    name, _, in_name = model.partition("@")
    version = pinned_header.strip() if pinned_header is not None else None
    if in_name and version is not None and in_name != version:
        msg = f"the model pins version {in_name!r} but {VERSION_HEADER} pins {version!r}"
        raise BadRequestError(msg)
    version = version or in_name or None
    for what, value in (("model", name), ("version", version)):
        if value is not None and not is_valid_token(value):
            msg = f"{what} {value!r} is not a name Lanes serves (1-128 characters from A-Z a-z 0-9 _ -)"
            raise BadRequestError(msg)
    if in_name:
        parsed["model"] = name
        body = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
    return InferenceRequest(name, version, stream, body, _affinity_key(parsed) if affinity else None)


def _affinity_key(parsed: dict[str, Any]) -> str | None:
    messages = parsed.get("messages")
    if isinstance(messages, list) and messages:
        first = messages[0]
        content = first.get("content") if isinstance(first, dict) else None
        return content[:AFFINITY_PREFIX_CHARS] if isinstance(content, str) and content else None
    prompt = parsed.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt[:AFFINITY_PREFIX_CHARS]
    return None


@dataclass(frozen=True, slots=True)
class Refusal:
    """The answer when no replica can take a request: HTTP status, error type, message, Retry-After."""

    http_status: int
    error_type: str
    message: str
    retry_after_s: int | None = None


def protection_refusal(spec: ServingSpec, *, reason: str, waited: bool) -> Refusal:
    """What the deployment's protection mode answers when no replica has room (`waited`: after queueing)."""
    target = f"{spec.model}@{spec.version}"
    if spec.protection is ProtectionMode.REJECT:
        return Refusal(429, "rate_limited", f"{target}: {reason}; try again later", spec.retry_after_s)
    if spec.protection is ProtectionMode.QUEUE and waited:
        message = f"{target}: {reason} after waiting {spec.queue_timeout_s:g}s in the queue"
        return Refusal(503, "overloaded", message, spec.retry_after_s)
    return Refusal(503, "overloaded", f"{target}: {reason}; intake is paused", spec.retry_after_s)


SHARED_STATE_RETRY_AFTER_S = 2


def shared_state_unavailable(detail: str) -> Refusal:
    """The 503 when the routers' shared concurrency state cannot be reached.

    No slot can be counted, so no request is let through (which could overload a replica), and the client
    is told when to retry.
    """
    message = f"the router cannot count in-flight requests right now ({detail}); try again shortly"
    return Refusal(503, "shared_state_unavailable", message, SHARED_STATE_RETRY_AFTER_S)


def unknown_version(model: str, version: str, known: tuple[str, ...]) -> Refusal:
    """The 404 for a pin to a version of a served model that no replica has ever announced."""
    listed = ", ".join(known) or "none"
    return Refusal(404, "version_not_found", f"{model}@{version} has no replica (versions of {model}: {listed})")


MODEL_NOT_FOUND = "model_not_found"


def unknown_model(model: str, known: tuple[str, ...]) -> Refusal:
    """The 404 for a model no inference job serves."""
    listed = ", ".join(known) or "none"
    return Refusal(404, MODEL_NOT_FOUND, f"model {model!r} is not served here (models: {listed})")
