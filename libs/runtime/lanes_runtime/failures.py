"""Which failures say something about the event, and which only say a server did not answer.

The runtime asks this once per failure: an infrastructure failure pauses the consumer (no delivery spent,
never a dead letter); anything else is about the event or the handler and goes through `decide`.
"""

from __future__ import annotations

import asyncpg
from nats.errors import Error as NatsError
from nats.js.errors import APIError, ServiceUnavailableError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lanes_contract.errors import ProcessingError, ServerUnavailableError
from lanes_runtime import decision

_POSTGRES_UNAVAILABLE = (
    asyncpg.PostgresConnectionError,  # class 08: the connection failed or was refused
    asyncpg.exceptions.OperatorInterventionError,  # class 57: shutdown, terminated session, cannot connect now
    asyncpg.exceptions.InsufficientResourcesError,  # class 53: too many connections, out of memory or disk
    asyncpg.exceptions.TransactionRollbackError,  # class 40: serialization failure, deadlock (try again)
    asyncpg.InterfaceError,  # the connection is closed or was lost mid-transaction
)


def is_infrastructure(exc: BaseException) -> bool:
    """True when `exc` means a server (PostgreSQL, NATS, Redis) was unreachable, overloaded or too slow."""
    if isinstance(exc, ProcessingError):
        return False  # the handler decided explicitly
    if isinstance(exc, APIError):
        return isinstance(exc, ServiceUnavailableError)  # any other API answer is about the request
    return isinstance(
        exc,
        (
            *_POSTGRES_UNAVAILABLE,
            NatsError,
            RedisConnectionError,
            RedisTimeoutError,
            ServerUnavailableError,
            OSError,  # includes ConnectionError and the builtin TimeoutError
        ),
    )


def classify(exc: BaseException) -> decision.Outcome:
    """The outcome of a delivery whose processing raised `exc`."""
    reason = f"{type(exc).__name__}: {exc}"
    if is_infrastructure(exc):
        return decision.Unavailable(reason)
    if isinstance(exc, ProcessingError) and not exc.retryable:
        return decision.Invalid(reason)
    return decision.Failed(reason, exc.delay_s if isinstance(exc, ProcessingError) else None)
