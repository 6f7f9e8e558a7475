"""Telemetry's read side for the app: the same first-error election the live service runs, for offline logs."""

from lanes_telemetry.domain.election import World, elect_first_error

__all__ = ["World", "elect_first_error"]
