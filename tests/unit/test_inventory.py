"""The node inventory: nvidia-smi's XML of three driver generations, and a node without (or with a broken) one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lanes_agent.inventory import MAX_XML_BYTES, InventoryError, node_inventory, parse_nvidia_smi_xml

SAMPLES = Path(__file__).parent.parent / "data" / "nvidia_smi"


def test_h100_node_on_a_current_driver_names_every_gpu_and_the_one_awaiting_a_row_remap() -> None:
    driver, cuda, gpus = parse_nvidia_smi_xml((SAMPLES / "h100x8_r550.xml").read_bytes())
    assert (driver, cuda) == ("550.90.07", "12.4")
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert {gpu.name for gpu in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {gpu.memory_mib for gpu in gpus} == {81559}
    assert gpus[3].pci_bus_id == "00000000:5D:00.0"
    assert len({gpu.uuid for gpu in gpus}) == 8
    degraded = [(gpu.index, gpu.ecc_uncorrected) for gpu in gpus if gpu.repair_pending]
    assert degraded == [(5, 2)]
    assert all(gpu.ecc_uncorrected == 0 for gpu in gpus if gpu.index != 5)


def test_older_driver_counts_double_bit_errors_and_a_pending_page_retirement() -> None:
    driver, cuda, gpus = parse_nvidia_smi_xml((SAMPLES / "v100x4_r470.xml").read_bytes())
    assert (driver, cuda) == ("470.256.02", "11.4")
    assert [(gpu.index, gpu.memory_mib, gpu.ecc_uncorrected, gpu.repair_pending) for gpu in gpus] == [
        (0, 32510, 0, False),
        (1, 32510, 0, False),
        (2, 32510, 1, True),
        (3, 32510, 0, False),
    ]


def test_a_gpu_without_ecc_reports_no_count_rather_than_zero() -> None:
    _, _, (gpu,) = parse_nvidia_smi_xml((SAMPLES / "rtx4090_no_ecc.xml").read_bytes())
    assert (gpu.name, gpu.memory_mib, gpu.ecc_uncorrected, gpu.repair_pending) == (
        "NVIDIA GeForce RTX 4090",
        24564,
        None,
        False,
    )


@pytest.mark.parametrize(
    ("xml", "problem"),
    [
        (b"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "not XML"),
        (b"<nvidia_smi_log><gpu>", "not XML"),
        (b"<html><body>nope</body></html>", "expected <nvidia_smi_log>"),
        (b"<nvidia_smi_log>" + b" " * MAX_XML_BYTES + b"</nvidia_smi_log>", "exceeds"),
    ],
)
def test_anything_but_nvidia_smi_xml_is_refused_with_the_reason(xml: bytes, problem: str) -> None:
    with pytest.raises(InventoryError, match=problem):
        parse_nvidia_smi_xml(xml)


def _fake_nvidia_smi(tmp_path: Path, script: str) -> str:
    binary = tmp_path / "nvidia-smi"
    binary.write_text("#!/bin/sh\n" + script)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return str(binary)


def test_inventory_reads_the_gpus_from_the_nvidia_smi_it_runs(tmp_path: Path) -> None:
    binary = _fake_nvidia_smi(tmp_path, f'[ "$1 $2" = "-q -x" ] || exit 2\ncat {SAMPLES / "h100x8_r550.xml"}\n')
    inventory = node_inventory(binary)
    assert (inventory.source, len(inventory.gpus), inventory.driver_version, inventory.problem) == (
        "nvidia-smi",
        8,
        "550.90.07",
        None,
    )
    assert inventory.cpus == os.cpu_count()
    assert inventory.memory_gib > 0


def test_a_failing_nvidia_smi_is_reported_and_the_host_is_still_inventoried(tmp_path: Path) -> None:
    said = "Unable to determine the device handle for GPU0000:5D:00.0: Unknown Error"
    binary = _fake_nvidia_smi(tmp_path, f'echo "{said}"\nexit 15\n')
    inventory = node_inventory(binary)
    assert (inventory.source, inventory.gpus) == ("host", ())
    assert inventory.problem == f"nvidia-smi exited 15: {said}"
    assert inventory.cpus >= 1


def test_a_node_without_nvidia_smi_is_inventoried_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    inventory = node_inventory()
    assert (inventory.source, inventory.gpus, inventory.problem) == ("host", (), None)
    assert inventory.memory_gib > 0
