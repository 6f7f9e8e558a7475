"""Each service's identity may publish every event type the service's code produces.

The roles in `lanes_contract.identities` are written by hand, while what a service publishes is decided by its
handlers. A service that builds an event its identity may not publish fails only at run time, with a
permissions violation, in a deployment where each service has its own credentials. This test reads the
services' source for the catalogue events they construct (`Kind(...)`, `derive(Kind, ...)`) and checks each
against the service's role, so the two cannot drift apart silently.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from lanes_agent.launcher import LAUNCHER_INPUTS
from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_cli.agent_cli import durable_name
from lanes_cli.bootstrap import SERVICES
from lanes_contract import events
from lanes_contract.events import Event
from lanes_contract.identities import (
    JOB_API,
    JOB_API_QUEUE,
    LOCAL_LAUNCHER_DURABLE,
    PLATFORM,
    READER_APIS,
    SERVICE_IDENTITIES,
    SERVICE_NAMES,
    Identity,
    agent_identity,
    identities,
    identity_named,
    may_publish,
    nats_permissions,
    subject_matches,
)
from lanes_lifecycle.entrypoints.job_api import API_PREFIX, QUEUE

SERVICES_ROOT = Path(__file__).resolve().parents[2] / "services"
CATALOGUE = {
    name: kind
    for name in dir(events)
    if isinstance(kind := getattr(events, name), type) and issubclass(kind, Event) and kind is not Event
}
NOT_BUILDERS = {"isinstance", "issubclass", "_type_of", "type_name"}
"""Calls that name an event class without producing one."""
REPLAY_ONLY = frozenset({"whatif.py"})
"""Modules that build events only to replay them in memory (`lanes whatif`): they publish nothing."""


def produced_by(service: str) -> set[type[Event]]:
    """The catalogue events that a service's code constructs, or passes first to a builder (`derive`)."""
    produced: set[type[Event]] = set()
    for path in (SERVICES_ROOT / service).rglob("*.py"):
        if path.name in REPLAY_ONLY:
            continue
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


# --- least privilege on the JetStream API ----------------------------------------------------------------


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_durable_a_service_creates_is_in_its_identitys_list(service: str) -> None:
    """A durable missing from the table fails only at run time, under auth; this keeps the two together."""
    identity = identity_named(service)
    assert identity is not None
    durables = {spec.durable for spec, _ in SERVICES[service].consumers}
    if service == "audit":
        durables.add(inspect.signature(AuditRecorder).parameters["durable"].default)
    assert durables <= set(identity.durables), f"{service} creates {sorted(durables - set(identity.durables))}"
    assert durables <= set(PLATFORM.durables)


def test_the_platform_owns_every_services_durables_and_the_in_process_launchers() -> None:
    owned = {durable for identity in SERVICE_IDENTITIES for durable in identity.durables}
    assert owned | {LAUNCHER_INPUTS.durable} == set(PLATFORM.durables)
    assert LAUNCHER_INPUTS.durable == LOCAL_LAUNCHER_DURABLE


def test_a_one_node_agent_owns_the_durable_lanes_agent_creates_for_it() -> None:
    assert agent_identity("node-7").durables == (durable_name(["node-7"]),)


def test_only_the_platform_owns_every_consumer() -> None:
    assert [i.name for i in identities(("node-1",)) if i.owns_every_consumer] == [PLATFORM.name]


def test_no_two_identities_own_the_same_durable() -> None:
    owners = [
        durable
        for identity in identities(("node-1", "node-2"))
        if identity is not PLATFORM
        for durable in identity.durables
    ]
    assert len(owners) == len(set(owners))


def test_only_the_lifecycle_serves_the_job_api_and_only_the_cli_asks_it() -> None:
    assert (f"{API_PREFIX}.*", QUEUE) == (JOB_API, JOB_API_QUEUE)
    servers = {i.name for i in identities(("node-1",)) if (JOB_API, JOB_API_QUEUE) in i.serves}
    askers = {i.name for i in identities(("node-1",)) if JOB_API in i.requests}
    assert servers == {"lifecycle", "platform"}
    assert askers == {"cli", "platform"}


def test_the_readers_are_exactly_those_that_replay_the_log() -> None:
    """Readers create consumers of their own: the list of identities that may is kept as short as the code
    allows, and widening it is a visible change."""
    readers = {i.name for i in identities(("node-1",)) if i.reads}
    assert readers == {"router", "cli", "platform", "console"}


@pytest.mark.parametrize("identity", identities(("node-1",)), ids=lambda i: i.name)
def test_no_identity_is_given_the_whole_jetstream_api_or_another_identitys_consumer(identity: Identity) -> None:
    everyone = identities(("node-1",))
    permissions = nats_permissions(identity, tuple(d for other in everyone for d in other.durables))
    publish = permissions["publish"]
    subscribe = permissions["subscribe"]
    assert isinstance(publish, dict)
    assert isinstance(subscribe, dict)
    allowed = publish["allow"]
    assert "$JS.API.>" not in allowed
    assert ">" not in subscribe["allow"]
    others = {d for other in identities(("node-1",)) if other is not PLATFORM for d in other.durables} - set(
        identity.durables
    )
    if identity.owns_every_consumer:
        others = set()
    denied = publish["deny"]
    for durable in others:
        for api in ("DELETE", "CREATE", "DURABLE.CREATE", "MSG.NEXT"):
            subject = f"$JS.API.CONSUMER.{api}.LANES_JOBS.{durable}"
            # In NATS a deny beats an allow: a reader is allowed consumers by any name, and denied these.
            reachable = any(subject_matches(p, subject) for p in allowed)
            assert not reachable or any(subject_matches(p, subject) for p in denied), (identity.name, subject)
            with_filter = f"$JS.API.CONSUMER.CREATE.LANES_JOBS.{durable}.lanes.job.x"
            reachable = any(subject_matches(p, with_filter) for p in allowed)
            assert not reachable or any(subject_matches(p, with_filter) for p in denied), (identity.name, with_filter)
        assert not any(subject_matches(pattern, f"$JS.ACK.LANES_JOBS.{durable}.1.2.3.4.0") for pattern in allowed)
    # The unnamed create (the name in the body) is no one's: readers name their consumers in the subject.
    assert not any(subject_matches(p, "$JS.API.CONSUMER.CREATE.LANES_JOBS") for p in allowed)
    assert all(api in allowed for api in READER_APIS) is identity.reads
    assert ("allow_responses" in permissions) is bool(identity.serves)
