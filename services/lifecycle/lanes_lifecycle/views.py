"""The lifecycle's read side for the app: jobs from the projection, and the check of a rebuild from the log."""

from lanes_lifecycle.adapters.repository import list_jobs, load
from lanes_lifecycle.domain.job import JobView
from lanes_lifecycle.entrypoints.rebuild import Difference, verify

__all__ = ["Difference", "JobView", "list_jobs", "load", "verify"]
