"""The router as the composition root sees it: a runner that serves the OpenAI-compatible HTTP front."""

from __future__ import annotations

from lanes_router.adapters.registry_feed import JOB_SUBJECTS, NODE_SUBJECTS
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.service import RunnerContext, ServiceDefinition


def _router(context: RunnerContext) -> RouterRunner:
    return RouterRunner(context.nc, context.redis)


SERVICE = ServiceDefinition(
    name="router",
    migrations=None,
    consumers=(),
    runners=(_router,),
    runner_subjects=(*JOB_SUBJECTS, *NODE_SUBJECTS),
)
