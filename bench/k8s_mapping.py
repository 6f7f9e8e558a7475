"""The Kubernetes mapping's cost per watch event, against decoding the same watch lines and nothing else.

    uv run python bench/k8s_mapping.py [JOBS] [REPEATS]

A relist of a busy cluster is what the observer does most work on at once: JOBS copies of the JobSet scenario
in tests/data/k8s/jobset-oomkilled.ndjson (a Workload, four pods starting, one OOMKilled, three stopped), each
with its own uids and names, go through `Observer.apply` (the mapping, with its memory) into catalogue events.
The baseline runs beside it on the same lines: `json.loads` of each watch line, which the loop does anyway.
Medians over REPEATS runs; the last line of stdout is one JSON object with the ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from lanes_k8s.mapping import Observer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "k8s" / "jobset-oomkilled.ndjson"


def lines(jobs: int) -> list[str]:
    """JOBS copies of the scenario, each a job of its own (uids and owner names made unique)."""
    template = DATA.read_text().splitlines()
    out: list[str] = []
    for job in range(jobs):
        for line in template:
            copy = (
                line.replace("pretrain", f"pretrain{job}")
                .replace("-0000-4000-8000-", f"-{job:04x}-4000-8000-")  # pod and Job uids
                .replace("6a1d3b8f-", f"{job:08x}-")  # the Workload's uid
            )
            out.append(copy)
    return out


def mapped(watch_lines: list[str]) -> tuple[float, int]:
    """Seconds to map every line, and how many catalogue events came out."""
    observer = Observer()
    started = time.perf_counter()
    produced = 0
    for line in watch_lines:
        item = json.loads(line)
        produced += len(observer.apply(item["object"]["kind"], item["type"], item["object"]))
    return time.perf_counter() - started, produced


def decoded(watch_lines: list[str]) -> float:
    """Seconds to decode every line (the baseline)."""
    started = time.perf_counter()
    for line in watch_lines:
        json.loads(line)
    return time.perf_counter() - started


def main() -> None:
    """Run both, REPEATS times, and print the medians."""
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5  # noqa: PLR2004 - argv position
    watch_lines = lines(jobs)
    mapping_s, baseline_s = [], []
    produced = 0
    for _ in range(repeats):
        baseline_s.append(decoded(watch_lines))
        seconds, produced = mapped(watch_lines)
        mapping_s.append(seconds)
    mapping, baseline = statistics.median(mapping_s), statistics.median(baseline_s)
    result = {
        "watch_events": len(watch_lines),
        "catalogue_events": produced,
        "mapping_events_per_s": round(len(watch_lines) / mapping, 1),
        "json_decode_events_per_s": round(len(watch_lines) / baseline, 1),
        "ratio_mapping_to_decode": round(baseline / mapping, 4),
        "median_of": repeats,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
