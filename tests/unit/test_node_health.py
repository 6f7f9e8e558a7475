"""What `lanes topology agents` makes of heartbeats: silent agents, missing GPUs, faulty GPUs, blind agents."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lanes_cli.node_health import MISSED_BEATS, node_health
from lanes_contract.events import AgentHeartbeat, AgentHeartbeatData, GpuDevice, NodeInventory

NOW = datetime(2026, 12, 4, 7, 0, tzinfo=UTC)


def _gpu(index: int, **faults: object) -> GpuDevice:
    return GpuDevice.model_validate(
        {"index": index, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{index}", "pci_bus_id": f"0:{index}"}
        | {"memory_mib": 81559, "ecc_uncorrected": 0}
        | faults
    )


def _beat(
    node: str, *, ago_s: float, gpus: int = 8, kernel_log: str = "following", **gpu_faults: object
) -> AgentHeartbeat:
    devices = tuple(_gpu(i, **(gpu_faults if i == 3 else {})) for i in range(gpus))
    inventory = NodeInventory(source="nvidia-smi", hostname="h", cpus=96, memory_gib=2015.6, gpus=devices)
    data = AgentHeartbeatData(
        agent=f"agent-{node}",
        started_at=NOW - timedelta(hours=1),
        interval_s=10,
        running_ranks=8,
        kernel_log=kernel_log,
        inventory=inventory,
    )
    return AgentHeartbeat(source=f"agent/{node}", node=node, time=NOW - timedelta(seconds=ago_s), data=data)


def test_a_healthy_node_has_no_problem_and_the_latest_beat_counts() -> None:
    older = _beat("n1", ago_s=500)
    (row,) = node_health([_beat("n1", ago_s=4), older], {"n1": 8}, NOW)
    assert (row.node, row.heard_s_ago, row.running_ranks, row.problems) == ("n1", 4.0, 8, ())
    assert row.as_json()["inventory"]["gpus"][0]["memory_mib"] == 81559


def test_an_agent_silent_for_more_than_three_beats_is_a_problem_and_one_missed_beat_is_not() -> None:
    late = 10 * MISSED_BEATS + 1
    rows = node_health([_beat("n1", ago_s=19), _beat("n2", ago_s=late)], {}, NOW)
    assert [row.problems for row in rows] == [(), (f"agent silent for {late} s (beats every 10 s)",)]


def test_a_registered_node_no_agent_ever_spoke_for_is_named() -> None:
    (row,) = node_health([], {"n9": 8}, NOW)
    assert (row.node, row.agent, row.heard_s_ago, row.problems) == ("n9", None, None, ("no agent heard",))


def test_fewer_gpus_than_registered_and_a_faulty_gpu_are_each_named() -> None:
    beat = _beat("n1", ago_s=1, gpus=7, ecc_uncorrected=2, repair_pending=True)
    (row,) = node_health([beat], {"n1": 8}, NOW)
    assert row.problems == (
        "registered with 8 GPUs, nvidia-smi sees 7",
        "GPU 3 (0:3): 2 uncorrectable ECC errors, repair pending (needs a reset)",
    )


def test_an_agent_that_cannot_read_the_kernel_log_is_a_problem_but_one_told_not_to_is_not() -> None:
    blind = _beat("n1", ago_s=1, kernel_log="kernel log /dev/kmsg unreadable: Permission denied")
    rows = node_health([blind, _beat("n2", ago_s=1, kernel_log="off")], {}, NOW)
    assert [row.problems for row in rows] == [("kernel log /dev/kmsg unreadable: Permission denied",), ()]
