"""The scheduler's read side for the app: nodes, holdings, policy, wait histories, releases, and the what-if."""

from lanes_scheduler.adapters.repository import holdings, nodes, policy, releases, wait_history
from lanes_scheduler.domain.admission import CapacityView
from lanes_scheduler.entrypoints.whatif import Changes, PriorityChanges, SchedulerWhatIf, replay_scheduler

__all__ = [
    "CapacityView",
    "Changes",
    "PriorityChanges",
    "SchedulerWhatIf",
    "holdings",
    "nodes",
    "policy",
    "releases",
    "replay_scheduler",
    "wait_history",
]
