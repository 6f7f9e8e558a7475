"""docker-compose.yml against the Compose Specification's JSON schema, offline.

The schema is the compose-spec one that `check-jsonschema` vendors (`--builtin-schema vendor.compose-spec`): no
Docker engine and no network. tests/test_compose.py checks what the schema cannot (the services the code expects,
the NATS configuration they mount); tests/test_k8s_manifests.py checks the Kubernetes manifests against the same
stack.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_compose_file_is_valid_against_the_compose_specification() -> None:
    result = _check(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_compose_file_with_a_misspelt_key_is_refused(tmp_path: Path) -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    compose["services"]["scheduler"]["restarts"] = "always"  # `restart`, misspelt
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(compose))
    result = _check(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "restarts" in result.stdout
