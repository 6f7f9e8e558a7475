"""`lanes topology import | show | export` and the topology demo scenario on a running stack."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.cli import local_stack, run_lanes, run_lanes_async

from lanes_cli.bootstrap import SERVICES
from lanes_cli.scenarios.topology import TOPOLOGY_NODES, topology_wait_then_placed
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers
DATA = Path(__file__).resolve().parent.parent / "data" / "topology"


@pytest.fixture
async def stack(own_urls: ServerUrls) -> AsyncIterator[Connections]:
    async with local_stack(own_urls, SERVICES, nodes=False) as conns:
        yield conns


@pytest.mark.slow
async def test_import_show_export_and_the_topology_demo_with_its_wait_history(
    stack: Connections, own_urls: ServerUrls
) -> None:
    imported = await run_lanes_async(own_urls, "topology", "import", str(DATA / "cluster.yaml"), "--format", "lanes")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout) == {"nodes": 3, "gpus": 20, "published": 3}

    demo = await topology_wait_then_placed(stack, timeout_s=60)
    (wait,) = demo.wait_history
    assert wait["reason"] == "topology_unsatisfiable"
    assert "needs 4 GPUs under one leaf; the largest free leaf has 2 (topo-leaf-a); 4 free in total" in wait["detail"]
    assert wait["blocking"][0]["holders"] == [f"{demo.blocker_job_id}/1"]
    assert wait["ended_by"] == "placed"
    assert wait["seconds"] > 0

    shown = await run_lanes_async(own_urls, "topology", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    nodes = {n["node_id"]: n for n in view["nodes"]}
    assert set(nodes) == {"h100-001", "h100-002", "l40s-001", *TOPOLOGY_NODES}
    assert nodes["h100-001"]["domains"] == {"node": "h100-001", "nvlink": "nvl-1", "leaf": "leaf-1", "spine": "spine-1"}
    assert nodes["h100-001"]["pool"] == "training"
    assert view["domains"]["leaf"]["topo-leaf-a"] == {"nodes": 3, "gpus": 6, "free_gpus": 6}
    assert view["policy"]["tenants"] == [{"name": "research", "gpu_quota": {"training": 16}}]
    assert view["leaked_allocations"] == []

    job = await run_lanes_async(own_urls, "job", demo.job_id, "--json")
    assert job.returncode == 0, job.stderr
    scheduling = json.loads(job.stdout)["scheduling"]
    assert list(scheduling["seconds_in_reason"]) == ["topology_unsatisfiable"]

    # An allocation whose job the lifecycle never heard of (a lost release, a crashed writer) is reported.
    await stack.pool.execute(
        """INSERT INTO scheduler_jobs (job_id, attempt, workers, gpus_per_worker, status, submitted_seq)
           VALUES ('ghost', 1, 1, 2, 'placed', 0)"""
    )
    await stack.pool.execute(
        """INSERT INTO scheduler_allocations (node_id, gpu_index, job_id, attempt, rank)
           VALUES ('h100-002', 0, 'ghost', 1, 0), ('h100-002', 1, 'ghost', 1, 0)"""
    )
    shown = await run_lanes_async(own_urls, "topology", "show", "--json")
    assert json.loads(shown.stdout)["leaked_allocations"] == [
        {"job_id": "ghost", "attempt": 1, "nodes": ["h100-002"], "gpus": 2, "why": "the lifecycle knows no such job"}
    ]

    exported = await run_lanes_async(own_urls, "topology", "export")
    assert exported.returncode == 0, exported.stderr
    assert "SwitchName=leaf-1 Nodes=h100-[001-002]" in exported.stdout
    assert "SwitchName=topo-leaf-a Nodes=topo-a[1-3]" in exported.stdout


def test_malformed_files_get_a_line_numbered_error_and_exit_2(urls: ServerUrls) -> None:
    result = run_lanes(urls, "topology", "import", str(DATA / "slurm_bad.conf"), "--format", "slurm", "--dry-run")
    assert result.returncode == 2
    assert "slurm_bad.conf: line 3: unclosed '['" in result.stderr
    result = run_lanes(urls, "topology", "import", str(DATA / "cluster_bad.yaml"), "--dry-run")
    assert result.returncode == 2
    assert "line 23: nodes.2.gpus" in result.stderr
    result = run_lanes(urls, "topology", "import", str(DATA / "cluster.yaml"), "--format", "yaml", "--dry-run")
    assert result.returncode == 2
    assert "unknown format 'yaml'" in result.stderr


@pytest.mark.parametrize(
    ("name", "fmt", "extra", "nodes"),
    [
        ("slurm_tree.conf", "slurm", ["--gpus", "8", "--gpu-model", "H100"], 128),
        ("slurm_block.conf", "slurm", [], 54),
        ("k8s_nodes.yaml", "labels", [], 3),
        ("nvidia_smi_topo.txt", "nvidia-smi", ["--node", "dgx-01"], 1),
        ("cluster.yaml", "lanes", [], 3),
    ],
)
def test_every_format_imports_from_the_command_line(
    urls: ServerUrls, name: str, fmt: str, extra: list[str], nodes: int
) -> None:
    result = run_lanes(urls, "topology", "import", str(DATA / name), "--format", fmt, "--dry-run", *extra)
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert parsed["nodes"] == nodes
    assert all(set(n["domains"]) == {"node", "nvlink", "leaf", "spine"} for n in parsed["cluster"])
