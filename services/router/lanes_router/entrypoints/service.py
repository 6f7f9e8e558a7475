"""The router as the composition root sees it.

The router watches placements (inference replicas); routing comes with the router issue.
"""

from __future__ import annotations

from lanes_common.consumer import ConsumerSpec, record_only
from lanes_common.service import ServiceDefinition
from lanes_common.streams import JOBS

EVENTS = ConsumerSpec(durable="router", stream=JOBS, subjects=("lanes.job.*.placed",))

SERVICE = ServiceDefinition(name="router", migrations=None, consumers=((EVENTS, record_only),))
