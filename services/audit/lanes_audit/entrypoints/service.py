"""The audit recorder as the composition root sees it: a reference downstream consumer of the timeline."""

from __future__ import annotations

from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_common.service import ServiceDefinition
from lanes_common.store import migrations_of

SERVICE = ServiceDefinition(
    name="audit",
    migrations=migrations_of("lanes_audit.adapters"),
    consumers=(),
    runners=(AuditRecorder,),
)
