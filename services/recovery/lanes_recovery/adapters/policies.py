"""Where the recovery policy comes from: the one shipped in the package, or a file named by the operator."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from lanes_recovery.domain.policy import Policy, parse_policy

POLICY_ENV = "LANES_RECOVERY_POLICY"
"""Set to a YAML file to run recovery under that policy instead of the shipped default."""


def default_policy() -> Policy:
    """The policy Lanes ships (`lanes_recovery/policies/default.yaml`)."""
    text = files("lanes_recovery.policies").joinpath("default.yaml").read_text(encoding="utf-8")
    return parse_policy(text, origin="lanes_recovery/policies/default.yaml")


def policy_from_file(path: Path) -> Policy:
    """A policy file, validated (PolicyError says what is wrong)."""
    return parse_policy(path.read_text(encoding="utf-8"), origin=str(path))


def configured_policy() -> Policy:
    """The file named by LANES_RECOVERY_POLICY when set, else the shipped default."""
    named = os.environ.get(POLICY_ENV)
    return policy_from_file(Path(named)) if named else default_policy()
