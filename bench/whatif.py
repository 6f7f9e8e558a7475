"""What-if speed: the recovery replay over a large recorded log, the scheduler what-if over a large trace.

    uv run python bench/whatif.py [--quick] [--events N] [--nodes N] [--tasks N] [--runs R]

Recovery: the demo's recorded job log (tests/data/whatif/demo.ndjson, a real run) copied until it holds N
events, each copy a day after the last with its own job ids and event ids (a decision's id re-derived from the
event it answers, as recovery derives it), replayed under the shipped policy. Beside it, the raw baseline:
decoding the same kind of log from NDJSON (`decode_structured`, a line at a time), events per second.

Scheduler: a synthetic openb trace (N nodes of 8 GPUs, T one-worker tasks of 1-8 GPUs arriving over ten
hours), imported by `lanes_cli.traces`, replayed as recorded and on the cluster without its last tenth of
nodes; seconds for the whole what-if (both runs), and beside it the import alone.

The last line of stdout is one JSON object with the medians of R runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import re
import statistics
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from lanes_cli.traces import NODE_COLUMNS, POD_COLUMNS, import_openb
from lanes_contract.codec import decode_structured
from lanes_contract.events import Event, NodeRegistered, RecoveryDecided
from lanes_contract.ids import derived_event_id
from lanes_contract.topology import Node
from lanes_recovery.views import default_policy, replay_recovery
from lanes_runtime.log import configure_logging
from lanes_scheduler.views import Changes, replay_scheduler

DEMO_LOG = Path(__file__).resolve().parents[1] / "tests" / "data" / "whatif" / "demo.ndjson"
DECIDED = RecoveryDecided.model_fields["type"].default
_MOMENT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?\+00:00")
BASELINE_LINES = 200_000
"""Lines decoded for the raw baseline (a rate per event: more lines measure the same thing for longer)."""


def recorded_log(events: int) -> tuple[list[Event], list[bytes]]:
    """The demo's log copied until it holds `events` events; and its NDJSON lines (for the baseline)."""
    lines = [line for line in DEMO_LOG.read_bytes().splitlines() if line.strip()]
    base = [decode_structured(line) for line in lines]
    # A decision's id derives from the event that ended the attempt it answers: find that event in the log,
    # so each copy's decision gets the id recovery derives from the copy's event (and the replay matches it).
    answers = {derived_event_id(event.id, DECIDED, "decision"): event.id for event in base if event.jobid is not None}
    out: list[Event] = []
    copy = 0
    while len(out) < events:
        shift = timedelta(days=copy)
        ids: dict[str, str] = {}
        for event in base:
            if len(out) == events:
                break
            cause = ids.get(event.causationid or "")
            answered = answers.get(event.id) if isinstance(event, RecoveryDecided) else None
            if answered is not None and answered in ids:
                new_id = derived_event_id(ids[answered], DECIDED, "decision")
            else:
                new_id = derived_event_id(event.id, "bench-copy", str(copy), at=event.time + shift)
            ids[event.id] = new_id
            update: dict[str, Any] = {"id": new_id, "time": event.time + shift}
            if event.jobid is not None:
                update["jobid"] = f"{event.jobid}-{copy}"
            if isinstance(event, RecoveryDecided) and event.jobid is not None:
                # The recorded reason names the job and the deadline: the copy's decision names its own.
                reason = event.data.reason.replace(event.jobid, update["jobid"])
                reason = _MOMENT.sub(functools.partial(_shifted, by=shift), reason)
                update["data"] = event.data.model_copy(update={"reason": reason})
            if cause is not None:
                update["causationid"] = cause
            out.append(event.model_copy(update=update))
        copy += 1
    return out, lines


def _shifted(moment: re.Match[str], *, by: timedelta) -> str:
    return (datetime.fromisoformat(moment[0]) + by).isoformat()


def decode_rate(lines: list[bytes], count: int) -> float:
    """Events per second of decoding `count` NDJSON lines (the demo's lines, cycled)."""
    started = time.perf_counter()
    for i in range(count):
        decode_structured(lines[i % len(lines)])
    return count / (time.perf_counter() - started)


async def recovery_rate(events: list[Event]) -> tuple[float, float, int]:
    """Events per second of one recovery replay (wall clock, and per CPU second), and decisions that differ."""
    started, cpu = time.perf_counter(), time.process_time()
    result = await replay_recovery(events, default_policy())
    wall, used = time.perf_counter() - started, time.process_time() - cpu
    return len(events) / wall, len(events) / used, len(result.diff)


def synthetic_trace(nodes: int, tasks: int, *, mixed: bool = True, seed: int = 7) -> tuple[str, str]:
    """An openb node list and pod list: deterministic, busy enough that queues form.

    `mixed`: two GPU models (a third of the nodes V100M32), half the tasks asking for one of them; else one
    model and no task naming it.
    """
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    node_rows = [",".join(NODE_COLUMNS)]
    node_rows += [f"node-{i:05d},96000,786432,8,{'V100M32' if mixed and i % 3 == 0 else 'A100'}" for i in range(nodes)]
    pod_rows = [",".join(POD_COLUMNS)]
    for i in range(tasks):
        created = int(rng.uniform(0, 36_000))
        gpus = rng.choice((1, 1, 2, 4, 8, 8))
        model = rng.choice(("", "", "A100", "V100M32")) if mixed else ""
        scheduled = created + int(rng.expovariate(1 / 60))
        deleted = scheduled + 60 + int(rng.expovariate(1 / 14_400))
        pod_rows.append(f"task-{i:05d},4000,16384,{gpus},1000,{model},LS,Succeeded,{created},{deleted},{scheduled}")
    return "\n".join(pod_rows), "\n".join(node_rows)


async def scheduler_seconds(pods: str, node_list: str) -> tuple[float, float, float, dict[str, Any]]:
    """Seconds to import the trace, seconds for the what-if (both runs; wall and CPU), its headline figures."""
    started = time.perf_counter()
    trace = import_openb(pods, node_list)
    imported = time.perf_counter() - started
    registered = [e for e in trace.events if isinstance(e, NodeRegistered)]
    fewer = tuple(
        Node(node_id=e.node or "", gpu_model=e.data.gpu_model, gpus=e.data.gpus)
        for e in registered[: len(registered) * 9 // 10]
    )
    started, cpu = time.perf_counter(), time.process_time()
    result = await replay_scheduler(trace.events, Changes(nodes=fewer))
    seconds, used = time.perf_counter() - started, time.process_time() - cpu
    report = result.as_json()
    figures = {
        "jobs": report["jobs"],
        "placed": report["placed"],
        "queue_wait_p99_s": report["queue_wait_p99_s"],
        "utilisation": report["utilisation"],
        "double_booked": report["double_booked"],
        "diff": len(report["diff"]),
    }
    return imported, seconds, used, figures


async def main() -> None:
    """Run both parts R times and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100,000 events, 300 nodes, 2,000 tasks")
    parser.add_argument("--events", type=int, default=None)
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--tasks", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one-model", action="store_true", help="one GPU model in the trace (the core's fast path)")
    args = parser.parse_args()
    configure_logging("error")  # the handlers log every decision; the bench measures the replay, not stderr
    events = args.events or (100_000 if args.quick else 1_000_000)
    nodes = args.nodes or (300 if args.quick else 1_200)
    tasks = args.tasks or (2_000 if args.quick else 8_000)

    log, lines = recorded_log(events)
    decoded, replayed, per_cpu, different = [], [], [], []
    for _ in range(args.runs):
        decoded.append(decode_rate(lines, min(events, BASELINE_LINES)))
        rate, cpu_rate, changed = await recovery_rate(log)
        replayed.append(rate)
        per_cpu.append(cpu_rate)
        different.append(changed)
        print(json.dumps({"recovery_events_per_s": round(rate), "decode_events_per_s": round(decoded[-1])}))
    del log

    pods, node_list = synthetic_trace(nodes, tasks, mixed=not args.one_model)
    imports, whatifs, cpus = [], [], []
    figures: dict[str, Any] = {}
    for _ in range(args.runs):
        imported, seconds, used, figures = await scheduler_seconds(pods, node_list)
        imports.append(imported)
        whatifs.append(seconds)
        cpus.append(used)
        print(json.dumps({"scheduler_whatif_s": round(seconds, 2), "import_s": round(imported, 2)}))

    recovery = statistics.median(replayed)
    baseline = statistics.median(decoded)
    print(
        json.dumps(
            {
                "runs": args.runs,
                "recovery": {
                    "events": events,
                    "replay_events_per_s": round(recovery),
                    "replay_events_per_cpu_s": round(statistics.median(per_cpu)),
                    "decode_events_per_s": round(baseline),
                    "ratio_replay_to_decode": round(recovery / baseline, 3),
                    "target_events_per_s": 50_000,
                    "decisions_different": max(different),
                },
                "scheduler": {
                    "nodes": nodes,
                    "gpu_models": 1 if args.one_model else 2,
                    "tasks": tasks,
                    "whatif_s": round(statistics.median(whatifs), 2),
                    "whatif_cpu_s": round(statistics.median(cpus), 2),
                    "import_s": round(statistics.median(imports), 2),
                    "target_s": 60,
                    **figures,
                },
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
