"""The router's pure core: the replica registry fold, the routing choice, penalties, request parsing, protection."""

from __future__ import annotations

import json
import random

import pytest

from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    NodeStateChanged,
    NodeStateChangedData,
    RankAssignment,
    ReplicaListening,
    ReplicaListeningData,
    ReplicaState,
    ReplicaStateChanged,
    ReplicaStateChangedData,
)
from lanes_contract.jobs import JobSpec, JobState, ProtectionMode, ServingSpec, WorkloadClass
from lanes_contract.topology import NodeState
from lanes_router.domain.health import PenaltyPolicy, counts_against_replica
from lanes_router.domain.replicas import Replica, ReplicaRegistry
from lanes_router.domain.requests import BadRequestError, parse_inference_request, protection_refusal
from lanes_router.domain.routing import RouteTarget, candidates, pick_version, routable_versions
from lanes_router.entrypoints.config import RouterConfig


def _submitted(job: str, model: str = "chat", version: str = "v1", **serving: object) -> JobSubmitted:
    spec = JobSpec(
        name=job,
        workload_class=WorkloadClass.INFERENCE,
        workers=1,
        serving=ServingSpec(model=model, version=version, **serving),  # type: ignore[arg-type]
    )
    return JobSubmitted(source="t", jobid=job, attempt=1, data=JobSubmittedData(spec=spec))


def _placed(job: str, node: str = "node-1", attempt: int = 1) -> JobPlaced:
    assignments = (RankAssignment(rank=1, node="other", gpus=(5,)), RankAssignment(rank=0, node=node, gpus=(2, 3)))
    return JobPlaced(source="t", jobid=job, attempt=attempt, data=JobPlacedData(assignments=assignments))


def _listening(job: str, port: int = 8000, attempt: int = 1) -> ReplicaListening:
    data = ReplicaListeningData(endpoint=f"http://10.0.0.1:{port}")
    return ReplicaListening(source="t", jobid=job, attempt=attempt, data=data)


def _state(job: str, state: ReplicaState, signal: str = "probe", attempt: int = 1) -> ReplicaStateChanged:
    data = ReplicaStateChangedData(replica=job, model="chat", version="v1", state=state, signal=signal)  # type: ignore[arg-type]
    return ReplicaStateChanged(source="t", jobid=job, attempt=attempt, data=data)


def _job_state(job: str, to: JobState, attempt: int = 1) -> JobStateChanged:
    data = JobStateChangedData(from_state=JobState.RUNNING, to_state=to, cause_type="t")
    return JobStateChanged(source="t", jobid=job, attempt=attempt, data=data)


def _replica_of(registry: ReplicaRegistry, job: str) -> Replica:
    replica = registry.get(job)
    assert replica is not None
    return replica


def _ready_registry(*jobs: str) -> ReplicaRegistry:
    registry = ReplicaRegistry()
    for i, job in enumerate(jobs):
        for event in (_submitted(job), _placed(job), _listening(job, 8000 + i), _state(job, ReplicaState.READY)):
            registry.apply(event)
    return registry


def test_a_replica_comes_from_the_placement_of_an_inference_job_and_is_confirmed_by_a_probe():
    registry = ReplicaRegistry()
    assert registry.apply(_submitted("j1")) is None
    assert registry.apply(_placed("j1")) is not None
    replica = _replica_of(registry, "j1")
    assert (replica.state, replica.node, replica.gpus, replica.endpoint) == (
        ReplicaState.STARTING,
        "node-1",
        (2, 3),
        None,
    )
    assert not replica.routable
    registry.apply(_listening("j1"))
    replica = _replica_of(registry, "j1")
    assert replica.endpoint == "http://10.0.0.1:8000"
    assert replica.probe_may_promote
    registry.apply(_state("j1", ReplicaState.READY))
    replica = _replica_of(registry, "j1")
    assert replica.routable
    assert replica.generation == 1


def test_jobs_that_are_not_inference_jobs_make_no_replica():
    registry = ReplicaRegistry()
    registry.apply(JobSubmitted(source="t", jobid="train", data=JobSubmittedData(spec=JobSpec(name="t", workers=2))))
    assert registry.apply(_placed("train")) is None
    assert registry.all() == ()


def test_folding_the_same_event_twice_changes_nothing():
    registry = _ready_registry("j1")
    assert registry.apply(_state("j1", ReplicaState.READY)) is None
    assert registry.apply(_listening("j1")) is None


@pytest.mark.parametrize(
    ("job_state", "replica_state"),
    [
        (JobState.CANCELLING, ReplicaState.DRAINING),
        (JobState.CANCELLED, ReplicaState.GONE),
        (JobState.FAILED, ReplicaState.GONE),
        (JobState.SUCCEEDED, ReplicaState.GONE),
        (JobState.RELEASED, ReplicaState.GONE),
        (JobState.PARTIALLY_FAILED, ReplicaState.GONE),
    ],
)
def test_lifecycle_states_take_a_replica_out_and_no_probe_brings_it_back(job_state, replica_state):
    registry = _ready_registry("j1")
    registry.apply(_job_state("j1", job_state))
    replica = _replica_of(registry, "j1")
    assert replica.state is replica_state
    assert not replica.probe_may_promote
    assert registry.apply(_state("j1", ReplicaState.READY)) is None


def test_a_new_attempt_starts_again_without_an_endpoint_and_ignores_the_old_attempts_events():
    registry = _ready_registry("j1")
    registry.apply(_job_state("j1", JobState.FAILED))
    attempt = AttemptRequested(source="t", jobid="j1", attempt=2, data=AttemptRequestedData(reason="retry"))
    registry.apply(attempt)
    replica = _replica_of(registry, "j1")
    assert (replica.attempt, replica.state, replica.endpoint) == (2, ReplicaState.STARTING, None)
    assert registry.apply(_listening("j1", 9000, attempt=1)) is None  # a late event of attempt 1
    registry.apply(_placed("j1", "node-2", attempt=2))
    registry.apply(_listening("j1", 9001, attempt=2))
    replica = _replica_of(registry, "j1")
    assert (replica.node, replica.endpoint) == ("node-2", "http://10.0.0.1:9001")


def test_an_operator_drain_holds_until_the_operator_says_ready():
    registry = _ready_registry("j1")
    registry.apply(_state("j1", ReplicaState.DRAINING, signal="operator"))
    replica = _replica_of(registry, "j1")
    assert (replica.state, replica.hold) == (ReplicaState.DRAINING, "operator")
    assert registry.apply(_state("j1", ReplicaState.READY, signal="probe")) is None
    registry.apply(_state("j1", ReplicaState.READY, signal="operator"))
    replica = _replica_of(registry, "j1")
    assert replica.routable


def test_recovery_marking_a_replica_unhealthy_is_not_undone_by_a_probe():
    registry = _ready_registry("j1")
    registry.apply(_state("j1", ReplicaState.UNHEALTHY, signal="recovery"))
    replica = _replica_of(registry, "j1")
    assert not replica.probe_may_promote


def test_passive_unhealthy_is_undone_by_a_probe():
    registry = _ready_registry("j1")
    registry.apply(_state("j1", ReplicaState.UNHEALTHY, signal="passive"))
    replica = _replica_of(registry, "j1")
    assert replica.probe_may_promote
    registry.apply(_state("j1", ReplicaState.READY, signal="probe"))
    replica = _replica_of(registry, "j1")
    assert replica.routable


def test_an_unhealthy_node_takes_its_replicas_out_until_it_is_ready_again():
    registry = _ready_registry("j1")
    node_down = NodeStateChanged(source="t", node="node-1", data=NodeStateChangedData(state=NodeState.UNHEALTHY))
    registry.apply(node_down)
    replica = _replica_of(registry, "j1")
    assert (replica.state, replica.hold) == (ReplicaState.UNHEALTHY, "node")
    assert not replica.probe_may_promote
    registry.apply(NodeStateChanged(source="t", node="node-1", data=NodeStateChangedData(state=NodeState.READY)))
    replica = _replica_of(registry, "j1")
    assert replica.probe_may_promote


def test_the_deployment_spec_of_a_pinned_version_or_else_of_the_model():
    registry = ReplicaRegistry()
    registry.apply(_submitted("a", version="v1", protection=ProtectionMode.REJECT))
    registry.apply(_submitted("b", version="v2", protection=ProtectionMode.QUEUE))
    assert registry.deployment("chat", "v1").protection is ProtectionMode.REJECT  # type: ignore[union-attr]
    assert registry.deployment("chat", "v9") is not None
    assert registry.deployment("other", None) is None


def _replica(replica_id: str, version: str, weight: int = 100, state: ReplicaState = ReplicaState.READY) -> Replica:
    spec = ServingSpec(model="chat", version=version, weight=weight)
    return Replica(replica_id, 1, spec, state, endpoint=f"http://{replica_id}:1")


def test_unpinned_traffic_follows_the_explicit_weights_and_never_reaches_weight_zero():
    replicas = [_replica("a", "v1", 90), _replica("b", "v2", 10), _replica("c", "v3", 0)]
    assert routable_versions(replicas) == {"v1": 90, "v2": 10, "v3": 0}
    drawn = [pick_version(replicas, i / 1000) for i in range(1000)]
    assert drawn.count("v1") == 900
    assert drawn.count("v2") == 100
    assert "v3" not in drawn
    assert pick_version([_replica("c", "v3", 0)], 0.5) is None
    # A version without a ready replica gets no unpinned traffic.
    assert pick_version([_replica("a", "v1", 90, ReplicaState.UNHEALTHY), _replica("b", "v2", 10)], 0.1) == "v2"


def test_candidates_are_only_ready_replicas_of_the_version_two_drawn_then_fallbacks():
    replicas = [_replica(f"r{i}", "v1") for i in range(12)] + [_replica("x", "v2")]
    replicas.append(_replica("sick", "v1", state=ReplicaState.UNHEALTHY))
    rng = random.Random(7)  # noqa: S311 - a seeded draw, not cryptography
    offered = candidates(replicas, RouteTarget("chat", "v1"), "v1", frozenset({"r0"}), rng.randrange)
    assert len(offered) == 8
    assert len({r.replica_id for r in offered}) == 8
    assert all(r.version == "v1" and r.routable and r.replica_id != "r0" for r in offered)
    assert candidates(replicas, RouteTarget("chat", "v2"), "v2", frozenset(), rng.randrange) == [replicas[12]]


def test_prefix_affinity_puts_the_same_replica_first_for_the_same_prefix():
    replicas = [_replica(f"r{i}", "v1") for i in range(5)]
    target = RouteTarget("chat", "v1", affinity_key="You are a helpful assistant.")
    draws = [random.Random(seed).randrange for seed in range(20)]  # noqa: S311 - seeded, not cryptography
    firsts = {candidates(replicas, target, "v1", frozenset(), draw)[0].replica_id for draw in draws}
    assert len(firsts) == 1


def test_the_penalty_box_backs_off_exponentially_and_a_refusal_ejects_at_once():
    policy = PenaltyPolicy(failures_to_eject=2, base_s=1.0, max_s=8.0)
    assert not policy.ejects("error", 1)
    assert policy.ejects("error", 2)
    assert policy.ejects("refused", 1)
    assert [policy.penalty_s(n) for n in (2, 3, 4, 5, 9)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert not counts_against_replica("refused", 429)
    assert not counts_against_replica("client_closed", 200)
    assert counts_against_replica("error", 500)


def test_a_version_is_pinned_by_header_or_by_model_name_and_the_body_is_rewritten_only_then():
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    parsed = parse_inference_request(body, "v2", affinity=True)
    assert (parsed.model, parsed.version, parsed.stream, parsed.body) == ("chat", "v2", True, body)
    assert parsed.affinity_key == "hi"
    at = parse_inference_request(b'{"model": "chat@v3", "prompt": "p"}', None, affinity=False)
    assert (at.model, at.version, json.loads(at.body)["model"], at.affinity_key) == ("chat", "v3", "chat", None)
    assert parse_inference_request(b'{"model": "chat"}', None, affinity=False).version is None


@pytest.mark.parametrize(
    ("body", "header"),
    [
        (b"{", None),
        (b"[1]", None),
        (b'{"model": 3}', None),
        (b'{"model": ""}', None),
        (b'{"model": "meta/llama"}', None),
        (b'{"model": "chat", "stream": "yes"}', None),
        (b'{"model": "chat@v1"}', "v2"),
        (b'{"model": "chat"}', "v 1"),
    ],
)
def test_a_request_that_can_never_be_routed_is_a_bad_request(body, header):
    with pytest.raises(BadRequestError):
        parse_inference_request(body, header, affinity=False)


@pytest.mark.parametrize(
    ("mode", "waited", "status"),
    [(ProtectionMode.PAUSE, False, 503), (ProtectionMode.REJECT, False, 429), (ProtectionMode.QUEUE, True, 503)],
)
def test_each_protection_mode_has_its_answer(mode, waited, status):
    spec = ServingSpec(model="chat", version="v1", protection=mode, retry_after_s=9)
    refusal = protection_refusal(spec, reason="full", waited=waited)
    assert (refusal.http_status, refusal.retry_after_s) == (status, 9)
    assert "chat@v1" in refusal.message


def test_router_settings_come_from_the_environment_and_a_given_port_is_strict():
    config = RouterConfig.from_env({"LANES_ROUTER_PORT": "9000", "LANES_ROUTER_PREFIX_AFFINITY": "1"})
    assert (config.port, config.strict_port, config.prefix_affinity) == (9000, True, True)
    default = RouterConfig.from_env({})
    assert (default.port, default.strict_port) == (8080, False)
    with pytest.raises(ValueError, match="LANES_ROUTER_MAX_ATTEMPTS must be of type int"):
        RouterConfig.from_env({"LANES_ROUTER_MAX_ATTEMPTS": "many"})
