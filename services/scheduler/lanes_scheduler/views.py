"""The scheduler's read side for the app: nodes, holdings, policy, wait histories and releases."""

from lanes_scheduler.adapters.repository import holdings, nodes, policy, releases, wait_history
from lanes_scheduler.domain.admission import CapacityView

__all__ = ["CapacityView", "holdings", "nodes", "policy", "releases", "wait_history"]
