"""Who may write what on the bus: one identity per producer, each with the subjects of its role.

The table is derived from the event catalogue (each event type's family and name), so a permission can
never drift from the subject an event is published on. The embedded server and the compose stack both
render it into nats-server `authorization` blocks (per-user permissions); the audit verifier reads it to
tell whether the signer of an event was allowed to write it.

A node agent is scoped by its node: it speaks on `lanes.tel.<node>.>` and is the only producer of the
rank and progress events of the job family. Which *attempt* those belong to is checked by the lifecycle,
which knows the placement (an agent's event names its node, and the node must be the one the rank was
placed on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lanes_contract.events import (
    AgentHeartbeat,
    ArtifactProduced,
    AttemptRequested,
    CancelRequested,
    CheckpointSaved,
    CheckpointStarted,
    ClusterPolicySet,
    CommunicatorReady,
    DrillInjected,
    Event,
    Family,
    Heartbeat,
    HoldRequested,
    JobEvidence,
    JobFinding,
    JobPlaced,
    JobRejected,
    JobSlowdown,
    JobStateChanged,
    JobSubmitted,
    JobWaiting,
    ManualActionRequested,
    NodeRegistered,
    NodeStateChanged,
    RankExited,
    RankStarted,
    RecoveryDecided,
    RecoveryEscalated,
    RecoverySuperseded,
    RendezvousDone,
    ReplicaListening,
    ReplicaStateChanged,
    ResourcesReleased,
    ResumeRequested,
    RetryRequested,
    SettleWindowEnded,
    TransitionRejected,
)
from lanes_contract.ids import validate_token

ADMIN = "admin"
"""The one identity that creates, updates, purges and deletes streams (and may write anything)."""
AGENT_PREFIX = "agent-"
"""A node agent's identity is `agent-<node>`."""

DEAD_LETTERS = "lanes.dead.>"
AUDIT_CHECKPOINTS = "lanes.audit.>"
REQUESTS = "lanes.req.>"


def inbox_prefix(identity: str) -> str:
    """Where an identity's replies come (`_INBOX_<identity>`): nats-py's `inbox_prefix`, set by `connect_nats`.

    With one shared `_INBOX.>`, any identity could subscribe to it and read every other's JetStream API
    answers, fetched batches (with their ack subjects) and job API replies.
    """
    return f"_INBOX_{identity}"


JOB_API = "lanes.api.job.*"
"""The job API's request subjects (`lanes.api.job.<operation>`): the CLI asks, the lifecycle answers."""
JOB_API_QUEUE = "lanes-job-api"
"""The queue group the job API's servers share, so each request is answered once."""
API_SUBJECTS = "lanes.api.>"
EVENT_SUBJECTS = "lanes.>"
STREAM_ADMIN_APIS = (
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.PEER.REMOVE.>",
    "$JS.API.STREAM.LEADER.STEPDOWN.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$JS.API.ACCOUNT.PURGE.>",
)
"""The JetStream API subjects that change or cut a stream; denied to everyone but the admin."""
JS_READ_APIS = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.>",
)
"""What every identity may ask JetStream: the account, the streams, single stored messages (read-only)."""
READER_APIS = (
    "$JS.API.CONSUMER.CREATE.*.*",
    "$JS.API.CONSUMER.CREATE.*.*.>",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.DELETE.*.*",
    "$JS.API.CONSUMER.MSG.NEXT.*.*",
)
"""A reader's rights (`reads`): create, ask about, pull from and delete consumers named in the subject.

A reader's consumers are its own (`lanes_runtime.reader`: `read-<random>`, unacknowledged, gone once idle).
The name must be in the subject: the server takes the name of a consumer created without one
(`$JS.API.CONSUMER.CREATE.<stream>`) from the request's body, and a body naming an existing durable updates
it (tested: `{"name": "audit", "filter_subjects": [...]}` re-filtered the audit copy). A permission cannot
look into a body, so that form is no one's but the admin's; with the name in the subject, the server uses that
name whatever the body says (tested), and `nats_permissions` denies a reader every durable of the deployment
by name (`durable_controls`).
"""


def consumer_apis(durable: str) -> tuple[str, ...]:
    """The JetStream API subjects that create, read, delete and pull one durable consumer (on any stream).

    Both create forms nats-py sends are covered: the legacy `DURABLE.CREATE.<stream>.<name>` and the named
    `CREATE.<stream>.<name>[.<filter>]`. A consumer name is one subject token, so nothing here reaches
    another name.
    """
    return (
        f"$JS.API.CONSUMER.DURABLE.CREATE.*.{durable}",
        f"$JS.API.CONSUMER.CREATE.*.{durable}",
        f"$JS.API.CONSUMER.CREATE.*.{durable}.>",
        f"$JS.API.CONSUMER.INFO.*.{durable}",
        f"$JS.API.CONSUMER.DELETE.*.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.*.{durable}",
        f"$JS.ACK.*.{durable}.>",
    )


def durable_controls(durable: str) -> tuple[str, ...]:
    """The subjects that change, pull from or delete one durable: what a reader is denied on every durable."""
    return (
        f"$JS.API.CONSUMER.DURABLE.CREATE.*.{durable}",
        f"$JS.API.CONSUMER.CREATE.*.{durable}",
        f"$JS.API.CONSUMER.CREATE.*.{durable}.>",
        f"$JS.API.CONSUMER.DELETE.*.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.*.{durable}",
    )


def consumer_advisories(durable: str) -> tuple[str, ...]:
    """The advisories about one durable that its own loop may listen to, of any kind.

    `$JS.EVENT.ADVISORY.CONSUMER.<kind>.<stream>.<name>`: a message that ran out of deliveries, the consumer
    deleted or created, ...
    """
    return (f"$JS.EVENT.ADVISORY.CONSUMER.*.*.{durable}",)


def subjects_of(*events: type[Event], key: str = "*") -> tuple[str, ...]:
    """The subjects the given event types are published on, for one key (`*`: any job or node)."""
    return tuple(f"lanes.{event.family}.{key}.{event.name}" for event in events)


RANK_EVENTS = (
    RankStarted,
    RankExited,
    RendezvousDone,
    CommunicatorReady,
    Heartbeat,
    CheckpointStarted,
    CheckpointSaved,
    ArtifactProduced,
    ReplicaListening,
)
"""What a node agent reports about the ranks it runs (job family)."""
USER_COMMANDS = (
    JobSubmitted,
    CancelRequested,
    RetryRequested,
    HoldRequested,
    ResumeRequested,
    ManualActionRequested,
)


@dataclass(frozen=True)
class Identity:
    """A name the bus knows, the subjects it may publish events on, and what it may do on the JetStream API.

    `durables`: the durable consumers it owns (create, read, delete, pull, ack; no other identity may touch
    them). `reads`: whether it reads the log through ephemeral ordered consumers (`iter_stream`, the router's
    registry feed). `requests`: core request subjects it may send (the job API). `serves`: the
    (subject, queue group) pairs it answers, with the right to reply to each request once.
    `owns_every_consumer`: only the platform, which is every service and the in-process agents at once.
    """

    name: str
    publishes: tuple[str, ...]
    description: str
    durables: tuple[str, ...] = ()
    reads: bool = False
    requests: tuple[str, ...] = ()
    serves: tuple[tuple[str, str], ...] = ()
    owns_every_consumer: bool = False

    @property
    def source(self) -> str:
        """The `ce-source` this identity's events carry, e.g. `lanes/scheduler` or `agent/node-17`."""
        if self.name.startswith(AGENT_PREFIX):
            return f"agent/{self.name.removeprefix(AGENT_PREFIX)}"
        return f"lanes/{self.name}"


SERVICE_IDENTITIES = (
    Identity(
        "scheduler",
        (*subjects_of(JobPlaced, JobWaiting, JobRejected, ResourcesReleased), DEAD_LETTERS),
        "admission and placement: the only identity that places and releases",
        durables=("scheduler-jobs", "scheduler-nodes"),
    ),
    Identity(
        "lifecycle",
        (*subjects_of(JobStateChanged, TransitionRejected, AttemptRequested, JobSubmitted), DEAD_LETTERS),
        "job and attempt state machine (and the job API)",
        durables=("lifecycle-jobs",),
        # No ordered reads: the service never replays; `lanes projections rebuild` is an operator's command.
        serves=((JOB_API, JOB_API_QUEUE),),
    ),
    Identity(
        "telemetry",
        (*subjects_of(JobEvidence, JobFinding, JobSlowdown, SettleWindowEnded), DEAD_LETTERS),
        "evidence correlation, first-error findings and slow ranks",
        durables=("telemetry", "telemetry-placements", "telemetry-progress"),
    ),
    Identity(
        "recovery",
        (
            *subjects_of(
                RecoveryDecided,
                RecoveryEscalated,
                RecoverySuperseded,
                TransitionRejected,  # a manual action it refuses
                NodeStateChanged,  # cordon and uncordon
                ReplicaStateChanged,  # a failed replica out of rotation
                CancelRequested,
                RetryRequested,
                HoldRequested,
                ResumeRequested,
            ),
            DEAD_LETTERS,
        ),
        "recovery decisions and the commands that carry them out",
        durables=("recovery",),
    ),
    Identity(
        "router",
        (*subjects_of(ReplicaStateChanged), REQUESTS, DEAD_LETTERS),
        "replica health and per-request provenance",
        reads=True,  # the replica registry is rebuilt from the log by ordered consumers
    ),
    Identity(
        "audit",
        (AUDIT_CHECKPOINTS, DEAD_LETTERS),
        "the hash-chained copy and its signed checkpoints",
        durables=("audit",),
    ),
)
PEOPLE_IDENTITIES = (
    Identity(
        "cli",
        (*subjects_of(*USER_COMMANDS, DrillInjected), *subjects_of(NodeRegistered, NodeStateChanged, ClusterPolicySet)),
        "an operator at the `lanes` CLI: submit, cancel, retry, hold, resume, cordon, topology import, drills",
        reads=True,  # timeline, replay, audit verify, incident bundles
        requests=(JOB_API,),
    ),
    Identity(
        "producer",
        (*subjects_of(JobSubmitted, *RANK_EVENTS), f"lanes.{Family.TELEMETRY}.>"),
        "an outside launcher or script posting a job's rank and progress events and evidence: never places",
    ),
    Identity(
        "console",
        (),
        "the live console (`lanes console`): reads the log through its own ephemeral ordered consumers; publishes"
        " nothing, owns no durable, sends no request",
        reads=True,
    ),
    Identity(
        "observer",
        (
            *subjects_of(JobSubmitted, JobPlaced, ResourcesReleased, JobWaiting, JobRejected, *RANK_EVENTS),
            # What the other scheduler did to its job (requeued: a new attempt; cancelled) and to its nodes.
            *subjects_of(RetryRequested, CancelRequested, NodeStateChanged),
            f"lanes.{Family.TELEMETRY}.>",
        ),
        "a platform adapter observing jobs another scheduler placed (`lanes run`, `lanes slurm watch`, `lanes k8s"
        " watch`): it records that scheduler's placements, waits, requeues, cancels and node states, so it is"
        " trusted like one",
    ),
)
SERVICE_NAMES = tuple(identity.name for identity in SERVICE_IDENTITIES)


def agent_durable(node: str) -> str:
    """The durable consumer of a one-node agent (`lanes agent --node <node>`): its placements and commands."""
    return f"{AGENT_PREFIX}{node}"


def _agent_role(name: str, node: str) -> Identity:
    return Identity(
        name,
        (f"lanes.{Family.TELEMETRY}.{node}.>", *subjects_of(AgentHeartbeat, key=node), *subjects_of(*RANK_EVENTS)),
        f"the node agent of {node}"
        if node != "*"
        else "a node agent: one identity per node (agent-<node>), each"
        " limited to its own node's evidence and heartbeat",
        # An agent only pulls its own consumer: it never reads the log through ordered consumers.
        durables=(agent_durable(node),) if node != "*" else (),
    )


def agent_identity(node: str) -> Identity:
    """The identity of the agent of one node: its node's evidence and heartbeat, and the rank events it runs."""
    validate_token(node)
    return _agent_role(f"{AGENT_PREFIX}{node}", node)


AGENT_ROLE = _agent_role("agent", "*")
"""What every node agent may publish, with `*` for its node: the agent's contract (its AsyncAPI document).
Not a bus identity: no server has a user of that name."""


LOCAL_LAUNCHER_DURABLE = "launcher-local"
"""The durable of the in-process launcher of `lanes up` and `lanes demo` (agents/node `LAUNCHER_INPUTS`)."""
_PLATFORM_PARTS = (*SERVICE_IDENTITIES, *PEOPLE_IDENTITIES)
PLATFORM = Identity(
    "platform",
    (*dict.fromkeys(s for i in _PLATFORM_PARTS for s in i.publishes), *subjects_of(AgentHeartbeat)),
    "every service, the CLI and in-process agents in one process (`lanes up`, `lanes demo`): one process is"
    " one trust boundary, so it gets the union of their roles, but never stream management",
    durables=(*dict.fromkeys(d for i in _PLATFORM_PARTS for d in i.durables), LOCAL_LAUNCHER_DURABLE),
    # The in-process launchers of `lanes demo`'s scenarios name their durables per run (the topology scenario's
    # `launcher-topology-<id>`), which no name list can hold. The platform already writes every service's
    # and every node's events, so owning their consumers too grants nothing it could not already break.
    owns_every_consumer=True,
    reads=True,
    requests=tuple(dict.fromkeys(r for i in _PLATFORM_PARTS for r in i.requests)),
    serves=tuple(dict.fromkeys(q for i in _PLATFORM_PARTS for q in i.serves)),
)


def identities(nodes: tuple[str, ...] = ()) -> tuple[Identity, ...]:
    """Every identity of a deployment with these node agents (the admin is implicit: it may do anything)."""
    return (*SERVICE_IDENTITIES, *PEOPLE_IDENTITIES, PLATFORM, *(agent_identity(node) for node in nodes))


ADMIN_IDENTITY = Identity(ADMIN, (">",), "stream management, and anything else")


def identity_named(name: str) -> Identity | None:
    """The identity of a name (`scheduler`, `agent-node-3`, `admin`, ...), or None for an unknown name."""
    if name == ADMIN:
        return ADMIN_IDENTITY
    if name.startswith(AGENT_PREFIX):
        node = name.removeprefix(AGENT_PREFIX)
        try:
            return agent_identity(node)
        except ValueError:
            return None
    return next((identity for identity in identities() if identity.name == name), None)


def nats_permissions(identity: Identity, durables: tuple[str, ...] = ()) -> dict[str, object]:
    """The nats-server `permissions` block of an identity: least privilege on the JetStream API.

    Publish: its event subjects and requests; the read-only JetStream API; its own durables' create, info,
    delete, pull and ack subjects; a reader's consumers if it `reads`. Every API that changes or cuts a
    stream is denied besides (in NATS a deny beats an allow), and so, to a reader, is every one of the
    deployment's `durables` that is not its own. Subscribe: its own replies (`_INBOX_<name>.>`), live
    events, its own durables' advisories; the API subjects only in the queue groups it serves, so no one
    else can take (or overhear) a request. A server replies once to each request it received
    (`allow_responses`).
    """
    owned = ("*",) if identity.owns_every_consumer else identity.durables
    publish = [
        *identity.publishes,
        *identity.requests,
        *JS_READ_APIS,
        *(api for durable in owned for api in consumer_apis(durable)),
        *(READER_APIS if identity.reads else ()),
    ]
    deny = list(STREAM_ADMIN_APIS)
    if identity.reads and not identity.owns_every_consumer:
        deny += [api for durable in durables if durable not in owned for api in durable_controls(durable)]
    subscribe_allow = [
        f"{inbox_prefix(identity.name)}.>",
        EVENT_SUBJECTS,
        *(advisory for durable in owned for advisory in consumer_advisories(durable)),
        *(f"{subject} {queue}" for subject, queue in identity.serves),
    ]
    subscribe: dict[str, list[str]] = {"allow": subscribe_allow}
    if not identity.serves:
        # A plain subscription to an API subject would overhear (and could answer) every request; a deny
        # without a queue group also refuses every queue subscription to it.
        subscribe["deny"] = [API_SUBJECTS]
    permissions: dict[str, object] = {
        "publish": {"allow": list(dict.fromkeys(publish)), "deny": deny},
        "subscribe": subscribe,
    }
    if identity.serves:
        permissions["allow_responses"] = True
    return permissions


def may_publish(identity: Identity, subject: str) -> bool:
    """Whether `identity` may publish on `subject` (NATS wildcard rules: `*` one token, `>` the rest)."""
    return any(subject_matches(pattern, subject) for pattern in identity.publishes)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject pattern (`*` one token, `>` the rest) covers `subject`.

    A `*` in `subject` stands for any token, so a pattern covers it only with a wildcard of its own there.
    """
    wanted, given = pattern.split("."), subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return len(given) > index
        if index >= len(given) or part not in {"*", given[index]}:
            return False
    return len(given) == len(wanted)


def authorization_users(passwords: Mapping[str, str], nodes: tuple[str, ...] = ()) -> list[dict[str, object]]:
    """The `users` of a nats-server `authorization` block: the admin, then every identity, each with its password.

    The embedded server and the compose stack's generated config both come from here.
    """
    users: list[dict[str, object]] = [
        {"user": ADMIN, "password": passwords[ADMIN], "permissions": {"publish": ">", "subscribe": ">"}}
    ]
    everyone = identities(nodes)
    durables = tuple(dict.fromkeys(durable for identity in everyone for durable in identity.durables))
    users.extend(
        {
            "user": identity.name,
            "password": passwords[identity.name],
            "permissions": nats_permissions(identity, durables),
        }
        for identity in everyone
    )
    return users
