"""Reading a kubeconfig: the context's server and token, and clear refusals for what the observer does not do."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lanes_k8s.kubeconfig import KubeconfigError, from_kubeconfig


def write(tmp_path: Path, user: dict[str, object], *, current: str = "lab") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "clusters": [{"name": "lab", "cluster": {"server": "http://127.0.0.1:6443/"}}],
        "users": [{"name": "observer", "user": user}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "observer"}}],
    }
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_token_and_a_token_file_become_a_bearer_header(tmp_path):
    access = from_kubeconfig(write(tmp_path, {"token": "abc"}))
    assert (access.server, access.headers["Authorization"], access.context) == (
        "http://127.0.0.1:6443",
        "Bearer abc",
        "lab",
    )
    (tmp_path / "token").write_text("from-file\n")
    access = from_kubeconfig(write(tmp_path, {"tokenFile": "token"}))
    assert access.headers["Authorization"] == "Bearer from-file"
    assert "abc" not in access.describe()


def test_exec_plugins_missing_contexts_and_bad_files_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(KubeconfigError, match="exec plugin"):
        from_kubeconfig(write(tmp_path, {"exec": {"command": "aws"}}))
    with pytest.raises(KubeconfigError, match="no context named 'other'"):
        from_kubeconfig(write(tmp_path, {"token": "t"}), "other")
    with pytest.raises(KubeconfigError, match="cannot read"):
        from_kubeconfig(tmp_path / "missing")
    (tmp_path / "bad").write_text("[unclosed")
    with pytest.raises(KubeconfigError, match="not YAML"):
        from_kubeconfig(tmp_path / "bad")
