"""The telemetry as the composition root sees it.

Telemetry consumes node evidence; correlation and first-error election come with the telemetry issue.
"""

from __future__ import annotations

from lanes_common.consumer import ConsumerSpec, record_only
from lanes_common.service import ServiceDefinition
from lanes_common.streams import TELEMETRY

EVENTS = ConsumerSpec(durable="telemetry", stream=TELEMETRY, subjects=("lanes.tel.>",))

SERVICE = ServiceDefinition(name="telemetry", migrations=None, consumers=((EVENTS, record_only),))
