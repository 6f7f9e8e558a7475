"""Parsers for the log formats people paste into incident channels, turning lines into evidence.

Formats: PyTorch ProcessGroupNCCL watchdog lines (old and new, with SeqNum / OpType / Timeout(ms) and the
last enqueued / completed work), ProcessGroupGloo errors, torchelastic's ChildFailedError summary (with its
"Root Cause (first observed failure)" block), NCCL debug lines (`host:pid:tid [dev] NCCL WARN ...`),
rank-prefixed Python tracebacks (`[rank3]:`, `[default0]:[rank12]:`, `[RANK 1]`, `RankID:3`, `[1,3]<stderr>:`,
srun's `3: `, pdsh's `host: `, Ray / vLLM worker prefixes), CUDA errors, kernel lines (NVRM Xid, OOM killer,
NIC link down, lspci `(rev ff)`), Slurm (`srun: error: ... task N: Exited with exit code`), c10d rendezvous,
HCCL error codes, DeepSpeed's launcher, and a few scheduler / clock lines. A line nothing recognises becomes
RAW evidence, and no input ever raises: a malformed timestamp or number degrades the line to RAW instead.

Pure: text in, evidence out. The caller says which node / rank / file the text came from and which year and
time zone its timestamps are in (`SourceContext`, no default: `clock_of` reads them from the text itself or
from what the caller knows, e.g. the file's modification time); what the lines themselves say (a `[rank3]:`
prefix, an NCCL host prefix, a syslog host) wins over the context.
"""

from __future__ import annotations

import contextlib
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

from lanes_contract.events import EvidenceCategory, EvidenceData
from lanes_evidence.evidence import DRIVER_MODULE_MISMATCH, Evidence

C = EvidenceCategory
MAX_LINE = 2048
"""Longer lines are cut: evidence is for reading, and a 1 MB line is not evidence but a problem."""
_MAX_FRAMES = 3

_MONTHS = {
    m: i
    for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1)
}
_SIGNALS = {"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGABRT": 6, "SIGKILL": 9, "SIGSEGV": 11, "SIGTERM": 15}
_ECC_XIDS = frozenset({48, 63, 64, 92, 94, 95})
"""Xids that report memory (ECC) errors rather than a generic GPU fault."""
_SHM = "/dev/" + "shm"
"""The shared-memory mount, named in a bus error or a full-shm message (a platform limit, not a full disk)."""
_APPLICATION_XIDS = frozenset({13, 31, 43})
"""Xids NVIDIA lists as usually the application's fault (engine exception, MMU fault, a stopped kernel)."""
_AFTERMATH_XIDS = frozenset({45})
"""Preemptive cleanup after an earlier error: a consequence, never a cause on its own."""


@dataclass(frozen=True, kw_only=True)
class SourceContext:
    """Where the text comes from (its file or stream, the node / rank when the file stands for one) and when."""

    origin: str = ""
    node: str | None = None
    rank: int | None = None
    year: int | None
    """Year for timestamps that carry none (glog `E1202`, syslog `Dec  2`, vLLM `05-02`); None: such lines get
    no time (an unknown year is not guessed)."""
    tz: tzinfo
    """Time zone of timestamps written without an offset."""


@dataclass(frozen=True)
class LineMatch:
    """What one line says: the evidence fields, and where it says it happened (when the line names it)."""

    fields: dict[str, Any]
    node: str | None = None
    rank: int | None = None
    time: datetime | None = None
    local_rank: int | None = None
    """A rank numbered within its node (torchrun's `local_rank: 3`): the parser maps it to the global rank."""


# --- timestamps ----------------------------------------------------------------------------------

_ISO = re.compile(
    r"(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})[T ](?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:[.,](?P<f>\d{1,9}))?"
    r"(?P<tz>Z|[+-]\d{2}:?\d{2})?"
)
_ELASTIC_TIME = re.compile(r"(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})_(?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})")
# Ascend / HCCL plog: 2024-05-01-10:00:00.123.456 (milliseconds, then microseconds).
_DASHED_TIME = re.compile(
    r"(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})-(?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:\.(?P<ms>\d{3})\.(?P<us>\d{3}))?"
)
# glog as c10 writes it: the month is not zero-padded (E321 is March 21, E1206 December 6).
_GLOG = re.compile(
    r"(?:^|\[)[IWEF](?P<mo>\d{1,2})(?P<d>\d{2}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:\.(?P<f>\d{1,9}))?\s"
)
# vLLM's logger: `ERROR 05-02 10:11:12 [core.py:390] ...` (month-day, no year).
_LEVEL_MONTH_DAY = re.compile(
    r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<mo>\d{2})-(?P<d>\d{2}) "
    r"(?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:\.(?P<f>\d{1,6}))?\b"
)
_SYSLOG = re.compile(
    r"^(?:\[(?:\w{3} )?)?(?P<mon>[A-Z][a-z]{2}) {1,2}(?P<d>\d{1,2}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})"
    r"(?:\.(?P<f>\d{1,9}))?(?: (?P<y>\d{4})\])?"
)
_OFFSET = re.compile(r"\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?P<tz>[+-]\d{2}:?\d{2})\b")


def _fraction(text: str | None) -> int:
    return int((text or "0")[:6].ljust(6, "0"))


def _moment(fields: tuple[int, int, int, int, int, int, int], tz: tzinfo) -> datetime:
    return datetime(*fields, tzinfo=tz).astimezone(UTC)


def parse_time(line: str, year: int | None, tz: tzinfo) -> datetime | None:
    """The timestamp a line carries, in UTC, or None.

    A timestamp without an offset is in `tz`; one without a year is in `year` (or has no time when None).
    """
    if m := _ISO.search(line):
        moment = datetime(
            int(m["y"]), int(m["mo"]), int(m["d"]), int(m["h"]), int(m["mi"]), int(m["s"]), _fraction(m["f"]), UTC
        )
        if not (offset := m["tz"]):
            return moment.replace(tzinfo=tz).astimezone(UTC)
        if offset != "Z":
            digits = offset[1:].replace(":", "")
            delta = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
            moment -= delta if offset[0] == "+" else -delta
        return moment
    if m := _DASHED_TIME.search(line):
        micros = int(m["ms"] or 0) * 1000 + int(m["us"] or 0)
        return _moment((int(m["y"]), int(m["mo"]), int(m["d"]), int(m["h"]), int(m["mi"]), int(m["s"]), micros), tz)
    if m := _ELASTIC_TIME.search(line):
        return _moment((int(m["y"]), int(m["mo"]), int(m["d"]), int(m["h"]), int(m["mi"]), int(m["s"]), 0), tz)
    if m := _SYSLOG.search(line):
        written = int(m["y"]) if m["y"] else year
        if m["mon"].lower() not in _MONTHS or written is None:
            return None
        month = _MONTHS[m["mon"].lower()]
        return _moment((written, month, int(m["d"]), int(m["h"]), int(m["mi"]), int(m["s"]), _fraction(m["f"])), tz)
    if year is None:
        return None
    if (m := _GLOG.search(line)) or (m := _LEVEL_MONTH_DAY.search(line)):
        return _moment((year, int(m["mo"]), int(m["d"]), int(m["h"]), int(m["mi"]), int(m["s"]), _fraction(m["f"])), tz)
    return None


_YEAR_IN = (_ISO, _DASHED_TIME, _ELASTIC_TIME, _SYSLOG)
_CLOCK_SCAN_LINES = 5000


def clock_of(text: str, *, fallback: datetime) -> tuple[int, tzinfo]:
    """The year and time zone of a log's year-less, offset-less timestamps.

    From the log's own timestamps when any carries a year (or an offset), else from `fallback` (the file's
    modification time, or the moment a live stream is read): nothing is assumed.
    """
    year: int | None = None
    tz: tzinfo | None = None
    for line in text.splitlines()[:_CLOCK_SCAN_LINES]:
        if year is None:
            for pattern in _YEAR_IN:
                if (m := pattern.search(line)) and m.groupdict().get("y"):
                    year = int(m["y"])
                    break
        if tz is None and (m := _OFFSET.search(line)):
            digits = m["tz"][1:].replace(":", "")
            delta = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
            if delta < timedelta(hours=24):
                tz = timezone(delta if m["tz"][0] == "+" else -delta)
        if year is not None and tz is not None:
            break
    return year or fallback.year, tz or fallback.tzinfo or UTC


# --- one-line formats ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prefixes:
    """What the wrappers in front of a line say about who wrote it."""

    rank: int | None = None
    local_rank: int | None = None
    node: str | None = None
    worker: str | None = None
    """A worker's own tag (Ray / vLLM `(... pid=N)`): a rank it announces once holds for its later lines."""


# Wrappers stack (`0: [80746] [default0]:[rank12]: ...`, `node-1: [rank3]: ...`): each is peeled in turn, the
# innermost rank wins (srun's task of a per-node torchrun is not the rank); srun's label and pdsh's host only
# ever come first.
_PREFIXES: tuple[tuple[str, bool, re.Pattern[str]], ...] = (
    ("rank", False, re.compile(r"\[(?:rank|Rank |RANK )(?P<v>\d{1,7})\]:?\s?")),
    ("local", False, re.compile(r"\[(?:default|trainer|worker)(?P<v>\d{1,4})\]:\s?")),
    ("rank", False, re.compile(r"\[\d{1,9},(?P<v>\d{1,7})\]<(?:stdout|stderr)>:\s?")),
    ("pid", False, re.compile(r"\[\d{1,10}\]\s")),
    ("worker", False, re.compile(r"\((?P<v>\w*(?:Worker|Wrapper|Trainer|EngineCore)\w*[^()]{0,80}?)\)\s")),
    ("rank", True, re.compile(r"(?P<v>\d{1,5}): (?=\S|\s+\S)(?!\d)")),
    ("node", True, re.compile(r"(?P<v>(?=[\w.-]*\d)[a-z][\w-]{0,62}(?:\.[\w-]+)*): (?=\[|Traceback|\S+Error\b)")),
)
_MAX_PREFIXES = 5
_WORKER_RANK = re.compile(r"\brank=(\d{1,7})")
_WORKER_IP = re.compile(r"\bip=([\d.]{7,15}|[\w-]+)")
_INLINE_RANK = re.compile(r"\[?RankID:\s?(\d{1,7})\]?")


def split_prefixes(line: str) -> tuple[Prefixes, str]:
    """The launcher / wrapper prefixes of a line and the line without them."""
    found: dict[str, str] = {}
    body = line.lstrip()
    for position in range(_MAX_PREFIXES):
        for kind, outermost, pattern in _PREFIXES:
            if (position == 0 or not outermost) and (m := pattern.match(body)):
                found[kind] = m.groupdict().get("v") or ""
                body = body[m.end() :]
                break
        else:
            break
    rank = int(found["rank"]) if "rank" in found else None
    worker = found.get("worker")
    node = found.get("node")
    if worker is not None:
        if rank is None and (m := _WORKER_RANK.search(worker)):
            rank = int(m[1])
        if node is None and (m := _WORKER_IP.search(worker)):
            node = m[1]
    if rank is None and (m := _INLINE_RANK.search(body)):
        rank = int(m[1])
    local = int(found["local"]) if "local" in found else None
    return Prefixes(rank=rank, local_rank=local, node=node, worker=worker), body


_PG_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d{1,7})\]")
_WORK_NCCL = re.compile(r"WorkNCCL\((?P<body>(?:[^()]|\(ms\))*)\)")
_KV = re.compile(r"(\w+(?:\(ms\))?)=(\w+)")
_WATCHDOG_WORK = re.compile(
    r"(?:Timeout at NCCL work|detected by watchdog at work): (?P<seq>-?\d+), last enqueued NCCL work: (?P<enq>-?\d+), "
    r"last completed NCCL work: (?P<done>-?\d+)"
)
_RAN_FOR = re.compile(r"ran for (\d+) milliseconds")


def parse_nccl_watchdog(line: str) -> LineMatch | None:
    """PyTorch ProcessGroupNCCL watchdog lines, old (`[E ProcessGroupNCCL.cpp:475]`) and new (glog, PG ids)."""
    if "ProcessGroupNCCL" not in line and "NCCL work" not in line and "WorkNCCL" not in line:
        return None
    rank = int(m[1]) if (m := _PG_RANK.search(line)) else None
    if "Watchdog caught collective operation timeout" in line and (work := _WORK_NCCL.search(line)):
        values = dict(_KV.findall(work["body"]))
        fields: dict[str, Any] = {
            "category": C.COLLECTIVE_TIMEOUT,
            "op_type": values.get("OpType"),
            "seq_num": _nonneg(values.get("SeqNum")),
            "timeout_ms": _nonneg(values.get("Timeout(ms)")),
        }
        ran = _RAN_FOR.search(line)
        fields["summary"] = f"{fields['op_type'] or 'collective'} SeqNum={fields['seq_num']} timed out" + (
            f" after {int(ran[1]) // 1000} s" if ran else ""
        )
        return LineMatch(fields, rank=rank)
    if m := _WATCHDOG_WORK.search(line):
        seq = _nonneg(m["seq"])
        return LineMatch(
            {
                "category": C.COLLECTIVE_TIMEOUT,
                "seq_num": seq,
                "last_enqueued": _nonneg(m["enq"]),
                "last_completed": _nonneg(m["done"]),
                "summary": f"stuck at SeqNum={seq}; last enqueued {m['enq']}, last completed {m['done']}",
            },
            rank=rank,
        )
    if "watchdog got stuck" in line or "Some NCCL operations have failed or timed out" in line:
        return LineMatch({"category": C.COMM_ERROR, "summary": "NCCL watchdog: operations failed or stuck"}, rank=rank)
    if "NCCL communicator was aborted" in line or "ncclRemoteError" in line:
        return LineMatch({"category": C.PEER_CLOSED, "summary": "NCCL remote error or aborted communicator"}, rank=rank)
    return None


_GLOO_PEER = re.compile(
    r"(?:Connection closed by peer|Read error|Write error|Connection reset by peer) \[?([\w.:-]+?)\]?:\d+"
)
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation to complete")


def parse_gloo(line: str) -> LineMatch | None:
    """ProcessGroupGloo / gloo transport errors: a peer that closed its socket, a recv or send that timed out."""
    if "gloo" not in line.lower():
        return None
    if m := _GLOO_PEER.search(line):
        return LineMatch({"category": C.PEER_CLOSED, "peer": m[1], "summary": f"gloo: connection to {m[1]} lost"})
    if m := _GLOO_TIMEOUT.search(line):
        timeout_ms = _nonneg(m[1])
        return LineMatch(
            {"category": C.COLLECTIVE_TIMEOUT, "timeout_ms": timeout_ms, "summary": f"gloo: {m[2]} timed out"}
        )
    if "connectFullMesh" in line or "Gloo connectFullMesh failed" in line:
        return LineMatch({"category": C.COMM_INIT_FAILURE, "summary": "gloo: could not connect the full mesh"})
    return None


# Some launchers stamp each line (`[2025-07-21 19:05:29] host:pid:tid [dev] ...`): the stamp is read for the time.
_NCCL_DEBUG = re.compile(
    r"^(?:\[\d{4}-\d{2}-\d{2}[ T][\d:.]+\] )?(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:(?P<where>[\w./-]+):\d+ )?NCCL (?P<level>WARN|INFO|TRACE) ?(?P<msg>.*)$"
)
NVLS_SETUP_FAILED = (
    "NVLink SHARP (NVLS) multicast setup failed: the node or container cannot use multicast (NCCL_NVLS_ENABLE)"
)
"""NCCL's NVLS transport refused by CUDA: the fabric manager / IMEX setup or the container's view of it, not the
job's code; the line names no rank (the file or prefix does)."""
_IB_COMPLETION = re.compile(r"Got completion from peer ([\w.:%-]+?)<\d*> with (?:error |status=?)(?:\w+\()?(\d+)")
_REMOTE_PEER = re.compile(r"(?:Connection closed by remote peer|Connection reset by peer)\s*([\w.:-]+?)(?:<\d+>|$)")
_LOCAL_INTERFACE = re.compile(r"NET/Socket : Using \[\d+\](?:docker\d|lo|virbr\d|veth\w*):")
"""NCCL's sockets on an interface that only reaches the host itself: the other nodes cannot connect back."""
_IB_RETRY_EXCEEDED = 12
"""IBV_WC_RETRY_EXC_ERR: the transport retry counter ran out: the peer or the path to it is gone."""


def parse_nccl_debug(line: str) -> LineMatch | None:
    """NCCL debug lines: `host:pid:tid [dev] NCCL WARN ...` (and INFO, kept as raw context)."""
    m = _NCCL_DEBUG.search(line.lstrip())
    if m is None:
        return None
    node, pid, msg = m["host"], _nonneg(m["pid"]), m["msg"]
    base: dict[str, Any] = {"pid": pid, "gpu": m["dev"]}
    if m["level"] != "WARN":
        if _LOCAL_INTERFACE.search(msg):
            return LineMatch(base | {"category": C.CONFIG_MISMATCH, "summary": msg[:200]}, node=node)
        return LineMatch(base | {"category": C.RAW, "summary": f"NCCL {m['level']}"}, node=node)
    if ib := _IB_COMPLETION.search(msg):
        code = int(ib[2])
        category = C.RETRY_EXCEEDED if code == _IB_RETRY_EXCEEDED else C.COMM_ERROR
        return LineMatch(base | {"category": category, "peer": ib[1], "summary": f"IB completion error {code}"}, node)
    if peer := _REMOTE_PEER.search(msg):
        return LineMatch(base | {"category": C.PEER_CLOSED, "peer": peer[1] or None, "summary": msg[:200]}, node)
    if (m["where"] or "").endswith("nvls.cc") and "Cuda failure" in msg:
        return LineMatch(base | {"category": C.CONFIG_MISMATCH, "summary": f"{NVLS_SETUP_FAILED}: {msg}"[:200]}, node)
    if known := parse_known_messages(msg):
        return LineMatch(base | known.fields, node, known.rank)
    if "Cuda failure" in msg and "out of memory" in msg:
        return LineMatch(base | {"category": C.CUDA_OOM, "summary": msg[:200]}, node)
    if "Cuda failure" in msg:
        return LineMatch(base | {"category": C.CUDA_ERROR, "summary": msg[:200]}, node)
    if "bootstrap" in msg.lower() or "init" in msg.lower():
        return LineMatch(base | {"category": C.COMM_INIT_FAILURE, "summary": msg[:200]}, node)
    return LineMatch(base | {"category": C.COMM_ERROR, "summary": msg[:200]}, node)


_CUDA_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError")
_CUDA_ERROR = re.compile(r"CUDA error: (?P<what>[^.\n]+)|illegal memory access|device-side assert triggered")


def parse_cuda(line: str) -> LineMatch | None:
    """CUDA errors outside a traceback: out of memory, illegal memory access, device-side asserts."""
    if _CUDA_OOM.search(line):
        return LineMatch({"category": C.CUDA_OOM, "summary": "CUDA out of memory"})
    if m := _CUDA_ERROR.search(line):
        return LineMatch({"category": C.CUDA_ERROR, "summary": f"CUDA error: {m['what'] or m[0]}"})
    return None


_KERNEL_HOST = re.compile(r"^(?:\S+\s+)?(?:[A-Z][a-z]{2} {1,2}\d{1,2} [\d:.]+ )?(?P<host>[\w.-]+) kernel: ")
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>\d+),?\s*(?P<rest>.*)")
_OOM_KILL = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+) \(([^)]*)\)")
_XID_PID = re.compile(r"pid=(\d+)\b")
_OOM_KILL_TASK = re.compile(r"oom-kill:.*?task=([^,]+),pid=(\d+)")
_LINK = re.compile(r"(?P<iface>[\w.:-]+): (?:NIC )?Link (?:is )?(?P<state>[Dd]own|[Uu]p)\b")
_PORT_ERROR_WORDS = ("symbol error", "link error recovery", "port_rcv_errors", "link_downed")
_IFACE = re.compile(r"([\w.:-]+): ")
_EDAC = re.compile(r"EDAC .*?(?:CE|UE) .*error")
_DRIVER_MODULE_MISMATCH = re.compile(r"NVRM: API mismatch|Driver/library version mismatch")
# The host's own driver install is inconsistent (the host lane, see `lane_of`), unlike an image's CUDA that is
# newer than the host's driver (CUDA error 803 / insufficient driver: the platform's).


def parse_kernel(line: str) -> LineMatch | None:
    """Kernel lines (dmesg, journal, syslog): NVRM Xid, the OOM killer, NIC link changes, ECC, disk full."""
    node = m["host"] if " kernel: " in line and (m := _KERNEL_HOST.search(line)) else None
    if _DRIVER_MODULE_MISMATCH.search(line):
        return LineMatch({"category": C.CONFIG_MISMATCH, "summary": DRIVER_MODULE_MISMATCH}, node)
    if m := _XID.search(line):
        xid = int(m["xid"])
        category = (
            C.ECC_ERROR
            if xid in _ECC_XIDS
            else C.CUDA_ERROR
            if xid in _APPLICATION_XIDS
            else C.RAW
            if xid in _AFTERMATH_XIDS
            else C.GPU_XID
        )
        rest = m["rest"].strip()
        found: dict[str, Any] = {
            "category": category,
            "xid": xid,
            "gpu": m["pci"],
            "summary": f"Xid {xid}: {rest}"[:200],
        }
        # The driver names the process on the GPU when it knows it (`pid=4242, name=python`), else `pid='<unknown>'`.
        if pid := _XID_PID.match(rest):
            found["pid"] = int(pid[1])
        return LineMatch(found, node)
    if m := _OOM_KILL.search(line):
        return LineMatch(
            {"category": C.OOM_KILL, "pid": int(m[1]), "summary": f"OOM killer killed {m[2]} ({m[1]})"}, node
        )
    if m := _OOM_KILL_TASK.search(line):
        return LineMatch({"category": C.OOM_KILL, "pid": int(m[2]), "summary": f"OOM killer killed {m[1]}"}, node)
    if "No space left on device" in line and _SHM not in line:
        return LineMatch({"category": C.DISK_FULL, "summary": "no space left on device"}, node)
    if _EDAC.search(line):
        return LineMatch({"category": C.ECC_ERROR, "summary": "host memory ECC error"}, node)
    if m := _LINK.search(line):
        down = m["state"].lower() == "down"
        category = C.LINK_DOWN if down else C.LINK_UP
        return LineMatch(
            {"category": category, "interface": m["iface"], "summary": f"{m['iface']} link {m['state']}"}, node
        )
    if any(word in line for word in _PORT_ERROR_WORDS):
        iface = m[1] if (m := _IFACE.search(line.rsplit(" kernel: ", maxsplit=1)[-1])) else None
        return LineMatch({"category": C.PORT_ERRORS, "interface": iface, "summary": line.strip()[:200]}, node)
    return None


_SLURM_CANCEL = re.compile(r"\*\*\* (?:STEP|JOB) [\w.]+ ON (?P<host>[\w.-]+) CANCELLED AT \S+ DUE TO (?P<why>[A-Z ]+)")
_CLOCK = re.compile(r"(?:System clock wrong by|clock offset[:=]?) ?(-?\d+(?:\.\d+)?) ?(ms|s|seconds)?", re.IGNORECASE)
_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_DEEPSPEED_EXIT = re.compile(r"--local_rank=(\d+)'?\].*?exits with return code = (-?\d+)")
_SRUN_TASK = re.compile(r"srun: error: (?P<host>[\w.-]+): tasks? (?P<tasks>[\d,-]+): (?P<what>.+)$")
_SRUN_CODE = re.compile(r"Exited with exit code (\d+)")
_SRUN_SIGNAL = {"Segmentation fault": 11, "Aborted": 6, "Bus error": 7}
_NODE_FAILURE = re.compile(r"(?:srun: error: Node failure on|NODE_FAIL\W+(?:on )?)\s*(?P<host>[\w.-]+)")
_STEP_OOM = re.compile(r"Detected (\d+) oom.kill events? in (?:StepId=)?([\w.]+)")
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: Killed")
_WORKER_GONE = re.compile(r"DataLoader worker \(pid\(s\) [\d, ]+\) exited unexpectedly")
_SIGNAL_RECEIVED = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")


def parse_platform_and_process(line: str) -> LineMatch | None:
    """Scheduler preemption, clock offsets, and torchrun's one-line process exit reports."""
    if m := _SLURM_CANCEL.search(line):
        category = C.PREEMPTION
        return LineMatch({"category": category, "summary": f"cancelled due to {m['why'].strip().lower()}"}, m["host"])
    if "version mismatch" in line.lower() or "NCCL version mismatch" in line:
        return LineMatch({"category": C.CONFIG_MISMATCH, "summary": line.strip()[:200]})
    if m := _CLOCK.search(line):
        value = float(m[1])
        offset_ms = value if (m[2] or "s") == "ms" else value * 1000
        return LineMatch(
            {"category": C.CLOCK_OFFSET, "offset_ms": offset_ms, "summary": f"clock offset {offset_ms} ms"}
        )
    if m := _EXIT.search(line):
        fields = _exit_fields(int(m[1]), _nonneg(m[3])) | {"summary": f"local_rank {m[2]} failed ({m[1]})"}
        return LineMatch(fields, local_rank=int(m[2]))
    if m := _DEEPSPEED_EXIT.search(line):
        code = int(m[2])
        fields = _exit_fields(code, None) | {"summary": f"local_rank {m[1]} exited ({code})"}
        return LineMatch(fields, local_rank=int(m[1]))
    if found := _parse_slurm(line):
        return found
    if m := _WORKER_KILLED.search(line):
        # SIGKILL from outside the job: the kernel's OOM killer, most often (its own log says for sure).
        return LineMatch({"category": C.PROCESS_EXITED, "signal": 9, "pid": _nonneg(m[1]), "summary": m[0]})
    if _WORKER_GONE.search(line):
        # The main process noticing a worker's death: how the worker died says why.
        return LineMatch({"category": C.PROCESS_EXITED, "summary": "a DataLoader worker exited unexpectedly"})
    if m := _SIGNAL_RECEIVED.search(line):
        return LineMatch(
            {"category": C.PROCESS_EXITED, "signal": _signal(int(m[1])), "pid": _nonneg(m[3]), "summary": m[0]}
        )
    return None


def _parse_slurm(line: str) -> LineMatch | None:
    """Slurm: srun's per-task exit lines, a lost node, slurmstepd's OOM-kill count."""
    if m := _SRUN_TASK.search(line):
        tasks, what = m["tasks"], m["what"].strip()
        rank = int(tasks) if tasks.isdigit() else None
        summary = f"srun: task{'s' if rank is None else ''} {tasks} on {m['host']}: {what}"[:200]
        fields: dict[str, Any] = {"category": C.PROCESS_EXITED, "summary": summary}
        if what == "Out Of Memory":
            fields["category"] = C.OOM_KILL
        elif code := _SRUN_CODE.search(what):
            fields["exit_code"] = int(code[1])
        elif what in _SRUN_SIGNAL:
            fields["signal"] = _SRUN_SIGNAL[what]
        # "Killed" / "Terminated": srun stopping the other tasks after one failed, a consequence.
        return LineMatch(fields, m["host"], rank)
    if m := _NODE_FAILURE.search(line):
        return LineMatch({"category": C.NODE_LOST, "summary": f"scheduler lost node {m['host']}"}, m["host"])
    if m := _STEP_OOM.search(line):
        return LineMatch({"category": C.OOM_KILL, "summary": f"{m[1]} OOM kill(s) in step {m[2]}"})
    return None


@dataclass(frozen=True)
class _Family:
    pattern: re.Pattern[str]
    category: EvidenceCategory
    summary: str
    first_named_rank: bool = False
    """The rank a message names first is the one it is about (collective mismatch: `Rank 3 is running ...`)."""


_FAMILIES: tuple[_Family, ...] = (
    _Family(re.compile(r"uncorrectable ECC error", re.IGNORECASE), C.ECC_ERROR, "uncorrectable ECC error on the GPU"),
    _Family(
        re.compile(r"(?:VGA|3D) controller: NVIDIA.*\(rev ff\)"), C.GPU_XID, "GPU fell off the bus (lspci: rev ff)"
    ),
    _Family(
        re.compile(r"GPU has fallen off the bus|GPU is lost|Unable to determine the device handle for GPU"),
        C.GPU_XID,
        "GPU lost (fell off the bus)",
    ),
    _Family(re.compile(r"Duplicate GPU detected"), C.CONFIG_MISMATCH, "two ranks on one GPU (Duplicate GPU detected)"),
    _Family(
        re.compile(r"no socket interface found|NET/Socket : no interface found|No usable listening interface"),
        C.CONFIG_MISMATCH,
        "NCCL found no usable network interface (NCCL_SOCKET_IFNAME)",
    ),
    _Family(
        re.compile(r"Cuda failure '(?:invalid argument|operation not supported|operation not permitted)"),
        C.CONFIG_MISMATCH,
        "NCCL CUDA call refused by the runtime environment (container IPC / shm / driver)",
    ),
    _Family(
        re.compile(r"unsupported display driver / cuda driver combination|cudaErrorSystemDriverMismatch"),
        C.CONFIG_MISMATCH,
        "the CUDA runtime the job ships does not match the node's driver (CUDA error 803)",
    ),
    _Family(
        # EI0006 (socket) and EI0002 (notify wait): this rank waited on a remote rank that never came.
        re.compile(r"\bEI000[26]\b|Remote Rank did not send|Notify register times out"),
        C.COLLECTIVE_TIMEOUT,
        "HCCL: timed out waiting on a remote rank (EI0006 / EI0002)",
    ),
    _Family(
        re.compile(r"CUDA driver version is insufficient|cudaErrorInsufficientDriver|NCCL version mismatch"),
        C.CONFIG_MISMATCH,
        "driver or library version mismatch",
    ),
    _Family(
        re.compile(
            r"Caught signal 7 \(Bus error|Bus error \(core dumped\)|insufficient shared memory|"
            r"shared memory segment|/dev/shm\b|unexpected bus error"
        ),
        C.RESOURCE_EXHAUSTED,
        "bus error: shared memory (/dev/shm) too small",
    ),
    _Family(
        re.compile(r"DataLoader worker \(pid \d+\) is killed by signal: Bus error"),
        C.RESOURCE_EXHAUSTED,
        "a DataLoader worker died of a bus error: shared memory (/dev/shm) too small",
    ),
    _Family(
        re.compile(r"EJ0001|last training process is running"),
        C.RESOURCE_EXHAUSTED,
        "devices still held by an earlier training process (HCCL EJ0001)",
    ),
    _Family(re.compile(r"Too many open files"), C.RESOURCE_EXHAUSTED, "out of file descriptors"),
    _Family(
        re.compile(r"Cannot provide a placement group|creating a placement group of specs"),
        C.RESOURCE_EXHAUSTED,
        "the Ray cluster has not enough free GPUs for the placement group",
    ),
    _Family(
        re.compile(
            r"Rendezvous(?:Connection|Timeout|Closed)Error|client socket has (?:timed out after|failed to connect)|"
            r"server socket has failed to (?:bind|listen)|Address already in use"
        ),
        C.RENDEZVOUS_FAILURE,
        "c10d rendezvous / store unreachable",
    ),
    _Family(
        re.compile(r"Detected mismatch between collectives"),
        C.COLLECTIVE_MISMATCH,
        "ranks called different collectives",
        first_named_rank=True,
    ),
    _Family(
        re.compile(r"Message truncated ?: received \d+ bytes instead of \d+"),
        C.COLLECTIVE_MISMATCH,
        "ranks called a collective with different sizes (message truncated)",
    ),
    _Family(
        re.compile(
            r"returned nan values|[Ll]oss (?:is|became|=) ?(?:nan|NaN|inf)\b|found NaN|NaN or Inf found|"
            r"[Nn]a[Nn] detected|Detected (?:NaN|nan)|non-finite loss",
        ),
        C.NUMERIC_ANOMALY,
        "NaN / Inf in the loss or gradients",
        first_named_rank=True,
    ),
    _Family(
        re.compile(r"number of nan iterations:\s*[1-9]|lm loss: nan\b|loss scale already at minimum"),
        C.NUMERIC_ANOMALY,
        "NaN / overflowing loss (the loss scale collapsed or NaN iterations counted)",
    ),
    _Family(
        re.compile(r"actor is dead because its node has died|node was terminated unexpectedly"),
        C.NODE_LOST,
        "the worker's node died (Ray lost it)",
    ),
    _Family(
        re.compile(r"\bEvicted\b.*low on resource|The node was low on resource"),
        C.PREEMPTION,
        "the pod was evicted by the kubelet (node low on a resource)",
    ),
    _Family(
        re.compile(r"NET/Socket : Using \[\d+\](?:docker\d|lo|virbr\d|veth\w*):"),
        C.CONFIG_MISMATCH,
        "NCCL uses a host-local interface (docker0 / lo) for inter-node sockets (NCCL_SOCKET_IFNAME)",
    ),
    _Family(
        re.compile(r"socketStartConnect|Connect to \S+ failed|Failed to execute operation Connect|operation=Connect"),
        C.CONNECT_FAILED,
        "could not connect to a peer",
    ),
)
_PID_FIELD = re.compile(r"\[PID: (\d{1,9})\]")
_CONNECT_PEER = re.compile(r"Connect to ([\w.:%-]+?)(?:<\d+>|\s)")
_NAMED_RANK = re.compile(r"(?<![\w.])(?:[Rr]ank|RANK)[ :=]\s?(\d{1,7})\b")


def parse_known_messages(line: str) -> LineMatch | None:
    """Messages that say what failed wherever they appear: a NCCL WARN, an exception, a launcher's line."""
    if ib := _IB_COMPLETION.search(line):
        code = int(ib[2])
        category = C.RETRY_EXCEEDED if code == _IB_RETRY_EXCEEDED else C.COMM_ERROR
        return LineMatch({"category": category, "peer": ib[1], "summary": f"IB completion error {code}"})
    for family in _FAMILIES:
        if family.pattern.search(line):
            fields: dict[str, Any] = {"category": family.category, "summary": family.summary}
            if family.category is C.CONNECT_FAILED and (peer := _CONNECT_PEER.search(line)):
                fields["peer"] = peer[1]
            if pid := _PID_FIELD.search(line):
                fields["pid"] = _nonneg(pid[1])
            named = _NAMED_RANK.findall(line)
            rank = int(named[0]) if named and (family.first_named_rank or len(set(named)) == 1) else None
            node = m["host"] if " kernel: " in line and (m := _KERNEL_HOST.search(line)) else None
            return LineMatch(fields, node, rank)
    return None


_COMM_FAILURE = re.compile(r"watchdog thread terminated with exception|\bNCCL error\b")


def parse_comm_failure(line: str) -> LineMatch | None:
    """A communicator that failed for a reason the line does not name (the cause is elsewhere): a consequence."""
    if _COMM_FAILURE.search(line):
        return LineMatch({"category": C.COMM_ERROR, "summary": line.strip()[:200]})
    return None


LINE_PARSERS: tuple[Callable[[str], LineMatch | None], ...] = (
    parse_nccl_watchdog,
    parse_gloo,
    parse_nccl_debug,
    parse_kernel,
    parse_platform_and_process,
    parse_known_messages,
    parse_cuda,
    parse_comm_failure,
)
"""One-line parsers, most specific first; the first that recognises a line decides."""


def _nonneg(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 0 else None


def _signal(number: int) -> int | None:
    return number if number >= 1 else None


def _exit_fields(code: int, pid: int | None) -> dict[str, Any]:
    # torchelastic writes a death by signal N as exit code -N.
    if code < 0:
        return {"category": C.PROCESS_EXITED, "signal": _signal(-code), "exit_code": None, "pid": pid}
    return {"category": C.PROCESS_EXITED, "exit_code": code, "pid": pid}


def classify_exception(error_type: str, message: str) -> EvidenceCategory:
    """The category of a Python exception, from its class and message."""
    text = f"{error_type}: {message}"
    if _CUDA_OOM.search(text):
        return C.CUDA_OOM
    if _CUDA_ERROR.search(text):
        return C.CUDA_ERROR
    lowered = text.lower()
    if error_type.startswith("nccl"):
        return C.COMM_ERROR  # ncclSystemError & co. wrap the "Last error:" line that follows: that one says what
    if "diststoreerror" in lowered or "rendezvous" in lowered or "waiting for clients" in lowered:
        return C.COMM_INIT_FAILURE
    if "gloo" in lowered and ("closed by peer" in lowered or "reset by peer" in lowered):
        return C.PEER_CLOSED
    if "distbackenderror" in lowered or "nccl error" in lowered or "watchdog" in lowered or "timed out" in lowered:
        return C.COMM_ERROR
    return C.PYTHON_EXCEPTION


def _exception_fields(error_type: str, message: str, text: str) -> dict[str, Any]:
    # An exception that wraps a known line (a gloo peer error, a CUDA error) keeps that line's fields.
    summary = f"{error_type}: {message}"[:300]
    for parser in LINE_PARSERS:
        match = parser(text)
        if match is not None and match.fields["category"] is not C.RAW:
            return match.fields | {"error_type": error_type, "summary": summary}
    return {"category": classify_exception(error_type, message), "error_type": error_type, "summary": summary}


# --- multi-line state: tracebacks and the torchelastic summary ----------------------------------

_TRACEBACK_START = "Traceback (most recent call last):"
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit|Interrupt|Failure|Warning))(?::\s?(?P<msg>.*))?$"
)
_ELASTIC_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*$")
_ELASTIC_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s*(.*)$")
_ELASTIC_RANK = re.compile(r"(\d+)")


_HEAD_LINES = 8
"""Lines of an unterminated traceback kept as its evidence (its start)."""
_MAX_ENTRY_LINES = 16
"""Lines kept of one torchelastic failure entry (it has a header and six fields)."""


@dataclass
class _Traceback:
    """An open traceback: only what its evidence will hold, so one that never ends keeps a bounded part."""

    rank: int | None
    first: str
    time: datetime | None = None
    node: str | None = None
    head: list[str] = field(default_factory=list)
    frames: deque[str] = field(default_factory=lambda: deque(maxlen=_MAX_FRAMES))
    """The last `File ...` lines after the first line."""
    last: str = ""

    def __post_init__(self) -> None:
        self.head.append(self.first)
        self.last = self.first

    def add(self, line: str) -> None:
        if len(self.head) < _HEAD_LINES:
            self.head.append(line)
        if split_prefixes(line)[1].lstrip().startswith("File "):
            self.frames.append(line)
        self.last = line


_LOCAL_RANKS = re.compile(r"\blocal_ranks=\[([\d, ]*)\]")
_GLOBAL_RANKS = re.compile(r"\bglobal_ranks=\[([\d, ]*)\]")
_NPROC = re.compile(r"\bnproc_per_node\s*[:=]\s*(\d{1,5})\b")
_NODE_RANK = re.compile(r"\b(?:node_rank|NODE_RANK|group_rank)\s*[:=]\s*(\d{1,6})\b")
_NNODES = re.compile(r"\b(?:nnodes|NNODES|group_world_size|max_nodes)\s*[:=]\s*(\d{1,6})\b")
_ELASTIC_RANK_LOCAL = re.compile(r"^\s*rank\s*:\s*(\d{1,7})\s*\(local_rank:\s*(\d{1,5})\)")
_HCCL_PID_RANK = re.compile(r"HCCL\((\d{1,9}),.*?RankID:\s?(\d{1,7})")
_ANNOUNCED_RANK = re.compile(r"\[rank=(\d{1,7}), world_size=\d+\]")


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d{1,7}", text)]


@dataclass
class RankMap:
    """What a launcher's log says about numbering: local ranks to global ones, workers to their ranks."""

    local_ranks: list[int] = field(default_factory=list)
    global_ranks: list[int] = field(default_factory=list)
    nproc_per_node: int | None = None
    node_rank: int | None = None
    nnodes: int | None = None
    worker_ranks: dict[str, int] = field(default_factory=dict)
    known: dict[int, int] = field(default_factory=dict)
    """Local rank -> rank as torchelastic's failure summary pairs them (`rank: 3 (local_rank: 1)`)."""
    pid_ranks: dict[int, int] = field(default_factory=dict)
    """Process id -> rank, where a line pairs them (HCCL's `HCCL(pid,...)` with `RankID:N`)."""

    def learn(self, line: str, prefixes: Prefixes) -> None:
        """Take in what this line says about numbering (torchrun's launch config and rendezvous result)."""
        if m := _LOCAL_RANKS.search(line):
            self.local_ranks = _ints(m[1])
        if m := _GLOBAL_RANKS.search(line):
            self.global_ranks = _ints(m[1])
        if m := _ELASTIC_RANK_LOCAL.search(line):
            self.known[int(m[2])] = int(m[1])
        if m := _HCCL_PID_RANK.search(line):
            self.pid_ranks.setdefault(int(m[1]), int(m[2]))
        if m := _NPROC.search(line):
            self.nproc_per_node = int(m[1])
        if m := _NODE_RANK.search(line):
            self.node_rank = int(m[1])
        if m := _NNODES.search(line):
            self.nnodes = max(int(m[1]), self.nnodes or 0)
        if prefixes.worker is not None and prefixes.rank is None and (m := _ANNOUNCED_RANK.search(line)):
            self.worker_ranks.setdefault(prefixes.worker, int(m[1]))

    def global_rank(self, local: int) -> int | None:
        """The global rank of a local rank on this log's node, when the log allows it."""
        if len(self.local_ranks) == len(self.global_ranks) and local in self.local_ranks:
            return self.global_ranks[self.local_ranks.index(local)]
        if local in self.known:
            return self.known[local]
        if self.node_rank is not None and self.nproc_per_node:
            return self.node_rank * self.nproc_per_node + local
        if self.nnodes in {None, 1} and self.node_rank in {None, 0}:
            return local  # one node (nothing says otherwise): local rank = rank
        return None

    def rank_of(self, prefixes: Prefixes, local: int | None = None) -> int | None:
        """The rank a line's prefixes (or a local rank it names) stand for."""
        if prefixes.rank is not None:
            return prefixes.rank
        if prefixes.worker is not None and prefixes.worker in self.worker_ranks:
            return self.worker_ranks[prefixes.worker]
        local = prefixes.local_rank if local is None else local
        return None if local is None else self.global_rank(local)


@dataclass
class _ElasticEntry:
    root_cause: bool
    fields: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


class LogParser:
    """Feeds lines of one source, keeping the state that multi-line formats need."""

    def __init__(self, context: SourceContext) -> None:
        self.context = context
        self.ranks = RankMap()
        self._last_time: datetime | None = None
        self._tracebacks: dict[int | None, _Traceback] = {}
        self._elastic: _ElasticEntry | None = None
        self._in_elastic = False
        self._root_cause_block = False

    def feed(self, raw_line: str) -> list[Evidence]:
        """The evidence this line completes (often none while a traceback or a summary is being read)."""
        line = _clean(raw_line)
        if not line.strip():
            return []
        try:
            prefixes, body = split_prefixes(line)
            self.ranks.learn(body, prefixes)
            return self._feed(line, prefixes, body)
        except (ValueError, OverflowError):
            # A date like 2026-02-31 or a number beyond range: the line is still evidence, just unparsed.
            return [self._evidence({"category": C.RAW}, [line], None, None, None)]

    def finish(self) -> list[Evidence]:
        """Evidence still held in open multi-line blocks at the end of the input."""
        found: list[Evidence] = []
        for rank in list(self._tracebacks):
            found.extend(self._close_traceback(rank))
        found.extend(self._close_elastic_entry())
        return found

    def learn(self, raw_line: str) -> None:
        """Read a line for numbering only (a batch reads the whole log first: the order of lines then matters less)."""
        with contextlib.suppress(ValueError, OverflowError):
            line = _clean(raw_line)
            prefixes, body = split_prefixes(line)
            self.ranks.learn(body, prefixes)

    def _feed(self, line: str, prefixes: Prefixes, body: str) -> list[Evidence]:
        rank = self.ranks.rank_of(prefixes)
        moment = parse_time(body, self.context.year, self.context.tz)
        if moment is not None:
            self._last_time = moment
        found: list[Evidence] = []
        if self._in_elastic or "Root Cause (first observed failure)" in body or body.strip() == "Failures:":
            consumed, elastic = self._elastic_line(body)
            found.extend(elastic)
            if consumed:
                return found
        open_tb = self._tracebacks.get(rank)
        if _TRACEBACK_START in body:
            found.extend(self._close_traceback(rank))
            self._tracebacks[rank] = _Traceback(rank, line, moment or self._last_time, prefixes.node)
            return found
        if open_tb is not None:
            stripped = body.rstrip()
            # Without a prefix, `split_prefixes` took the line's indent with its leading whitespace: look at the line.
            indented = stripped.startswith((" ", "\t", "^", "~")) or (
                body == line.lstrip() and line.startswith((" ", "\t"))
            )
            if not stripped or indented:
                open_tb.add(line)
                return found
            if _EXCEPTION_LINE.match(stripped.strip()):
                open_tb.add(line)
                found.extend(self._close_traceback(rank))
                return found
            found.extend(self._close_traceback(rank))
        found.extend(self._one_line(line, body, (prefixes.node, rank), moment))
        return found

    def _one_line(
        self, line: str, body: str, where: tuple[str | None, int | None], moment: datetime | None
    ) -> list[Evidence]:
        node, rank = where
        for parser in LINE_PARSERS:
            match = parser(body)
            if match is not None:
                chosen_rank = rank if rank is not None else match.rank
                if chosen_rank is None and match.local_rank is not None:
                    chosen_rank = self.ranks.global_rank(match.local_rank)
                if chosen_rank is None and (pid := match.fields.get("pid")) is not None:
                    chosen_rank = self.ranks.pid_ranks.get(pid)
                return [self._evidence(match.fields, [line], match.node or node, chosen_rank, match.time or moment)]
        if (m := _EXCEPTION_LINE.match(body.strip())) and "ChildFailedError" not in m["type"]:
            fields = _exception_fields(m["type"], m["msg"] or "", body)
            return [self._evidence(fields, [line], node, rank, moment)]
        return [self._evidence({"category": C.RAW}, [line], node, rank, moment)]

    def _close_traceback(self, rank: int | None) -> list[Evidence]:
        tb = self._tracebacks.pop(rank, None)
        if tb is None:
            return []
        last = split_prefixes(tb.last)[1].strip()
        m = _EXCEPTION_LINE.match(last)
        if m is None:
            return [
                self._evidence(
                    {"category": C.RAW, "summary": "unterminated traceback"}, tb.head, tb.node, rank, tb.time
                )
            ]
        if "ChildFailedError" in m["type"]:
            return []  # the summary block that follows says what failed, rank by rank
        # An exception line is never a `File ...` line: the frames are those before it.
        lines = [tb.first, *tb.frames, tb.last]
        fields = _exception_fields(m["type"], m["msg"] or "", last)
        return [self._evidence(fields, lines, tb.node, rank, tb.time)]

    def _elastic_line(self, body: str) -> tuple[bool, list[Evidence]]:
        """Read the ChildFailedError summary; returns whether the line belonged to it."""
        text = body.strip()
        if text == "Failures:" or "Root Cause (first observed failure)" in text:
            found = self._close_elastic_entry()
            self._in_elastic = True
            self._root_cause_block = "Root Cause" in text
            return True, found
        if not self._in_elastic:
            return False, []
        if m := _ELASTIC_ENTRY.match(text):
            found = self._close_elastic_entry()
            self._elastic = _ElasticEntry(self._root_cause_block, lines=[body])
            return True, found
        if self._elastic is not None and (m := _ELASTIC_FIELD.match(text)):
            self._elastic.fields[m[1]] = m[2].strip()
            if len(self._elastic.lines) < _MAX_ENTRY_LINES:  # a field repeated without end adds nothing new
                self._elastic.lines.append(body)
            return True, []
        if text and set(text) <= {"=", "-"}:
            found = self._close_elastic_entry()
            # "-----" separates entries and blocks; "=====" ends the summary.
            self._in_elastic = set(text) == {"-"}
            return True, found
        if text.startswith("<NO_OTHER_FAILURES>"):
            return True, []
        found = self._close_elastic_entry()
        self._in_elastic = False
        return False, found

    def _close_elastic_entry(self) -> list[Evidence]:
        entry, self._elastic = self._elastic, None
        if entry is None or "exitcode" not in entry.fields:
            return []
        values = entry.fields
        code_text = values["exitcode"].split()[0] if values["exitcode"].split() else ""
        pid_match = re.search(r"pid:\s*(\d+)", values["exitcode"])
        pid = _nonneg(pid_match[1]) if pid_match else None
        code = int(code_text) if re.fullmatch(r"-?\d{1,6}", code_text) else None
        fields: dict[str, Any] = {"category": C.PROCESS_EXITED, "pid": pid}
        if code is not None:
            fields |= _exit_fields(code, pid)
        rank_match = _ELASTIC_RANK.search(values.get("rank", ""))
        rank = int(rank_match[1]) if rank_match else None
        prefix = "root cause (first observed failure)" if entry.root_cause else "failure"
        fields["summary"] = f"torchelastic {prefix}: rank {rank} exitcode {code_text} {values.get('traceback', '')}"[
            :300
        ]
        if (tb := values.get("traceback", "")) and (sig := re.search(r"\((SIG\w+)\)", tb)) and sig[1] in _SIGNALS:
            fields["signal"] = _SIGNALS[sig[1]]
            fields["exit_code"] = None
        moment = parse_time(values.get("time", ""), self.context.year, self.context.tz)
        host = values.get("host") or None
        node = host if host and re.fullmatch(r"[\w.-]{1,128}", host) else None
        return [self._evidence(fields, entry.lines, node, rank, moment)]

    def _evidence(
        self,
        fields: dict[str, Any],
        lines: list[str],
        node: str | None,
        rank: int | None,
        moment: datetime | None,
    ) -> Evidence:
        data = EvidenceData(
            lines=tuple(line[:MAX_LINE] for line in lines),
            origin=self.context.origin[:256],
            **{k: v for k, v in fields.items() if v is not None},
        )
        if rank is None and data.category is not C.RAW:
            named = {int(r) for line in lines for r in _NAMED_RANK.findall(line)}
            rank = named.pop() if len(named) == 1 else None
        return Evidence(
            data=data,
            time=moment or self._last_time,
            node=_node_token(node) or self.context.node,
            rank=rank if rank is not None else self.context.rank,
        )


def _node_token(node: str | None) -> str | None:
    # Node ids become subject tokens: a host name with dots keeps its first label (node-1.cluster -> node-1).
    if not node:
        return None
    if re.fullmatch(r"\d{1,3}(?:\.\d{1,3}){3}", node):
        return node.replace(".", "-")  # an address stands for its host: 10.0.0.3 -> 10-0-0-3
    token = node.split(".", 1)[0]
    return token if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", token) else None


def _clean(line: str) -> str:
    # NUL cannot be stored in PostgreSQL text, and lone surrogates cannot be encoded: replace both.
    text = line[:MAX_LINE].rstrip("\r\n").replace("\x00", "\ufffd")
    return text.encode("utf-8", "replace").decode("utf-8")


def parse_lines(lines: Iterable[str], context: SourceContext) -> list[Evidence]:
    """All evidence in a sequence of lines of one source (read twice: numbering first, then evidence)."""
    parser = LogParser(context)
    every = list(lines)
    for line in every:
        parser.learn(line)
    found: list[Evidence] = []
    for line in every:
        found.extend(parser.feed(line))
    found.extend(parser.finish())
    return found


def parse_text(text: str, context: SourceContext) -> list[Evidence]:
    """All evidence in the text of one source."""
    return parse_lines(text.splitlines(), context)


def parse_bytes(data: bytes, context: SourceContext) -> list[Evidence]:
    """All evidence in raw bytes of one source (invalid UTF-8 is replaced, never fatal)."""
    return parse_text(data.decode("utf-8", "replace"), context)
