"""The AsyncAPI documents in docs/asyncapi: current with the catalogue, complete, and true to the wire.

They are what producers in other languages read, so each claim is checked against the code that puts
events on the bus: the header set against `codec.encode` + `EventSigner.sign`, the channel address against
`Event.nats_subject`, the operations against the identities and the services' consumer specs.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.contract import submission
from typer.testing import CliRunner

from lanes_cli.asyncapi_cli import REGENERATE, rendered
from lanes_cli.bootstrap import SERVICES
from lanes_cli.cli import app
from lanes_contract.asyncapi import address, envelope_headers
from lanes_contract.codec import encode
from lanes_contract.events import EVENT_TYPES, Family, JobSubmitted, RequestServed, RequestServedData
from lanes_contract.signing import EventSigner

DOCS = Path(__file__).resolve().parents[2] / "docs" / "asyncapi"
TEXTS = rendered()
DOCUMENTS: dict[str, dict[str, Any]] = {
    name.removesuffix(".yaml"): yaml.safe_load(text) for name, text in TEXTS.items()
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_the_checked_in_document_is_current(name: str) -> None:
    path = DOCS / name
    assert path.is_file(), f"{path} is missing: run `{REGENERATE}` to update docs/asyncapi"
    assert path.read_text(encoding="utf-8") == TEXTS[name], (
        f"{path} differs from the event catalogue: run `{REGENERATE}` to update docs/asyncapi"
    )


def test_there_is_one_document_per_service_and_no_stale_one() -> None:
    assert {path.name for path in DOCS.glob("*.yaml")} == {f"{name}.yaml" for name in [*SERVICES, "agent"]}, (
        f"docs/asyncapi has files no service generates: delete them and run `{REGENERATE}`"
    )


def test_rendering_is_deterministic() -> None:
    assert rendered() == TEXTS


def test_the_command_writes_the_documents_and_check_tells_when_they_drift(tmp_path: Path) -> None:
    runner = CliRunner()
    stale = runner.invoke(app, ["asyncapi", "--dir", str(tmp_path), "--check"])
    assert stale.exit_code == 1
    assert f"run `{REGENERATE} --dir {tmp_path}` to update" in " ".join(stale.output.split())  # rich wraps lines
    assert list(tmp_path.iterdir()) == []  # --check writes nothing
    assert runner.invoke(app, ["asyncapi", "--dir", str(tmp_path)]).exit_code == 0
    assert {path.name: path.read_text(encoding="utf-8") for path in tmp_path.iterdir()} == TEXTS
    assert runner.invoke(app, ["asyncapi", "--dir", str(tmp_path), "--check"]).exit_code == 0


def test_every_event_type_appears_in_at_least_one_document() -> None:
    named = {message["name"] for doc in DOCUMENTS.values() for message in doc["components"]["messages"].values()}
    assert set(EVENT_TYPES) - named == set()
    assert named <= set(EVENT_TYPES)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [node["$ref"]] if "$ref" in node else [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    return []


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_reference_resolves_inside_the_document(service: str) -> None:
    doc = DOCUMENTS[service]
    assert doc["asyncapi"] == "3.0.0"
    for ref in _refs(doc):
        assert ref.startswith("#/"), ref
        _resolve(doc, ref)  # a KeyError names the dangling reference


def _operations(service: str) -> dict[str, set[str]]:
    doc = DOCUMENTS[service]
    found: dict[str, set[str]] = {"send": set(), "receive": set()}
    for operation in doc["operations"].values():
        for ref in operation["messages"]:
            found[operation["action"]].add(_resolve(doc, _resolve(doc, ref["$ref"])["$ref"])["name"])
    return found


def test_operations_follow_identities_and_consumers() -> None:
    scheduler = _operations("scheduler")
    assert "io.lanes.job.placed.v1" in scheduler["send"]
    assert "io.lanes.job.submitted.v1" in scheduler["receive"]
    assert "io.lanes.job.placed.v1" not in scheduler["receive"]
    assert "io.lanes.tel.process.v1" in _operations("telemetry")["receive"]  # lanes.tel.> covers every kind
    # The audit recorder copies the whole job timeline and publishes only its own checkpoints.
    audit = _operations("audit")
    assert audit["send"] == set()
    assert audit["receive"] == {name for name, kind in EVENT_TYPES.items() if kind.family is Family.JOB}
    agent = _operations("agent")  # the node agent's own contract: any node's evidence, its heartbeat, rank events
    assert {"io.lanes.beat.agent.v1", "io.lanes.tel.host.v1", "io.lanes.job.rank_exited.v1"} <= agent["send"]
    assert agent["receive"] == {
        f"io.lanes.job.{name}.v1" for name in ("submitted", "attempt_requested", "placed", "state_changed")
    }
    router = _operations("router")  # a runner, not a ConsumerSpec, reads the registry feed
    assert "io.lanes.job.replica_listening.v1" in router["receive"]
    assert "io.lanes.req.served.v1" in router["send"]


def test_the_envelope_headers_are_exactly_what_a_signed_event_carries() -> None:
    event = submission("train-42").model_copy(
        update={
            "node": "node-17",
            "rank": 3,
            "subject": "rank 3",
            "causationid": "c-1",
            "correlationid": "c-0",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        }
    )
    signed = EventSigner.generate("lifecycle").sign(encode(event))
    schema = envelope_headers()
    assert set(signed.headers) == set(schema["properties"])
    assert set(schema["required"]) <= set(signed.headers)
    for header, value in signed.headers.items():
        rule = schema["properties"][header]
        assert rule.get("const", value) == value, header
        assert value in rule.get("enum", [value]), header
        assert re.search(rule.get("pattern", ""), value), f"{header}: {value!r} !~ {rule['pattern']}"


def test_a_channel_address_is_the_subject_an_event_is_published_on() -> None:
    job = submission("train-42")
    assert address(JobSubmitted).format(job="train-42") == job.nats_subject()
    served = RequestServed(
        source="lanes/router",
        data=RequestServedData(
            request_id="r-1",
            model="tiny-chat",
            replica="replica-0",
            route="/v1/chat/completions",
            status="ok",
            http_status=200,
            received_at=datetime(2026, 12, 3, tzinfo=UTC),
            latency_ms=1.0,
        ),
    )
    assert address(RequestServed).format(model="tiny-chat", replica="replica-0") == served.nats_subject()
