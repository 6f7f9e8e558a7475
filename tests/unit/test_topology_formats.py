"""Importers and the exporter on realistic files written from each format's public documentation."""

from __future__ import annotations

from pathlib import Path

import pytest

from lanes_cli.topology_formats import (
    TopologyFormatError,
    compress_hostlist,
    expand_hostlist,
    export_slurm,
    node_from_matrix,
    parse_k8s_labels,
    parse_native,
    parse_nvidia_smi,
    parse_slurm,
)
from lanes_contract.topology import Level

DATA = Path(__file__).resolve().parent.parent / "data" / "topology"


def _read(name: str) -> str:
    return (DATA / name).read_text()


def test_hostlists_expand_and_compress_with_zero_padding() -> None:
    assert expand_hostlist("gpu[001-003,007],cpu1") == ["gpu001", "gpu002", "gpu003", "gpu007", "cpu1"]
    assert compress_hostlist(["gpu003", "gpu001", "gpu002", "gpu007", "cpu1"]) == "cpu1,gpu[001-003,007]"
    with pytest.raises(TopologyFormatError, match="runs backwards"):
        expand_hostlist("gpu[9-3]", line=4)


def test_slurm_tree_gives_leaves_and_spines() -> None:
    cluster = parse_slurm(_read("slurm_tree.conf"), defaults={"gpus": 8, "gpu_model": "H100", "gpu_memory_gib": 80})
    assert len(cluster.nodes) == 128
    by_id = {n.node_id: n for n in cluster.nodes}
    assert (by_id["gpu001"].leaf, by_id["gpu001"].spine) == ("leaf01", "spine01")
    assert (by_id["gpu128"].leaf, by_id["gpu128"].spine) == ("leaf04", "spine02")
    assert by_id["gpu100"].gpus == 8
    assert {d: len(n) for d, n in cluster.domains(Level.LEAF).items()} == {f"leaf0{i}": 32 for i in range(1, 5)}


def test_slurm_block_gives_nvlink_domains_and_round_trips_through_the_exporter() -> None:
    cluster = parse_slurm(_read("slurm_block.conf"))
    assert {d: len(n) for d, n in cluster.domains(Level.NVLINK).items()} == {"nvl01": 18, "nvl02": 18, "nvl03": 18}
    exported = export_slurm(cluster, block=True)
    assert "BlockName=nvl01 Nodes=gb[001-018]" in exported
    again = parse_slurm(exported)
    assert again.domains(Level.NVLINK) == cluster.domains(Level.NVLINK)


def test_slurm_tree_round_trips_through_the_exporter() -> None:
    cluster = parse_slurm(_read("slurm_tree.conf"))
    exported = export_slurm(cluster)
    assert "SwitchName=leaf04 Nodes=gpu[097-128]" in exported
    assert "SwitchName=spine01 Switches=leaf01,leaf02" in exported
    again = parse_slurm(exported)
    assert [(n.node_id, n.leaf, n.spine) for n in again.nodes] == [(n.node_id, n.leaf, n.spine) for n in cluster.nodes]


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        (None, 3, "unclosed '\\['"),
        ("SwitchName=a Nodes=n1\nSwitchName=b\n", 2, "expected Nodes= or Switches="),
        ("SwitchName=a Nodes=n1\nSwitchName=s Switches=a,zz\n", 2, "unknown switch zz"),
        ("SwitchName=a Nodes=n[1-2]\nSwitchName=b Nodes=n2\n", 2, "already under switch a"),
        ("# c\n\nSwitchName=a Nodes=n1 Speed=9\n", 3, "unknown key 'speed'"),
        ("Frobnicate=1\n", 1, "expected SwitchName=, BlockName= or BlockSizes="),
        ("BlockName=b1 Nodes=n1\nBlockSizes=4,x\n", 2, "expected comma-separated integers"),
    ],
)
def test_malformed_slurm_names_the_line(text: str | None, line: int, expected: str) -> None:
    with pytest.raises(TopologyFormatError, match=expected) as caught:
        parse_slurm(text if text is not None else _read("slurm_bad.conf"))
    assert caught.value.line == line
    assert str(caught.value).startswith(f"line {line}:")


def test_kubernetes_labels_as_ordered_levels() -> None:
    cluster = parse_k8s_labels(_read("k8s_nodes.yaml"))
    by_id = {n.node_id: n for n in cluster.nodes}
    first = by_id["gke-a3-0001"]
    assert (first.gpus, first.gpu_memory_gib, first.gpu_model) == (8, 79, "NVIDIA-H100-80GB-HBM3")
    assert (first.nvlink_domain, first.leaf, first.spine) == ("clique-a-1", "rack-1", "block-1")
    assert by_id["gke-a3-0003"].nvlink_domain is None
    assert by_id["gke-a3-0003"].leaf == "rack-2"


def test_kubernetes_errors_name_the_line() -> None:
    text = _read("k8s_nodes.yaml").replace('nvidia.com/gpu: "8"', 'nvidia.com/gpu: "eight"', 1)
    with pytest.raises(TopologyFormatError, match="gke-a3-0001: expected integer") as caught:
        parse_k8s_labels(text)
    assert caught.value.line == 31
    with pytest.raises(TopologyFormatError, match="no Topology object"):
        parse_k8s_labels("kind: List\nitems: []\n")
    with pytest.raises(TopologyFormatError, match="line 4: not valid YAML"):
        parse_k8s_labels("kind: Topology\nspec:\n  levels: [\n")


def test_nvidia_smi_matrix_gives_nvlink_islands_and_nic_affinity() -> None:
    matrix = parse_nvidia_smi(_read("nvidia_smi_topo.txt"))
    assert matrix.gpus == 8
    assert matrix.nvlink_islands == (tuple(range(8)),)
    assert matrix.nic_affinity == {"NIC0": (0, 1), "NIC1": (4, 5)}
    assert matrix.links["GPU0-GPU7"] == "NV18"
    node = node_from_matrix("dgx-01", matrix, gpu_model="H100", gpu_memory_gib=80)
    assert (node.gpus, node.labels["lanes.io/nvlink-islands"]) == (8, "0,1,2,3,4,5,6,7")


def test_nvidia_smi_malformed_cell_names_the_line() -> None:
    text = _read("nvidia_smi_topo.txt").replace("NV18", "NVx", 1)
    with pytest.raises(TopologyFormatError, match="row GPU0, column GPU1: expected X, NV<n>") as caught:
        parse_nvidia_smi(text)
    assert caught.value.line == 2
    with pytest.raises(TopologyFormatError, match="line 1: expected a header row"):
        parse_nvidia_smi("hello\n")


def test_native_inventory_with_pools_and_quotas() -> None:
    cluster = parse_native(_read("cluster.yaml"))
    assert [n.node_id for n in cluster.nodes] == ["h100-001", "h100-002", "l40s-001"]
    assert cluster.policy.pool("reserved").admits("research")
    assert not cluster.policy.pool("reserved").admits("team-a")
    assert cluster.policy.tenant("research").quota("training") == 16


def test_native_inventory_error_names_the_line_of_the_bad_node() -> None:
    with pytest.raises(TopologyFormatError, match=r"nodes\.2\.gpus") as caught:
        parse_native(_read("cluster_bad.yaml"))
    assert caught.value.line == 23
