"""Each service's identity may publish every event type the service's code produces.

The roles in `lanes_contract.identities` are written by hand, while what a service publishes is decided by its
handlers. A service that builds an event its identity may not publish fails only at run time, with a
permissions violation, in a deployment where each service has its own credentials. This test reads the
services' source for the catalogue events they construct (`Kind(...)`, `derive(Kind, ...)`) and checks each
against the service's role, so the two cannot drift apart silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lanes_contract import events
from lanes_contract.events import Event
from lanes_contract.identities import SERVICE_NAMES, identity_named, may_publish

SERVICES_ROOT = Path(__file__).resolve().parents[2] / "services"
CATALOGUE = {
    name: kind
    for name in dir(events)
    if isinstance(kind := getattr(events, name), type) and issubclass(kind, Event) and kind is not Event
}
NOT_BUILDERS = {"isinstance", "issubclass", "_type_of", "type_name"}
"""Calls that name an event class without producing one."""


def produced_by(service: str) -> set[type[Event]]:
    """The catalogue events that a service's code constructs, or passes first to a builder (`derive`)."""
    produced: set[type[Event]] = set()
    for path in (SERVICES_ROOT / service).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            builder = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if builder in NOT_BUILDERS:
                continue
            for named in (node.func, *node.args[:1]):
                if isinstance(named, ast.Name) and named.id in CATALOGUE:
                    produced.add(CATALOGUE[named.id])
    return produced


def test_the_scan_sees_what_services_are_known_to_publish() -> None:
    assert events.JobPlaced in produced_by("scheduler")
    assert events.SettleWindowEnded in produced_by("telemetry")
    assert events.RecoverySuperseded in produced_by("recovery")


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_identity_may_publish_what_the_service_produces(service: str) -> None:
    identity = identity_named(service)
    assert identity is not None
    refused = sorted(
        kind.__name__
        for kind in produced_by(service)
        if not may_publish(identity, f"lanes.{kind.family}.some-key.{kind.name}")
    )
    assert not refused, f"the {service} identity may not publish {refused}"
