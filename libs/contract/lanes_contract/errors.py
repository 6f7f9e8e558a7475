"""Typed errors shared by every Lanes component.

Each processing error carries its retry decision (the Temporal SDK's shape): a consumer never has to
guess whether an exception means "try again later" or "this message can never succeed".
"""

from __future__ import annotations


class LanesError(Exception):
    """Base class of every error Lanes raises on purpose."""


class InvalidEventError(LanesError, ValueError):
    """A producer tried to publish an event that is not valid; nothing was sent."""


class DecodeError(LanesError):
    """A message read from the log is not a valid Lanes event (a poison message)."""


class UnsupportedServerError(LanesError):
    """A server is reachable but too old or misconfigured for Lanes."""


class ServerUnavailableError(LanesError):
    """A server could not be reached at the configured address."""


class AuthenticationError(ServerUnavailableError):
    """The server refused the credentials a connection presented (or their absence)."""


class PermissionDeniedError(LanesError):
    """The server refused an operation this identity is not allowed (publish on a subject, manage a stream)."""


class EventIdConflictError(LanesError):
    """JetStream dropped a publish as a re-send, but the message stored under its id is another event.

    Someone (another identity, or a bug) used the id first: the event was not stored, and saying it was would
    report a job, a command or an import that never reached the log.
    """


class StreamConflictError(LanesError):
    """An existing stream differs from its definition in a way Lanes refuses to change silently."""


class ProcessingError(LanesError):
    """A handler failure together with its retry decision."""

    retryable: bool = True

    def __init__(self, message: str, *, delay_s: float | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class TransientError(ProcessingError):
    """The event is fine but a dependency is not (database down, timeout): redeliver later."""

    retryable = True


class PoisonEventError(ProcessingError):
    """The event can never be processed (violates an invariant): dead-letter it at once."""

    retryable = False
