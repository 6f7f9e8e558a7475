"""The composition root: the one place where services meet concrete servers."""

from __future__ import annotations

from collections.abc import Iterable

from lanes_audit.entrypoints.service import SERVICE as AUDIT
from lanes_contract.signing import Keyring
from lanes_lifecycle.entrypoints.service import SERVICE as LIFECYCLE
from lanes_recovery.entrypoints.service import SERVICE as RECOVERY
from lanes_router.entrypoints.service import SERVICE as ROUTER
from lanes_runtime import service as runtime
from lanes_runtime.service import Connections, Runner, ServiceDefinition
from lanes_runtime.settings import configured_keyring
from lanes_scheduler.entrypoints.service import SERVICE as SCHEDULER
from lanes_telemetry.entrypoints.service import SERVICE as TELEMETRY

SERVICES: dict[str, ServiceDefinition] = {s.name: s for s in (SCHEDULER, LIFECYCLE, TELEMETRY, RECOVERY, ROUTER, AUDIT)}


async def prepare_services(
    conns: Connections, services: Iterable[str | ServiceDefinition], *, keyring: Keyring | None = None
) -> list[Runner]:
    """Provision services named (one of `SERVICES`) or given as definitions (e.g. recovery under a test's policy).

    Their consumers verify each event's signer before acting on it against `keyring`, or else the one
    LANES_KEYRING names (`lanes up` and `lanes demo` set it to their embedded server's).
    """
    definitions = [SERVICES[s] if isinstance(s, str) else s for s in services]
    return await runtime.prepare_services(conns, definitions, keyring=keyring or configured_keyring())
