"""AsyncAPI 3.0 documents of the services, derived from the one event catalogue.

Each message is an event type: its `name` is the CloudEvents type, its headers are those `codec.encode`
(and `signing`) put on the wire, and its payload is the JSON Schema of the event's data, because in binary
mode the body is the data alone. A service *sends* the event types its identity may publish
(`lanes_contract.identities`) and *receives* those its consumers subscribe to; the subjects it reads are
passed in, since only the app may import the services that declare them.

The documents are plain dicts built in a stable order, so the checked-in YAML changes only when the
contract does (`lanes asyncapi` writes them, a unit test keeps them current).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from lanes_contract.codec import CONTEXT_ATTRIBUTES, JSON, MSG_ID_HEADER, SPEC_VERSION
from lanes_contract.events import EVENT_TYPES, Event, Family, Lane
from lanes_contract.identities import Identity, identity_named, subject_matches
from lanes_contract.ids import TOKEN_PATTERN
from lanes_contract.signing import SIGNATURE_HEADER, SIGNER_HEADER
from lanes_contract.streams import STREAM_OF_FAMILY

ASYNCAPI_VERSION = "3.0.0"
ENVELOPE_HEADERS = "CloudEventHeaders"
"""The shared header schema in `components/schemas`; each message narrows `ce-type` and its join keys."""
_SCHEMAS = "#/components/schemas/"
_SERVER = {
    "host": "{host}",
    "protocol": "nats",
    "description": "The NATS server (with JetStream) that holds the Lanes streams: NATS_URL. Each identity"
    " may publish only the subjects of its role (lanes_contract.identities).",
    "variables": {"host": {"default": "localhost:4222", "description": "host:port of NATS_URL"}},
}

_PARAMETERS: dict[Family, tuple[tuple[str, str], ...]] = {
    Family.JOB: (("job", "$message.header#/ce-jobid"),),
    Family.NODE: (("node", "$message.header#/ce-node"),),
    Family.TELEMETRY: (("node", "$message.header#/ce-node"),),
    Family.BEAT: (("node", "$message.header#/ce-node"),),
    # A request's join keys are its model and replica, not a job or node (`RequestServed.nats_subject`).
    Family.REQUEST: (("model", "$message.payload#/model"), ("replica", "$message.payload#/replica")),
}
"""The subject tokens between `lanes.<family>` and the event name, and where each comes from."""

_KEY_RULE = "1-128 characters of A-Z a-z 0-9 _ -, not starting with _ or - (a NATS subject token)"


def address(event: type[Event]) -> str:
    """The channel address of an event type, with its join keys as `{parameters}`."""
    keys = ".".join(f"{{{name}}}" for name, _ in _PARAMETERS[event.family])
    if event.family is Family.REQUEST:
        return f"lanes.{event.family}.{keys}"
    return f"lanes.{event.family}.{keys}.{event.name}"


def _wildcard(event: type[Event]) -> str:
    """The address with each parameter as `*`, to match against NATS permissions and consumer filters."""
    return ".".join("*" if token.startswith("{") else token for token in address(event).split("."))


def _type_of(event: type[Event]) -> str:
    event_type: str = event.model_fields["type"].default
    return event_type


def _channel_id(event: type[Event]) -> str:
    return f"{event.family}_{event.name}"


def _data_model(event: type[Event]) -> type[BaseModel]:
    model = event.model_fields["data"].annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        msg = f"{event.__name__}.data is {model!r}; a message payload needs a pydantic model"
        raise TypeError(msg)
    return model


def _data_schemas() -> tuple[dict[str, str], dict[str, Any]]:
    """The payload `$ref` of each event type, and every schema definition the payloads use."""
    # One pass over every data model, so a name shared by two documents always means the same schema.
    models = sorted({_data_model(event) for event in EVENT_TYPES.values()}, key=lambda model: model.__name__)
    refs, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template=_SCHEMAS + "{model}"
    )
    ref_of_model = {model: schema["$ref"] for (model, _), schema in refs.items()}
    payload_refs = {_type_of(e): ref_of_model[_data_model(e)] for e in EVENT_TYPES.values()}
    return payload_refs, definitions.get("$defs", {})


def _reachable(refs: Iterable[str], definitions: dict[str, Any]) -> dict[str, Any]:
    """The definitions `refs` point at, and those they point at in turn, by name."""
    found: dict[str, Any] = {}
    pending = [ref.removeprefix(_SCHEMAS) for ref in refs]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found[name] = definitions[name]
        pending.extend(ref.removeprefix(_SCHEMAS) for ref in _refs_in(definitions[name]))
    return dict(sorted(found.items()))


def _refs_in(schema: Any) -> Iterable[str]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs_in(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _refs_in(item)


def _header_schema(field: dict[str, Any]) -> dict[str, Any]:
    """A header's schema from its envelope field's: headers are text, so numbers travel as digits."""
    options = [option for option in field.get("anyOf", [field]) if option.get("type") != "null"]
    schema = {key: value for key, value in options[0].items() if key not in {"title", "default"}}
    if schema.get("type") == "integer":
        return {"type": "string", "pattern": "^[1-9][0-9]*$" if schema.get("minimum") == 1 else "^[0-9]+$"}
    if "$ref" in schema:  # the lane, the only enum of the envelope
        return {"type": "string", "enum": [lane.value for lane in Lane]}
    return schema


def envelope_headers() -> dict[str, Any]:
    """The NATS headers every event carries in binary mode (`codec.encode`, then `EventSigner.sign`)."""
    fields = Event.model_json_schema()["properties"]
    properties: dict[str, Any] = {
        MSG_ID_HEADER: {
            "type": "string",
            "description": "`<subject>/<ce-id>`: JetStream stores a re-send once, and an id taken on another"
            " subject never blocks this event.",
        },
        "ce-specversion": {"type": "string", "const": SPEC_VERSION},
    }
    for name in CONTEXT_ATTRIBUTES:
        properties[f"ce-{name}"] = _header_schema(fields[name])
    properties["traceparent"] = _header_schema(fields["traceparent"]) | {"description": "W3C trace context."}
    properties["ce-type"] = {"type": "string", "pattern": r"^io\.lanes\.[a-z]+\.[a-z_]+\.v[0-9]+$"}
    properties["ce-time"]["description"] = "RFC 3339 in UTC with microseconds, e.g. 2026-12-02T10:20:11.123456Z."
    for token in ("jobid", "node"):  # `Token` validates in Python, so pydantic's schema lacks the pattern
        properties[f"ce-{token}"] = {"type": "string", "pattern": TOKEN_PATTERN}
    properties["Content-Type"] = {"type": "string", "const": JSON}
    properties[SIGNER_HEADER] = {
        "type": "string",
        "description": "`<identity>:<key id>` of the Ed25519 key that signed the event (when the producer signs).",
    }
    properties[SIGNATURE_HEADER] = {
        "type": "string",
        "description": "Base64 Ed25519 signature over the subject, the ce-* headers, traceparent, Content-Type,"
        " Nats-Msg-Id and the payload (`lanes_contract.signing.signed_bytes`).",
    }
    required = [MSG_ID_HEADER, "ce-specversion", "ce-id", "ce-source", "ce-type", "ce-time", "ce-lane", "Content-Type"]
    return {"type": "object", "properties": properties, "required": required}


def headers(event: type[Event]) -> dict[str, Any]:
    """The headers of one event type: the envelope's, with its `ce-type` fixed and its join keys required."""
    # The subject is built from these keys, so the envelope requires them (`Event._has_subject_keys`).
    keys = ["ce-jobid"] if event.family is Family.JOB else [] if event.family is Family.REQUEST else ["ce-node"]
    narrowed: dict[str, Any] = {"type": "object", "properties": {"ce-type": {"const": _type_of(event)}}}
    if keys:
        narrowed["required"] = keys
    return {"type": "object", "allOf": [{"$ref": _SCHEMAS + ENVELOPE_HEADERS}, narrowed]}


def _message(event: type[Event], payload_ref: str) -> dict[str, Any]:
    summary = (event.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    return {
        "name": _type_of(event),
        "title": event.__name__,
        "summary": summary,
        "contentType": JSON,
        "headers": headers(event),
        "payload": {"$ref": payload_ref},
    }


def _channel(event: type[Event]) -> dict[str, Any]:
    stream = STREAM_OF_FAMILY[event.family]
    return {
        "address": address(event),
        "description": f"Stored in the JetStream stream {stream.name}, which drops a re-sent Nats-Msg-Id"
        f" within {stream.duplicate_window_s:g} s.",
        "parameters": {
            name: {"description": _KEY_RULE, "location": location} for name, location in _PARAMETERS[event.family]
        },
        "messages": {event.__name__: {"$ref": f"#/components/messages/{event.__name__}"}},
    }


def _operation(action: str, event: type[Event]) -> dict[str, Any]:
    channel = _channel_id(event)
    return {
        "action": action,
        "channel": {"$ref": f"#/channels/{channel}"},
        "messages": [{"$ref": f"#/channels/{channel}/messages/{event.__name__}"}],
    }


def _identity(service: str) -> Identity:
    identity = identity_named(service)
    if identity is None:
        msg = f"unknown service {service!r}: it has no identity in lanes_contract.identities"
        raise ValueError(msg)
    return identity


def sends(service: str | Identity) -> list[type[Event]]:
    """The event types a service's identity may publish, by type."""
    identity = service if isinstance(service, Identity) else _identity(service)
    return [
        e for _, e in sorted(EVENT_TYPES.items()) if any(subject_matches(p, _wildcard(e)) for p in identity.publishes)
    ]


def receives(subjects: Iterable[str]) -> list[type[Event]]:
    """The event types published on subjects matched by any of these consumer filters, by type."""
    filters = tuple(subjects)
    return [e for _, e in sorted(EVENT_TYPES.items()) if any(subject_matches(f, _wildcard(e)) for f in filters)]


def document(service: str | Identity, subscribed: Iterable[str], *, version: str) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of one service (or role), given the subjects its consumers and runners read."""
    identity = service if isinstance(service, Identity) else _identity(service)
    sent, received = sends(identity), receives(subscribed)
    events = sorted({*sent, *received}, key=_type_of)
    payload_refs, definitions = _data_schemas()
    operations = {f"send_{_channel_id(e)}": _operation("send", e) for e in sent}
    operations |= {f"receive_{_channel_id(e)}": _operation("receive", e) for e in received}
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": f"Lanes {identity.name}",
            "version": version,
            "description": f"The Lanes {identity.name} service ({identity.description}): the events it"
            " publishes (send) and consumes (receive) on NATS JetStream, as CloudEvents 1.0"
            " in binary mode (attributes in ce-* headers, the event's data as the JSON body)."
            " Generated from lanes_contract; do not edit by hand.",
        },
        "defaultContentType": JSON,
        "servers": {"nats": _SERVER},
        "channels": {_channel_id(e): _channel(e) for e in events},
        "operations": dict(sorted(operations.items())),
        "components": {
            "messages": {e.__name__: _message(e, payload_refs[_type_of(e)]) for e in events},
            "schemas": {
                ENVELOPE_HEADERS: envelope_headers(),
                **_reachable((payload_refs[_type_of(e)] for e in events), definitions),
            },
        },
    }
