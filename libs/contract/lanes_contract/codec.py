"""CloudEvents 1.0 on NATS: binary mode (attributes in `ce-` headers) out, binary or structured mode in.

Binary mode keeps the payload equal to the event's data, so a consumer that only needs the join keys
reads headers and never parses the body. `Nats-Msg-Id` is the event id scoped to its subject
(`ids.dedupe_id`), so JetStream drops a re-sent publish inside the stream's duplicate window, and an id
taken on one subject never blocks an event on another.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import ValidationError

from lanes_contract.errors import DecodeError, InvalidEventError
from lanes_contract.events import EVENT_TYPES, Event
from lanes_contract.ids import dedupe_id

SPEC_VERSION = "1.0"
JSON = "application/json"
STRUCTURED_JSON = "application/cloudevents+json"
MSG_ID_HEADER = "Nats-Msg-Id"
EVENT_ID_HEADER = "ce-id"
"""The header that carries the event id itself (`Nats-Msg-Id` carries it scoped to the subject)."""
MAX_EVENT_BYTES = 256 * 1024
"""The largest payload an event may carry: a timeline of facts, not a file store (the server's own limit,
1 MiB by default, would otherwise fail the publish with a bare MaxPayloadError)."""

# Context attributes carried as headers. `traceparent` keeps its W3C name, as the CloudEvents
# distributed-tracing extension does; everything else is prefixed with `ce-`.
CONTEXT_ATTRIBUTES = (
    "id",
    "source",
    "type",
    "time",
    "subject",
    "lane",
    "jobid",
    "attempt",
    "node",
    "rank",
    "causationid",
    "correlationid",
)
_HEADER_OF = {name: f"ce-{name}" for name in CONTEXT_ATTRIBUTES} | {"traceparent": "traceparent"}
_ATTRIBUTE_OF = {header.lower(): name for name, header in _HEADER_OF.items()}

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""Turns the attributes + data of an old event version into those of the next version (same shape)."""

_UPCASTERS: dict[str, Upcaster] = {}


def register_upcaster(old_type: str, upcaster: Upcaster) -> None:
    """Teach the decoder to read `old_type`: the upcaster returns the event with a newer `type`.

    Upcasters chain, so v1 → v2 → v3 needs one upcaster per step and old events stay readable forever.
    """
    if old_type in EVENT_TYPES:
        msg = f"{old_type} is a current event type; only retired versions get an upcaster"
        raise ValueError(msg)
    _UPCASTERS[old_type] = upcaster


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An event ready for `JetStreamContext.publish`."""

    subject: str
    headers: dict[str, str]
    payload: bytes


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds, e.g. `2026-12-02T10:20:11.123456Z`."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def encode(event: Event, *, revalidate: bool = True) -> EncodedEvent:
    """Encode an event in binary mode; raise InvalidEventError, before anything is sent, if it is invalid.

    `revalidate=False` is for a hot path whose events only ever come from their validating constructors.
    """
    fields = event.model_dump(mode="json")
    try:
        # Re-validate: `model_construct` or `model_copy(update=...)` can build events that skipped validation.
        if revalidate:
            type(event).model_validate(fields)
    except ValidationError as exc:
        raise InvalidEventError(_summarize(event.type, exc)) from exc
    data = fields.pop("data")  # kept whole: a None in the data (exit_code of a killed rank) is information
    headers = {_HEADER_OF[name]: str(value) for name, value in fields.items() if value is not None}
    headers["ce-time"] = format_time(event.time)
    headers["ce-specversion"] = SPEC_VERSION
    headers["Content-Type"] = JSON
    subject = event.nats_subject()
    headers[MSG_ID_HEADER] = dedupe_id(subject, event.id)
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    if len(payload) > MAX_EVENT_BYTES:
        msg = f"{event.type}: its data is {len(payload)} bytes; an event carries at most {MAX_EVENT_BYTES}"
        raise InvalidEventError(msg)
    return EncodedEvent(subject=subject, headers=headers, payload=payload)


def to_structured(event: Event) -> dict[str, Any]:
    """The structured-mode JSON object of an event (what `lanes replay` prints, one per line)."""
    fields = {k: v for k, v in event.model_dump(mode="json").items() if v is not None or k == "data"}
    fields["time"] = format_time(event.time)
    return {"specversion": SPEC_VERSION, "datacontenttype": JSON, **fields}


def structured_line(headers: Mapping[str, str] | None, payload: bytes, extra: Mapping[str, str | int]) -> bytes:
    """One structured-mode JSON line straight from a stored message, without validating it.

    The fast path of `lanes replay`: attributes come from the `ce-` headers and the binary-mode payload
    is spliced in as `data` unparsed, so a million events replay at the speed of the stream. A message
    stored in structured mode is passed through with `extra` merged in. `extra` carries replay-only
    attributes such as the CloudEvents `sequence` extension.
    """
    attributes: dict[str, str | int] = {}
    for key, value in (headers or {}).items():
        # Lanes writes its headers in lower case; other producers may not, hence the second lookup.
        name = _ATTRIBUTE_OF.get(key) or _ATTRIBUTE_OF.get(key.lower())
        if name is not None:
            attributes[name] = value
        elif key.lower() == "ce-specversion":
            attributes["specversion"] = value
    if "specversion" not in attributes:
        body = json.loads(payload)
        return json.dumps({**body, **extra}, separators=(",", ":"), ensure_ascii=False).encode()
    attributes["datacontenttype"] = JSON
    for number in ("attempt", "rank"):  # integers in the model, strings only because headers are text
        text = attributes.get(number)
        if isinstance(text, str) and text.isdigit():
            attributes[number] = int(text)
    attributes.update(extra)
    # orjson writes the same compact UTF-8 JSON as json.dumps(separators=(",", ":"), ensure_ascii=False), and
    # faster: `bench/replay.py --quick` read 41.7k events/s with json (0.70 x a raw ordered consumer, median of 3
    # runs) and 45.6k/s with orjson (0.76), the rest of the gap being the reader's own per-message work.
    head = orjson.dumps(attributes)
    return head[:-1] + b',"data":' + (payload or b"null") + b"}"


def decode(subject: str, headers: Mapping[str, str] | None, payload: bytes) -> Event:
    """Decode a message from the log, in binary or structured mode; raise DecodeError if it is not valid."""
    event = _validated(_fields_of(headers or {}, payload))
    if event.nats_subject() != subject:
        msg = f"subject {subject!r} does not match the event's join keys (expected {event.nats_subject()!r})"
        raise DecodeError(msg)
    return event


def decode_structured(body: bytes) -> Event:
    """Decode one structured-mode CloudEvent that comes without a subject (a file line, an HTTP body)."""
    return _validated(_fields_of({"content-type": STRUCTURED_JSON}, body))


def _validated(fields: dict[str, Any]) -> Event:
    fields = _upcast(fields)
    event_type = fields.get("type")
    cls = EVENT_TYPES.get(event_type) if isinstance(event_type, str) else None
    if cls is None:
        msg = f"unknown event type {event_type!r}"
        raise DecodeError(msg)
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise DecodeError(_summarize(str(event_type), exc)) from exc


def _fields_of(headers: Mapping[str, str], payload: bytes) -> dict[str, Any]:
    lowered = {key.lower(): value for key, value in headers.items()}
    if "ce-specversion" in lowered:
        _check_spec_version(lowered["ce-specversion"])
        fields: dict[str, Any] = {_ATTRIBUTE_OF[key]: value for key, value in lowered.items() if key in _ATTRIBUTE_OF}
        fields["data"] = _parse_json(payload, "payload")
        return fields
    content_type = lowered.get("content-type", "")
    body = _parse_json(payload, "structured-mode body") if payload[:1] == b"{" else None
    if content_type.startswith(STRUCTURED_JSON) or (isinstance(body, dict) and "specversion" in body):
        if not isinstance(body, dict):
            msg = "structured-mode body is not a JSON object"
            raise DecodeError(msg)
        _check_spec_version(body.get("specversion"))
        known = set(CONTEXT_ATTRIBUTES) | {"traceparent", "data"}
        return {key: value for key, value in body.items() if key in known}
    msg = "not a CloudEvent: no ce-specversion header and no structured-mode body"
    raise DecodeError(msg)


def _check_spec_version(value: object) -> None:
    if value != SPEC_VERSION:
        msg = f"unsupported CloudEvents specversion {value!r} (expected {SPEC_VERSION!r})"
        raise DecodeError(msg)


def _parse_json(payload: bytes, what: str) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, over-long integers, deep nesting
        msg = f"{what} is not valid JSON: {exc}"
        raise DecodeError(msg) from exc


def _upcast(fields: dict[str, Any]) -> dict[str, Any]:
    seen: set[str] = set()
    while isinstance(event_type := fields.get("type"), str) and event_type in _UPCASTERS:
        if event_type in seen:
            msg = f"upcasters for {event_type!r} form a cycle"
            raise DecodeError(msg)
        seen.add(event_type)
        fields = _UPCASTERS[event_type](dict(fields))
    return fields


def _summarize(event_type: str, exc: ValidationError) -> str:
    problems = "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'event'}: {error['msg']}" for error in exc.errors()[:5]
    )
    return f"invalid {event_type}: {problems}"
