"""Recovery's read side for the app: policies (shipped, or from a file) and the what-if replay over a log."""

from lanes_recovery.adapters.policies import default_policy, policy_from_file
from lanes_recovery.domain.policy import Policy, PolicyError, parse_policy
from lanes_recovery.entrypoints.whatif import DecisionChange, WhatIf, replay_recovery

__all__ = [
    "DecisionChange",
    "Policy",
    "PolicyError",
    "WhatIf",
    "default_policy",
    "parse_policy",
    "policy_from_file",
    "replay_recovery",
]
