"""The router as the composition root sees it: a runner that serves the OpenAI-compatible HTTP front."""

from __future__ import annotations

from lanes_common.service import RunnerContext, ServiceDefinition
from lanes_router.entrypoints.runner import RouterRunner


def _router(context: RunnerContext) -> RouterRunner:
    return RouterRunner(context.nc, context.redis)


SERVICE = ServiceDefinition(name="router", migrations=None, consumers=(), runners=(_router,))
