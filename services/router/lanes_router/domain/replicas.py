"""The replica registry: a fold of the job and node timelines into "which replica serves what, where, how well".

One inference job is one replica, and the replica id is the job id. Its model, version and protection come
from the job's submitted `serving` spec; the placement gives its node and GPUs; the launcher's
`replica_listening` gives its endpoint; health checks (published as `replica_state`) move it in and out of
rotation; the lifecycle's terminal states take it out for good. Every router folds the same events in the
same order, so they all hold the same registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from lanes_contract.events import (
    AttemptRequested,
    Event,
    JobPlaced,
    JobStateChanged,
    JobSubmitted,
    NodeStateChanged,
    ReplicaListening,
    ReplicaState,
    ReplicaStateChanged,
)
from lanes_contract.jobs import JobState, ServingSpec
from lanes_contract.topology import NodeState

GONE_ON = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.RELEASED, JobState.PARTIALLY_FAILED}
)
"""Job states after which the replica's process is gone (a partial failure tears the whole gang down)."""
DRAINING_ON = frozenset({JobState.CANCELLING})
"""Job states in which the process still answers but is being stopped: no new requests, in-flight ones finish."""
STICKY_SIGNALS = frozenset({"operator", "recovery", "node", "lifecycle"})
"""Who can put a replica out of rotation so that a passing health probe does not bring it back."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One inference replica as the router sees it."""

    replica_id: str
    attempt: int
    serving: ServingSpec
    state: ReplicaState
    node: str | None = None
    gpus: tuple[int, ...] = ()
    endpoint: str | None = None
    hold: str | None = None
    """Who took it out of rotation for a reason a probe cannot clear (operator, recovery, node, lifecycle)."""
    generation: int = 0
    """How many state changes were folded; routers that saw the same history agree on it (transition keys)."""
    penalty_s: float | None = None
    """The back-off of the last `unhealthy` transition: probes wait this long before trying it again."""

    @property
    def model(self) -> str:
        """The model name clients ask for."""
        return self.serving.model

    @property
    def version(self) -> str:
        """The model version it serves."""
        return self.serving.version

    @property
    def routable(self) -> bool:
        """Whether it may take a new request."""
        return self.state is ReplicaState.READY and self.endpoint is not None

    @property
    def probe_may_promote(self) -> bool:
        """Whether a passing health probe puts it (back) in rotation."""
        return (
            self.state in {ReplicaState.STARTING, ReplicaState.UNHEALTHY}
            and self.hold is None
            and self.endpoint is not None
        )


@dataclass(frozen=True, slots=True)
class Transition:
    """A replica whose state changed by folding one event (what a router publishes or counts)."""

    before: Replica | None
    after: Replica


class ReplicaRegistry:
    """The fold: `apply` each event of LANES_JOBS and LANES_NODES in stream order; read the replicas back."""

    def __init__(self) -> None:
        self._serving: dict[str, ServingSpec] = {}
        self._replicas: dict[str, Replica] = {}
        self._unhealthy_nodes: set[str] = set()
        self._by_model: dict[str, tuple[Replica, ...]] | None = None

    def get(self, replica_id: str) -> Replica | None:
        """The replica with this id (its job id), if known."""
        return self._replicas.get(replica_id)

    def all(self) -> tuple[Replica, ...]:
        """Every replica ever placed that is not gone."""
        return tuple(r for r in self._replicas.values() if r.state is not ReplicaState.GONE)

    def of_model(self, model: str) -> tuple[Replica, ...]:
        """The replicas (not gone) of one model, any version; cached between changes (the hot path)."""
        if self._by_model is None:
            grouped: dict[str, list[Replica]] = {}
            for replica in self.all():
                grouped.setdefault(replica.model, []).append(replica)
            self._by_model = {name: tuple(replicas) for name, replicas in grouped.items()}
        return self._by_model.get(model, ())

    def deployment(self, model: str, version: str | None) -> ServingSpec | None:
        """The serving spec that decides protection for a model (and version when pinned), if the model is known.

        The newest submitted job of that model/version speaks for the deployment; a pinned version nobody
        deployed falls back to the model's newest spec, so the model's protection mode still answers.
        """
        specs = [spec for spec in self._serving.values() if spec.model == model]
        pinned = [spec for spec in specs if spec.version == version]
        chosen = pinned or specs
        return chosen[-1] if chosen else None

    def models(self) -> tuple[str, ...]:
        """Every model some job was submitted to serve."""
        return tuple(dict.fromkeys(spec.model for spec in self._serving.values()))

    def apply(self, event: Event) -> Transition | None:
        """Fold one event; return the replica it changed (None when it changed nothing the router routes by)."""
        if isinstance(event, NodeStateChanged):
            self._apply_node(event)
            return None
        job = event.jobid
        if job is None:
            return None
        if isinstance(event, JobSubmitted):
            if event.data.spec.serving is not None:
                self._serving.setdefault(job, event.data.spec.serving)
            return None
        serving = self._serving.get(job)
        if serving is None:
            return None  # not an inference job
        before = self._replicas.get(job)
        after = self._next(before, serving, event)
        if after is None or after == before:
            return None
        if before is not None and after.state is not before.state:
            after = replace(after, generation=before.generation + 1)
        self._replicas[job] = after
        self._by_model = None
        return Transition(before, after)

    def _next(self, current: Replica | None, serving: ServingSpec, event: Event) -> Replica | None:
        attempt = event.attempt or 1
        if isinstance(event, (JobPlaced, AttemptRequested)):
            if current is not None and attempt < current.attempt:
                return None  # a late event of an earlier attempt
            if isinstance(event, AttemptRequested):
                if current is not None and attempt == current.attempt:
                    return None  # the attempt this replica already is (its first one, announced late)
                return Replica(event.job_key, attempt, serving, ReplicaState.STARTING)
            first = min(event.data.assignments, key=lambda a: a.rank)
            if current is not None and current.attempt == attempt and current.state is not ReplicaState.STARTING:
                return replace(current, node=first.node, gpus=first.gpus)
            base = current if current is not None and current.attempt == attempt else None
            return Replica(
                event.job_key,
                attempt,
                serving,
                ReplicaState.STARTING,
                node=first.node,
                gpus=first.gpus,
                endpoint=None if base is None else base.endpoint,
                generation=0 if base is None else base.generation,
            )
        if current is None or (event.attempt is not None and event.attempt != current.attempt):
            return None
        if current.state is ReplicaState.GONE:
            return None  # an ended attempt never comes back; a new attempt starts afresh
        if isinstance(event, ReplicaListening):
            return replace(current, endpoint=event.data.endpoint)
        if isinstance(event, JobStateChanged):
            if event.data.to_state in GONE_ON:
                return replace(current, state=ReplicaState.GONE, hold="lifecycle")
            if event.data.to_state in DRAINING_ON:
                return replace(current, state=ReplicaState.DRAINING, hold="lifecycle")
            return None
        if isinstance(event, ReplicaStateChanged):
            return self._fold_state(current, event)
        return None

    def _fold_state(self, current: Replica, event: ReplicaStateChanged) -> Replica | None:
        data = event.data
        if current.hold == "lifecycle" and data.signal != "lifecycle":
            return None  # the job is being stopped: nothing brings it back into rotation
        hold = current.hold
        if data.signal in STICKY_SIGNALS and data.state in {ReplicaState.DRAINING, ReplicaState.UNHEALTHY}:
            hold = data.signal
        elif data.state is ReplicaState.READY:
            if data.signal != "operator" and current.hold is not None:
                return None  # only the one who held it (an operator) may put it back
            hold = None
        endpoint = current.endpoint or data.endpoint
        return replace(current, state=data.state, hold=hold, endpoint=endpoint, penalty_s=data.penalty_s)

    def _apply_node(self, event: NodeStateChanged) -> None:
        node = event.node_key
        if event.data.state is NodeState.UNHEALTHY:
            self._unhealthy_nodes.add(node)
            for replica in self._on_node(node):
                if replica.state in {ReplicaState.STARTING, ReplicaState.READY}:
                    self._store(replace(replica, state=ReplicaState.UNHEALTHY, hold="node"), replica)
        elif event.data.state is NodeState.READY and node in self._unhealthy_nodes:
            self._unhealthy_nodes.discard(node)
            for replica in self._on_node(node):
                if replica.hold == "node":
                    self._store(replace(replica, hold=None), replica)

    def _on_node(self, node: str) -> Iterable[Replica]:
        return [r for r in self._replicas.values() if r.node == node and r.state is not ReplicaState.GONE]

    def _store(self, after: Replica, before: Replica) -> None:
        if after.state is not before.state:
            after = replace(after, generation=before.generation + 1)
        self._replicas[after.replica_id] = after
        self._by_model = None
