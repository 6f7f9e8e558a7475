"""The recovery as the composition root sees it.

Recovery watches job state changes; policies come with the recovery issue.
"""

from __future__ import annotations

from lanes_common.consumer import ConsumerSpec, record_only
from lanes_common.service import ServiceDefinition
from lanes_common.streams import JOBS

EVENTS = ConsumerSpec(durable="recovery", stream=JOBS, subjects=("lanes.job.*.state_changed",))

SERVICE = ServiceDefinition(name="recovery", migrations=None, consumers=((EVENTS, record_only),))
