"""NCCL RAS reports (`ncclras`, NCCL 2.24 and later) read as evidence: communicators, ranks, op counts, who is missing.

The text report (`ncclras`) has a table of communicator groups (`Group  Comms  Nodes  Ranks ... Status  Errors`),
then an Errors section (processes RAS got no data from, dead processes, per-communicator INCOMPLETE and ERROR
blocks) and a Warnings section (per-communicator MISMATCH blocks: ranks with different status or operation counts).

On a mismatch RAS lists ranks one by one only when they are few (the outliers): with 30 ranks behind and 2 ahead,
it names the 2 ahead and only counts the 30. The ranks that hold everyone up are the ones behind, so they are
derived here from the communicator's size and the ranks listed elsewhere, and each rank's count becomes evidence
the election reads like a watchdog's "last enqueued": the lowest is the laggard.

The JSON report (`ncclras` asked for JSON, in the releases that write it) lists every rank of every communicator
with its per-collective counts and status, and the missing ranks (unresponsive, considered dead): it is read into
the same report, with nothing to derive.

Pure: text in, report and evidence out; a line or field it does not know is skipped, and no input raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from lanes_contract.events import EvidenceCategory, EvidenceData
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import MAX_LINE, SourceContext

C = EvidenceCategory
_TABLE_HEAD = re.compile(r"^Group\s+Comms\s+Nodes\s+Ranks\s+Ranks\s+Ranks\s+Status\s+Errors\s*$", re.MULTILINE)
_TABLE_ROW = re.compile(
    r"^\s*(?P<group>\d{1,6})\s+(?P<comms>\d{1,9})\s+(?P<nodes>\d{1,9})\s+(?P<per_node>\d{1,6}(?:-\d{1,6})?)\s+"
    r"(?P<per_comm>\d{1,9})\s+(?P<in_group>\d{1,9})\s+(?P<status>[A-Z]+)\s+(?P<errors>[A-Z,]+)\s*$"
)
_COMM_HEAD = re.compile(r"^#(?P<group>\d{1,6})-(?P<index>\d{1,9}) \((?P<hash>[0-9a-fA-F]{1,16})\) (?P<kind>[A-Z]+)\s*$")
_DIFFERENT_OPS = re.compile(r"^\s+Communicator ranks have different (?P<op>\w+) operation counts\s*$")
_GROUP_COUNT = re.compile(
    r"^\s+(?P<count>\d{1,9}) ranks have (?:launched up to operation (?P<value>\d{1,19})|not launched any operations)"
)
_RANK = re.compile(
    r"^\s+Rank (?P<rank>\d{1,9})(?: has launched up to operation (?P<value>\d{1,19})| has (?P<none>not) launched any "
    r"operations| has status (?P<status>\w+)| reported (?P<error>[^-]+?))? -- (?:GPU (?P<gpu>\S+) managed by process "
    r"(?P<pid>\d{1,9}) on node (?P<node>\S+)|\[process information not found\])\s*$"
)
_PROCESS = re.compile(r"^\s+Process (?P<pid>\d{1,9}) on node (?P<node>\S+) managing GPUs? (?P<gpu>.+?)\s*$")
_SECTION = re.compile(r"^(?P<name>INCOMPLETE|DEAD|TIMEOUT)\s*$")


@dataclass(frozen=True)
class RasRank:
    """A rank as the report names it, with where it runs when RAS knows."""

    rank: int
    node: str | None = None
    pid: int | None = None
    gpu: str | None = None


@dataclass
class OpCounts:
    """One collective whose operation counts differ across a communicator's ranks."""

    op: str
    groups: list[tuple[int, int, list[RasRank]]] = field(default_factory=list)
    """(operations launched, how many ranks, the ranks the report lists for that count)."""


@dataclass
class Communicator:
    """One communicator the report has a block for (`#group-index (hash) KIND`)."""

    group: int
    index: int
    hash: str
    kinds: set[str] = field(default_factory=set)
    missing: list[RasRank] = field(default_factory=list)
    """Ranks RAS got no data from (INCOMPLETE)."""
    errors: list[tuple[RasRank, str]] = field(default_factory=list)
    mismatched_ops: list[OpCounts] = field(default_factory=list)
    status: dict[str, list[RasRank]] = field(default_factory=dict)


@dataclass
class RasReport:
    """What one `ncclras` text report says."""

    groups: dict[int, dict[str, str]] = field(default_factory=dict)
    """Group number -> the table's row (comms, nodes, per_comm ranks, status, errors)."""
    communicators: dict[tuple[int, int], Communicator] = field(default_factory=dict)
    unreachable: list[RasRank] = field(default_factory=list)
    """Processes RAS got no communicator data from (rank unknown: -1)."""
    dead: list[RasRank] = field(default_factory=list)
    """Processes RAS considers dead (rank unknown: -1)."""

    def comm_size(self, group: int) -> int | None:
        """The number of ranks of each communicator in `group`, from the table."""
        row = self.groups.get(group)
        return int(row["per_comm"]) if row else None

    def members(self, comm: Communicator, op: OpCounts) -> dict[int, int]:
        """Rank -> operations launched, for every rank the report lists or allows to derive.

        RAS lists the ranks of the small groups; when one group alone is unlisted, its ranks are the
        communicator's ranks that no other group lists and that did answer (a rank RAS got no data from is in
        no group).
        """
        counts = {r.rank: value for value, _, ranks in op.groups for r in ranks}
        unlisted = [(value, count) for value, count, ranks in op.groups if len(ranks) < count]
        size = self.comm_size(comm.group)
        if len(unlisted) == 1 and size is not None:
            value, count = unlisted[0]
            rest = set(range(size)) - set(counts) - {r.rank for r in comm.missing}
            if len(rest) == count:
                counts |= dict.fromkeys(rest, value)
        return counts

    def behind(self, comm: Communicator, op: OpCounts) -> list[int]:
        """The ranks that launched the fewest `op` operations (those the report names or allows to derive)."""
        if not op.groups:
            return []
        lowest = min(value for value, _, _ in op.groups)
        return sorted(rank for rank, value in self.members(comm, op).items() if value == lowest)


def is_ras_report(text: str) -> bool:
    """Whether the text is an `ncclras` report: its communicator table's header, or its JSON document."""
    return _TABLE_HEAD.search(text) is not None or _json_report(text) is not None


def _json_report(text: str) -> dict[str, Any] | None:
    if not text.lstrip().startswith("{") or '"communicators"' not in text:
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return None
    if isinstance(document, dict) and isinstance(document.get("communicators"), list):
        return document
    return None


def _int(value: object, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _json_rank(entry: dict[str, Any]) -> RasRank:
    host = entry.get("host")
    pid = _int(entry.get("pid"))
    gpu = entry.get("cuda_dev")
    return RasRank(
        _int(entry.get("rank")),
        host if isinstance(host, str) and host != "unknown" else None,
        pid if pid >= 0 else None,
        str(gpu) if isinstance(gpu, int) else None,
    )


def parse_ras_json(text: str) -> RasReport:
    """The report in an `ncclras` JSON document (each communicator is its own group, numbered in order)."""
    report = RasReport()
    document = _json_report(text) or {}
    for number, raw in enumerate(document.get("communicators", [])):
        if not isinstance(raw, dict):
            continue
        size = _int(raw.get("size"), 0)
        report.groups[number] = {"comms": "1", "nodes": "", "per_comm": str(size), "status": "", "errors": ""}
        comm = Communicator(number, 0, str(raw.get("hash", "")).removeprefix("0x"))
        report.communicators[(number, 0)] = comm
        ranks = [r for r in raw.get("ranks", []) if isinstance(r, dict)]
        by_op: dict[str, dict[int, list[RasRank]]] = {}
        for entry in ranks:
            where = _json_rank(entry)
            counts = entry.get("collective_counts")
            for op, value in counts.items() if isinstance(counts, dict) else ():
                if where.rank >= 0 and _int(value) >= 0:
                    by_op.setdefault(str(op), {}).setdefault(_int(value), []).append(where)
        for op, groups in by_op.items():
            if len(groups) > 1:  # the ranks disagree on how many of this collective they launched
                comm.kinds.add("MISMATCH")
                comm.mismatched_ops.append(OpCounts(op, [(v, len(rs), rs) for v, rs in sorted(groups.items())]))
        for entry in raw.get("missing_ranks", []):
            if not isinstance(entry, dict):
                continue
            where = _json_rank(entry)
            status = entry.get("status")
            dead = isinstance(status, dict) and status.get("considered_dead") is True
            if dead:
                report.dead.append(RasRank(-1, where.node, where.pid, where.gpu))
            if dead or (isinstance(status, dict) and status.get("unresponsive") is True):
                comm.kinds.add("INCOMPLETE")
                comm.missing.append(where)
    return report


def parse_ras(text: str) -> RasReport:
    """The report in an `ncclras` output, text or JSON."""
    return parse_ras_json(text) if _json_report(text) is not None else parse_ras_text(text)


def _rank_of(m: re.Match[str]) -> RasRank:
    return RasRank(int(m["rank"]), m["node"], int(m["pid"]) if m["pid"] else None, m["gpu"])


def parse_ras_text(text: str) -> RasReport:
    """The report in the text of one `ncclras` run."""
    report = RasReport()
    comm: Communicator | None = None
    op: OpCounts | None = None
    section = ""
    in_table = False
    for raw in text.splitlines():
        line = raw[:MAX_LINE].rstrip()
        if _TABLE_HEAD.match(line):
            in_table = True
            continue
        if in_table and (m := _TABLE_ROW.match(line)):
            report.groups[int(m["group"])] = {k: m[k] for k in ("comms", "nodes", "per_comm", "status", "errors")}
            continue
        in_table = in_table and (not line.strip() or line.lstrip().startswith("#"))
        if m := _SECTION.match(line):
            section, comm, op = m["name"], None, None
            continue
        if m := _COMM_HEAD.match(line):
            key = (int(m["group"]), int(m["index"]))
            comm = report.communicators.setdefault(key, Communicator(key[0], key[1], m["hash"]))
            comm.kinds.add(m["kind"])
            section, op = m["kind"], None
            continue
        if m := _PROCESS.match(line):
            where = RasRank(-1, m["node"], int(m["pid"]), m["gpu"])
            if section == "DEAD":
                report.dead.append(where)
            elif section == "INCOMPLETE" and comm is None:
                report.unreachable.append(where)
            continue
        if comm is None:
            continue
        if m := _DIFFERENT_OPS.match(line):
            op = OpCounts(m["op"])
            comm.mismatched_ops.append(op)
            continue
        if op is not None and (m := _GROUP_COUNT.match(line)):
            op.groups.append((int(m["value"] or 0), int(m["count"]), []))
            continue
        if m := _RANK.match(line):
            _read_rank(comm, op, section, m)
    return report


def _read_rank(comm: Communicator, op: OpCounts | None, section: str, m: re.Match[str]) -> None:
    rank = _rank_of(m)
    if op is not None:
        if m["value"] is not None or m["none"]:
            op.groups.append((int(m["value"] or 0), 1, [rank]))  # a lone rank: its own line says its count
        elif op.groups:
            op.groups[-1][2].append(rank)  # listed under the count line before it
    elif section == "INCOMPLETE":
        comm.missing.append(rank)
    elif section == "ERROR" and m["error"]:
        comm.errors.append((rank, m["error"].strip()))
    elif m["status"]:
        comm.status.setdefault(m["status"], []).append(rank)


def ras_evidence(report: RasReport, context: SourceContext) -> list[Evidence]:
    """The report as evidence: each mismatched rank's count, and the ranks and processes RAS could not reach.

    A count reads as the rank's last enqueued collective (the lowest is elected as the laggard); an unreachable
    rank is kept as an unelected line, so that a rank that said nothing stays silent in the election.
    """
    found: list[Evidence] = []

    def add(fields: dict[str, object], line: str, where: RasRank) -> None:
        data = EvidenceData.model_validate({"lines": (line[:MAX_LINE],), "origin": context.origin[:256], **fields})
        rank = where.rank if where.rank >= 0 else None
        found.append(Evidence(data=data, node=_host(where.node) or context.node, rank=rank))

    for comm in report.communicators.values():
        for op in comm.mismatched_ops:
            behind = report.behind(comm, op)
            named = {r.rank: r for _, _, ranks in op.groups for r in ranks}
            values = [value for value, _, _ in op.groups]
            lowest, highest = (min(values), max(values)) if values else (0, 0)
            for rank, value in sorted(report.members(comm, op).items()):
                where = named.get(rank, RasRank(rank))
                state = "behind" if rank in behind else "ahead"
                summary = (
                    f"NCCL RAS: rank {rank} of communicator {comm.hash} launched {value} {op.op} operations "
                    f"({state}; the ranks range from {lowest} to {highest})"
                )
                fields = {"category": C.COLLECTIVE_TIMEOUT, "op_type": op.op.upper(), "last_enqueued": value}
                add(fields | {"summary": summary, "pid": where.pid, "gpu": where.gpu}, summary, where)
        for where in comm.missing:
            summary = f"NCCL RAS: no data from rank {where.rank} of communicator {comm.hash} (process unreachable)"
            add({"category": C.RAW, "summary": summary, "pid": where.pid}, summary, where)
    for where in report.dead:
        summary = f"NCCL RAS: process {where.pid} on {where.node} is dead (unreachable via the RAS network)"
        add({"category": C.RAW, "summary": summary, "pid": where.pid}, summary, where)
    return found


def _host(node: str | None) -> str | None:
    # RAS names a node by its address or host name; a subject token keeps the host's first label.
    if not node:
        return None
    if re.fullmatch(r"\d{1,3}(?:\.\d{1,3}){3}", node):
        return node.replace(".", "-")
    token = node.split(".", 1)[0]
    return token if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", token) else None
