"""The observer's ClusterRole (deploy/k8s/observer-clusterrole.yaml): valid, read only, and exactly what it watches."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import yaml

from lanes_k8s.watch import RESOURCES

ROLE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "observer-clusterrole.yaml"


def test_the_cluster_role_is_valid_read_only_and_covers_every_watched_collection():
    role = yaml.safe_load(ROLE.read_text())
    kubernetes_validate.validate(role, "1.37.0", strict=True)
    assert role["kind"] == "ClusterRole"
    granted = set()
    for rule in role["rules"]:
        if rule["resources"] == ["pods/log"]:  # --logs: reading a log is a get, never a write
            assert rule["verbs"] == ["get"]
            continue
        assert set(rule["verbs"]) == {"get", "list", "watch"}
        granted |= {(group, plural) for group in rule["apiGroups"] for plural in rule["resources"]}
    needed = {
        (r.api.removeprefix("/apis/").split("/")[0] if r.api.startswith("/apis/") else "", r.plural) for r in RESOURCES
    }
    assert granted == needed
