"""The audit recorder as the composition root sees it: a reference downstream consumer of the timeline."""

from __future__ import annotations

from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_contract.streams import JOBS
from lanes_runtime.service import RunnerContext, ServiceDefinition
from lanes_runtime.store import migrations_of


def _recorder(context: RunnerContext) -> AuditRecorder:
    return AuditRecorder(context.nc, context.pool)


SERVICE = ServiceDefinition(
    name="audit",
    migrations=migrations_of("lanes_audit.adapters"),
    consumers=(),
    runners=(_recorder,),
    runner_subjects=JOBS.subjects,  # the recorder copies the whole job timeline
)
