"""What some tests need beyond uv's install: torch, Chromium, Slurm, kubectl, the kernel as root.

A newcomer's `uv run pytest` skips those tests with one line that says what is missing and how to get it.
`.ci/run` installs every part and sets its `LANES_REQUIRE_*` variable, so there a missing part fails the run
instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from lanes_agent.faults import kernel_faults_unavailable
from lanes_agent.netns import NodeNetworks
from lanes_sandbox import slurm


@dataclass(frozen=True)
class OptionalPart:
    """A part some tests need: why it is missing here (None when present) and how to get it."""

    why_not: Callable[[], str | None]
    how: str
    required_by: str
    """The variable `.ci/run` sets: with it, a missing part fails the test instead of skipping it."""


def _torch_missing() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch (the `drill` group) is not installed"
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        return "torch is installed but its `torchrun` is not beside this Python"
    return None


def _chromium_missing() -> str | None:
    return None if chromium() else "Chromium is not installed"


def _kernel_missing() -> str | None:
    return kernel_faults_unavailable() or NodeNetworks.unavailable()


def _kubectl_missing() -> str | None:
    return None if shutil.which("kubectl") else "kubectl is not installed"


def chromium() -> str | None:
    """The Chromium binary on PATH, if any."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


TORCH = OptionalPart(_torch_missing, "uv sync --inexact --group drill", "LANES_REQUIRE_TORCH")
CHROMIUM = OptionalPart(_chromium_missing, "apt-get install chromium", "LANES_REQUIRE_BROWSER")
SLURM = OptionalPart(slurm.available, "as root, with Slurm installed as .ci/run does", "LANES_REQUIRE_SLURM")
KUBECTL = OptionalPart(_kubectl_missing, "apt-get install kubernetes-client", "LANES_REQUIRE_KUBECTL")
KERNEL = OptionalPart(
    _kernel_missing, "run the suite as root (cgroup v1 memory, /dev/kmsg, network namespaces)", "LANES_REQUIRE_KERNEL"
)


def require(part: OptionalPart) -> None:
    """Skip the calling test (or module) with one line when `part` is missing; fail instead where CI needs it."""
    why = part.why_not()
    if why is None:
        return
    if os.environ.get(part.required_by):
        pytest.fail(f"{part.required_by} is set but {why}", pytrace=False)
    pytest.skip(f"{why}; to run it: {part.how}", allow_module_level=True)
