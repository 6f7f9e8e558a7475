"""PyTorch Flight Recorder dumps read as evidence: per rank, the collectives it entered; across ranks, who lags.

A dump is one rank's ring buffer of its last collectives (`entries`: process group, `collective_seq_id`, op as
`profiling_name` such as `gloo:all_reduce`, input/output sizes, `state`, creation time in ns), with per group the
last enqueued / completed sequence ids (`pg_status`) and each group's ranks (`pg_config`). The JSON form is
written by `torch._C._distributed_c10d._dump_fr_trace_json` (and by the watchdog, `TORCH_FR_DUMP_TEMP_FILE`);
the older pickle form holds the same dict and is read by an unpickler that admits no class at all, since a dump
is hostile input like any file a user hands over. The dump does not name its rank: the file name does
(`<prefix><rank>`, e.g. `rank_3.json`, `nccl_trace_rank_3`).

Across ranks, per process group:
- the rank whose highest sequence id is below the others' never entered the collective they wait in;
- the rank whose op or sizes differ from the majority's at a sequence id called something else there;
- a rank the group's size says exists but whose dump is absent is missing evidence, never silently skipped: its
  dump is what would settle whether it entered the collective.

Pure: bytes in, dumps, analysis and evidence out; input outside the bounds raises `FlightRecorderError` with a
one-line message.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lanes_contract.events import EvidenceCategory, EvidenceData
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import MAX_LINE, SourceContext

C = EvidenceCategory

MAX_DUMP_BYTES = 16 * 1024 * 1024
"""A dump of the default 2,000-entry buffer with stack traces is a few MiB; anything far larger is refused."""
MAX_ENTRIES = 100_000
"""Entries in one dump (the ring buffer's size is set by the job; 100,000 is far beyond any used in practice)."""
MAX_DEPTH = 16
"""Nesting of containers: a dump nests 5 levels (dump, entries, entry, sizes, one size)."""
MAX_VALUES = 4_000_000
"""Values (containers and scalars) in one dump: a pickle can repeat one list by reference a million times in a few
bytes each, so the walk is bounded by what it visits, not by the bytes read."""
MAX_RANKS = 1_000_000
"""Largest rank number or world size believed."""

RECORDING = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
"""What a launcher sets (unless its own environment says otherwise) so each rank records its collectives and
dumps them on a watchdog timeout: PyTorch's default buffer of 2,000 entries, a few hundred KiB per rank."""
DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"
"""The variable naming where ranks dump: rank r writes `<prefix>r`."""

SUMMARY_PREFIX = "Flight Recorder: "
"""How every piece of evidence read from a dump begins: what tells it apart from a log's line."""

_RANK_IN_NAME = re.compile(r"(\d{1,7})(?:\.(?:json|pkl|pickle))?$")
_PICKLE_PROTO = b"\x80"


class FlightRecorderError(ValueError):
    """A dump that cannot be read within the bounds; the message is one line naming the file and the reason."""


@dataclass(frozen=True)
class FrEntry:
    """One collective as a rank recorded it."""

    pg: str
    seq: int
    op: str
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    state: str
    time_created_ns: int
    timeout_ms: int | None = None


@dataclass
class FrDump:
    """One rank's dump: its entries, and the group sizes and status the dump states."""

    rank: int
    origin: str
    entries: list[FrEntry] = field(default_factory=list)
    group_sizes: dict[str, int] = field(default_factory=dict)
    last_completed: dict[str, int] = field(default_factory=dict)

    def last_seq(self, pg: str) -> int:
        """The highest collective sequence id this rank entered in the group (0: none recorded)."""
        return max((e.seq for e in self.entries if e.pg == pg), default=0)

    def entry(self, pg: str, seq: int) -> FrEntry | None:
        """This rank's entry for one collective, if its buffer still holds it."""
        return next((e for e in self.entries if e.pg == pg and e.seq == seq), None)


@dataclass(frozen=True)
class Laggard:
    """A rank that never entered collective `waited_on`, which `ahead` other ranks did."""

    pg: str
    rank: int
    last_seq: int
    waited_on: int
    op: str
    ahead: int


@dataclass(frozen=True)
class Divergent:
    """A rank whose op or sizes at `seq` differ from what the majority called there."""

    pg: str
    rank: int
    seq: int
    called: str
    majority: str
    majority_count: int


@dataclass(frozen=True)
class MissingDump:
    """A rank the group's size says exists, whose dump was not handed over."""

    pg: str
    rank: int
    waited_on: int
    """The collective the ranks with dumps last entered: the one this rank's dump would settle."""


@dataclass
class FrAnalysis:
    """The dumps read together."""

    dumps: dict[int, FrDump]
    laggards: list[Laggard] = field(default_factory=list)
    divergent: list[Divergent] = field(default_factory=list)
    missing: list[MissingDump] = field(default_factory=list)


# --- reading one dump ------------------------------------------------------------------------------


class _NoClassUnpickler(pickle.Unpickler):
    """Admits builtin containers and scalars only: any global (class, function) in the stream is refused."""

    def find_class(self, module: str, name: str) -> Any:
        msg = f"the pickle names {module[:64]}.{name[:64]}, and a dump holds no classes"
        raise pickle.UnpicklingError(msg)


def is_flight_recorder_dump(head: bytes) -> bool:
    """Whether a file's head looks like a dump (JSON with `entries` and `pg_status`, or a pickle of one)."""
    if head.startswith(_PICKLE_PROTO):
        return b"entries" in head[:4096]
    start = head.lstrip()[:1]
    return start == b"{" and b'"entries"' in head and (b'"pg_status"' in head or b'"pg_config"' in head)


def rank_of_name(name: str) -> int | None:
    """The rank a dump's file name ends with (`rank_3.json`, `nccl_trace_rank_3`)."""
    m = _RANK_IN_NAME.search(name)
    return int(m[1]) if m and int(m[1]) < MAX_RANKS else None


def _check_shape(value: object, origin: str) -> None:
    """Refuse a decoded dump nested deeper than MAX_DEPTH or holding more than MAX_VALUES values.

    Iterative (no recursion), and it stops at the first bound passed, so a hostile shape costs at most MAX_VALUES
    steps.
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    visited = 0
    while stack:
        item, depth = stack.pop()
        visited += 1
        if visited > MAX_VALUES:
            msg = f"{origin}: dump holds more than {MAX_VALUES} values"
            raise FlightRecorderError(msg)
        if isinstance(item, dict | list | tuple):
            if depth > MAX_DEPTH:
                msg = f"{origin}: dump nests deeper than {MAX_DEPTH} levels"
                raise FlightRecorderError(msg)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def _decode(data: bytes, origin: str) -> dict[str, Any]:
    if len(data) > MAX_DUMP_BYTES:
        msg = f"{origin}: dump is {len(data)} bytes, over the {MAX_DUMP_BYTES}-byte limit"
        raise FlightRecorderError(msg)
    try:
        if data.startswith(_PICKLE_PROTO):
            decoded = _NoClassUnpickler(io.BytesIO(data)).load()
        else:
            decoded = json.loads(data.decode("utf-8"))
    except (pickle.UnpicklingError, ValueError, EOFError, RecursionError, MemoryError) as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        msg = f"{origin}: not a readable Flight Recorder dump ({first})"
        raise FlightRecorderError(msg) from None
    if not isinstance(decoded, dict):
        msg = f"{origin}: not a Flight Recorder dump (top level is {type(decoded).__name__}, not an object)"
        raise FlightRecorderError(msg)
    _check_shape(decoded, origin)
    return decoded


def _int(value: object, default: int = 0) -> int:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        return int(value)
    return default


def _sizes(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(tuple(_int(d) for d in s) for s in value[:64] if isinstance(s, list | tuple))


def _pg_name(entry: dict[str, Any]) -> str:
    # `process_group` is (name, description); the name is what `pg_status` and `pg_config` are keyed by.
    pg = entry.get("process_group")
    if isinstance(pg, list | tuple) and pg and isinstance(pg[0], str):
        return pg[0][:128]
    return str(_int(entry.get("pg_id")))


def parse_dump(data: bytes, *, rank: int, origin: str) -> FrDump:
    """One rank's dump (JSON or pickle form); raises `FlightRecorderError` past the bounds or on a non-dump."""
    decoded = _decode(data, origin)
    raw_entries = decoded.get("entries", [])
    if not isinstance(raw_entries, list):
        msg = f"{origin}: `entries` is {type(raw_entries).__name__}, not a list"
        raise FlightRecorderError(msg)
    if len(raw_entries) > MAX_ENTRIES:
        msg = f"{origin}: {len(raw_entries)} entries, over the {MAX_ENTRIES}-entry limit"
        raise FlightRecorderError(msg)
    dump = FrDump(rank=rank, origin=origin)
    for raw in raw_entries:
        if not isinstance(raw, dict) or raw.get("is_p2p") is True:
            continue  # point-to-point ops have their own numbering (`p2p_seq_id`), not the collectives'
        seq = _int(raw.get("collective_seq_id"), -1)
        if seq < 0:
            continue
        timeout = _int(raw.get("timeout_ms"), -1)
        dump.entries.append(
            FrEntry(
                pg=_pg_name(raw),
                seq=seq,
                op=str(raw.get("profiling_name", ""))[:128],
                input_sizes=_sizes(raw.get("input_sizes")),
                output_sizes=_sizes(raw.get("output_sizes")),
                state=str(raw.get("state", ""))[:32],
                time_created_ns=max(_int(raw.get("time_created_ns")), 0),
                timeout_ms=timeout if timeout >= 0 else None,
            )
        )
    config = decoded.get("pg_config")
    if isinstance(config, dict):
        for name, pg in list(config.items())[:10_000]:
            if isinstance(pg, dict) and isinstance(pg.get("ranks"), str):
                # `ranks` is a list written as a string ("[0, 1, 2, 3]"): its count is the group's size.
                size = len(re.findall(r"\d{1,7}", pg["ranks"][: 16 * MAX_RANKS]))
                dump.group_sizes[str(name)[:128]] = min(size, MAX_RANKS)
    status = decoded.get("pg_status")
    if isinstance(status, dict):
        for name, pg in list(status.items())[:10_000]:
            if isinstance(pg, dict):
                dump.last_completed[str(name)[:128]] = _int(pg.get("last_completed_collective"), -1)
    return dump


# --- reading the dumps together --------------------------------------------------------------------


def _world_size(dumps: dict[int, FrDump], expected: int | None) -> int:
    if expected is not None:
        return expected
    # The default group's config is keyed "" or "0" in the dumps torch writes; any group's largest size will do.
    sizes = [size for d in dumps.values() for size in d.group_sizes.values()]
    return max(sizes, default=0)


def _call(entry: FrEntry) -> str:
    sizes = ",".join("x".join(str(d) for d in s) for s in entry.input_sizes)
    return f"{entry.op}[{sizes}]"


def analyze_dumps(dumps: dict[int, FrDump], *, world_size: int | None = None) -> FrAnalysis:
    """The laggards, divergent ranks and missing dumps, per process group.

    `world_size` is the expected number of ranks; without it, the largest group size the dumps state (the default
    group's, which holds every rank). A rank below it without a dump is missing, named against the first group's
    collective the others last entered.
    """
    analysis = FrAnalysis(dumps=dumps)
    groups = sorted({e.pg for d in dumps.values() for e in d.entries})
    for pg in groups:
        last = {rank: d.last_seq(pg) for rank, d in sorted(dumps.items())}
        waited_on = max(last.values(), default=0)
        ahead = [r for r, s in last.items() if s == waited_on]
        op = next((e.op for r in ahead if (e := dumps[r].entry(pg, waited_on))), "")
        for rank, seq in last.items():
            if seq < waited_on:
                analysis.laggards.append(Laggard(pg, rank, seq, waited_on, op, len(ahead)))
        for seq in sorted({e.seq for d in dumps.values() for e in d.entries if e.pg == pg}):
            calls = {r: _call(e) for r, d in dumps.items() if (e := d.entry(pg, seq))}
            counts = Counter(calls.values()).most_common()
            if len(counts) <= 1 or counts[0][1] == counts[1][1]:
                continue  # all agree, or no majority to be odd against
            majority, count = counts[0]
            analysis.divergent.extend(
                Divergent(pg, r, seq, called, majority, count)
                for r, called in sorted(calls.items())
                if called != majority
            )
    size = _world_size(dumps, world_size)
    waited = max((d.last_seq(pg) for d in dumps.values() for pg in groups), default=0)
    main_pg = groups[0] if groups else ""
    for rank in range(min(size, MAX_RANKS)):
        if rank not in dumps:
            analysis.missing.append(MissingDump(main_pg, rank, waited))
    return analysis


# --- evidence --------------------------------------------------------------------------------------


def _time(ns: int) -> datetime | None:
    return datetime.fromtimestamp(ns / 1e9, UTC) if ns > 0 else None


def _op_type(op: str) -> str:
    # `gloo:all_reduce` / `nccl:all_reduce` -> ALLREDUCE, the spelling the watchdog's lines use.
    return op.split(":", 1)[-1].replace("_", "").upper()[:64] or "UNKNOWN"


def flight_recorder_evidence(analysis: FrAnalysis, context: SourceContext) -> list[Evidence]:
    """Each rank's last collective as a timeout-style report (the lowest is elected laggard), and each mismatch.

    Every rank with a dump reports the highest sequence id it entered as `last_enqueued`, as a watchdog's timeout
    line does, so the election's hang reading names the rank that never reached the others' collective. A rank
    whose op or sizes differ is a collective mismatch (the job's code).
    """
    found: list[Evidence] = []

    def add(fields: dict[str, object], line: str, rank: int, origin: str, ns: int) -> None:
        data = EvidenceData.model_validate(
            {"lines": (line[:MAX_LINE],), "origin": origin[:256], "summary": line[:1024], **fields}
        )
        found.append(Evidence(data=data, time=_time(ns), node=context.node, rank=rank))

    groups = sorted({e.pg for d in analysis.dumps.values() for e in d.entries})
    for rank, dump in sorted(analysis.dumps.items()):
        for pg in groups:
            seq = dump.last_seq(pg)
            entry = dump.entry(pg, seq)
            if entry is None:
                continue
            line = (
                f"{SUMMARY_PREFIX}rank {rank} last entered collective {seq} ({entry.op}) of process group {pg}"
                f" (state {entry.state})"
            )
            fields = {
                "category": C.COLLECTIVE_TIMEOUT,
                "op_type": _op_type(entry.op),
                "seq_num": seq,
                "last_enqueued": seq,
                "timeout_ms": entry.timeout_ms,
            }
            add(fields, line, rank, dump.origin, entry.time_created_ns)
    for odd in analysis.divergent:
        entry = analysis.dumps[odd.rank].entry(odd.pg, odd.seq)
        line = (
            f"{SUMMARY_PREFIX}rank {odd.rank} called {odd.called} at collective {odd.seq} of process group "
            f"{odd.pg} where {odd.majority_count} ranks called {odd.majority}"
        )
        fields = {"category": C.COLLECTIVE_MISMATCH, "seq_num": odd.seq, "op_type": _op_type(entry.op if entry else "")}
        add(fields, line, odd.rank, analysis.dumps[odd.rank].origin, entry.time_created_ns if entry else 0)
    return found


def rank_dump_evidence(data: bytes, context: SourceContext) -> list[Evidence]:
    """One rank's dump, as a launcher collects it after the rank ends: the last collective it entered.

    A dump alone cannot say who lags: the election reads every rank's together. FlightRecorderError when the
    bytes are not a dump within the bounds.
    """
    if context.rank is None:
        msg = f"{context.origin}: a rank's dump needs its rank"
        raise FlightRecorderError(msg)
    dump = parse_dump(data, rank=context.rank, origin=context.origin)
    return flight_recorder_evidence(analyze_dumps({context.rank: dump}, world_size=1), context)


def is_flight_recorder_evidence(evidence: Evidence) -> bool:
    """Whether this evidence was read from a Flight Recorder dump (by `lanes analyze` or a node agent)."""
    return evidence.data.summary.startswith(SUMMARY_PREFIX)


def missing_dumps_what(ranks: str, plural: bool, collective: int, op_type: str | None) -> str:
    """What an absent dump would settle, in one sentence (`ranks` as listed: "2" or "4-7")."""
    called = f" ({op_type})" if op_type else ""
    if plural:
        return (
            f"ranks {ranks}' Flight Recorder dumps are missing: they would settle whether ranks {ranks} entered "
            f"collective {collective}{called}"
        )
    return (
        f"rank {ranks}'s Flight Recorder dump is missing: it would settle whether rank {ranks} entered collective "
        f"{collective}{called}"
    )


def describe(analysis: FrAnalysis) -> list[str]:
    """One line per finding of the analysis, for a person."""
    lines = [
        f"rank {lag.rank} never entered collective {lag.waited_on} ({lag.op}) of process group {lag.pg}: "
        f"its last was {lag.last_seq}, while {lag.ahead} ranks entered it"
        for lag in analysis.laggards
    ]
    lines += [
        f"rank {d.rank} called {d.called} at collective {d.seq} of process group {d.pg}; "
        f"{d.majority_count} ranks called {d.majority}"
        for d in analysis.divergent
    ]
    lines += [
        f"rank {m.rank}'s dump is missing: it would settle whether rank {m.rank} entered collective {m.waited_on}"
        for m in analysis.missing
    ]
    return lines
