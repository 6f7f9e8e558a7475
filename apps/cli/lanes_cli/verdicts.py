"""Did recovery act on the truth? Read from timeline rows where the console reads them too."""

from __future__ import annotations

from lanes_console.verdicts import DecisionVerdict, decision_verdicts

__all__ = ["DecisionVerdict", "decision_verdicts"]
