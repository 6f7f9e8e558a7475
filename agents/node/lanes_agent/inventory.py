"""What a node has: its GPUs from `nvidia-smi -q -x` where the driver is installed, otherwise CPUs and memory.

The XML differs across driver generations, so each field is read where any of them puts it:
- uncorrectable ECC counts: `dram_uncorrectable` and `sram_uncorrectable*` (since R470), or
  `double_bit/total` (older drivers); `N/A` where ECC is off or unsupported;
- a pending repair: `remapped_rows/remapped_row_pending` (A100 and later), or
  `retired_pages/pending_retirement` / `pending_blacklist` (older).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from lanes_contract.events import GpuDevice, NodeInventory

MAX_XML_BYTES = 4 * 1024 * 1024
"""Far above what 64 GPUs print (about 20 KiB each); anything larger is not nvidia-smi's answer."""
NVIDIA_SMI_TIMEOUT_S = 20.0
"""nvidia-smi can hang on a GPU that fell off the bus; the inventory must not hang with it."""
_MIB = {"MiB": 1, "GiB": 1024, "KiB": 1 / 1024}


class InventoryError(ValueError):
    """nvidia-smi's XML could not be read."""


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    if found is None or found.text is None:
        return None
    text = found.text.strip()
    return None if text in {"", "N/A", "Not Supported", "[N/A]"} else text


def _count(element: ET.Element, path: str) -> int | None:
    text = _text(element, path)
    return int(text) if text is not None and text.isdigit() else None


def _mib(text: str | None) -> int:
    if text is None:
        return 0
    value, _, unit = text.partition(" ")
    try:
        return round(float(value) * _MIB.get(unit.strip(), 1))
    except ValueError:
        return 0


def _uncorrectable(gpu: ET.Element) -> int | None:
    """Volatile uncorrectable ECC errors, summed over the counters this driver reports (None: none reported)."""
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return None
    counts = [
        _count(volatile, name)
        for name in (
            "dram_uncorrectable",
            "sram_uncorrectable",
            "sram_uncorrectable_parity",
            "sram_uncorrectable_secded",
            "double_bit/total",
        )
    ]
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def _repair_pending(gpu: ET.Element) -> bool:
    flags = (
        "remapped_rows/remapped_row_pending",
        "retired_pages/pending_retirement",
        "retired_pages/pending_blacklist",
    )
    return any((_text(gpu, flag) or "").lower() == "yes" for flag in flags)


def parse_nvidia_smi_xml(xml: str | bytes) -> tuple[str | None, str | None, tuple[GpuDevice, ...]]:
    """(driver version, CUDA version, GPUs) from `nvidia-smi -q -x`; raises InventoryError on anything else."""
    if len(xml) > MAX_XML_BYTES:
        raise InventoryError(f"nvidia-smi XML of {len(xml)} bytes exceeds {MAX_XML_BYTES}")
    try:
        root = ET.fromstring(xml)  # noqa: S314 - the local nvidia-smi's output, bounded above
    except ET.ParseError as exc:
        raise InventoryError(f"not XML: {exc}") from exc
    if root.tag != "nvidia_smi_log":
        raise InventoryError(f"root element <{root.tag}>, expected <nvidia_smi_log>")
    gpus = []
    for position, gpu in enumerate(root.findall("gpu")):
        minor = _count(gpu, "minor_number")
        gpus.append(
            GpuDevice(
                index=minor if minor is not None else position,
                name=(_text(gpu, "product_name") or "unknown")[:128],
                uuid=(_text(gpu, "uuid") or "")[:128],
                pci_bus_id=(_text(gpu, "pci/pci_bus_id") or gpu.get("id") or "")[:64],
                memory_mib=_mib(_text(gpu, "fb_memory_usage/total")),
                ecc_uncorrected=_uncorrectable(gpu),
                repair_pending=_repair_pending(gpu),
            )
        )
    return _text(root, "driver_version"), _text(root, "cuda_version"), tuple(gpus)


def _memory_gib(meminfo: Path = Path("/proc/meminfo")) -> float:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def node_inventory(nvidia_smi: str | None = None) -> NodeInventory:
    """This host's inventory; GPUs from `nvidia_smi` (default: the one on PATH, if any).

    A failing nvidia-smi is reported in `problem` rather than raised: the agent keeps running ranks, and the
    heartbeat tells the platform lane its GPU inventory is unreadable.
    """
    host = NodeInventory(
        source="host", hostname=socket.gethostname()[:256], cpus=os.cpu_count() or 1, memory_gib=_memory_gib()
    )
    binary = nvidia_smi or shutil.which("nvidia-smi")
    if binary is None:
        return host
    try:
        done = subprocess.run(  # noqa: S603 - a fixed argument list to a binary found by name
            [binary, "-q", "-x"], capture_output=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True
        )
        driver, cuda, gpus = parse_nvidia_smi_xml(done.stdout)
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or exc.stdout or b"").decode("utf-8", "replace").strip()
        problem = f"nvidia-smi exited {exc.returncode}: {said}"
    except (OSError, subprocess.TimeoutExpired, InventoryError) as exc:
        problem = f"nvidia-smi: {exc}"
    else:
        found = {"source": "nvidia-smi", "driver_version": driver, "cuda_version": cuda, "gpus": gpus}
        return NodeInventory.model_validate(host.model_dump() | found)
    return host.model_copy(update={"problem": problem[:1024]})
