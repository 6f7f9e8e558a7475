"""The scheduler as the composition root sees it: migrations and consumers."""

from __future__ import annotations

from lanes_contract.streams import JOBS, NODES
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.service import ServiceDefinition
from lanes_runtime.store import migrations_of
from lanes_scheduler.service_layer.handlers import handle_job_event, handle_node_event

JOB_EVENTS = ConsumerSpec(
    durable="scheduler-jobs",
    stream=JOBS,
    subjects=("lanes.job.*.submitted", "lanes.job.*.attempt_requested", "lanes.job.*.state_changed"),
)
NODE_EVENTS = ConsumerSpec(
    durable="scheduler-nodes",
    stream=NODES,
    subjects=("lanes.node.*.registered", "lanes.node.*.state_changed", "lanes.node.*.policy_set"),
)

SERVICE = ServiceDefinition(
    name="scheduler",
    migrations=migrations_of("lanes_scheduler.adapters"),
    consumers=((JOB_EVENTS, handle_job_event), (NODE_EVENTS, handle_node_event)),
)
