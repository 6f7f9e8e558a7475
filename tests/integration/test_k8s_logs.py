"""`--logs`: a rank's pod log read through the API by the evidence parsers, at a bounded rate (support.k8s_api)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from support.k8s_api import FakeKubeApi
from support.waiting import eventually

from lanes_contract.codec import decode_structured
from lanes_contract.events import EvidenceCategory, ProcessEvidence, RawEvidence
from lanes_k8s.kubeconfig import ApiAccess
from lanes_k8s.logs import PodLogs, RateLimit
from lanes_k8s.watch import Backoff, KubeApi, KubeWatch
from lanes_observe.outbox import Outbox, Sender

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
OOM = [
    "[rank3]: Traceback (most recent call last):",
    '[rank3]:   File "/workspace/train.py", line 180, in main',
    "[rank3]:     out = model(x)",
    (
        "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity "
        "of 79.15 GiB of which 1.02 GiB is free."
    ),
]


def stream(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


async def _observe_logs(tmp_path: Path, lines: list[str], *, lines_per_s: float, burst: int) -> list[Any]:
    api = FakeKubeApi()
    await api.start()
    api.logs[("team-a", "pretrain-workers-1-1-x11")] = lines
    for item in stream("jobset-oomkilled.ndjson")[:5]:  # admitted, four pods running
        await api.apply(item["type"], item["object"])
    outbox = Outbox(tmp_path / "k8s-outbox.ndjson")
    watch = KubeWatch(
        KubeApi(ApiAccess(server=api.url), read_timeout_s=10.0),
        outbox,
        Sender(outbox, None, name="tests-k8s"),
        watch_timeout_s=3,
        backoff=Backoff(initial_s=0.05, cap_s=0.3),
    )
    logs = PodLogs(watch, lines_per_s=lines_per_s, burst=burst)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(watch.run(stop)), asyncio.create_task(logs.run(stop, every_s=0.1))]

    async def read_whole_log() -> bool:
        followed = logs._following.get("b1000000-0000-4000-8000-000000000011")
        return followed is not None and followed.done()

    try:
        await eventually(read_whole_log, what="rank 3's log read to its end")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await watch.api.close()
        await api.stop()
    logged = [p for p, q in api.requests if p.endswith("/log")]
    assert logged.count("/api/v1/namespaces/team-a/pods/pretrain-workers-1-1-x11/log") == 1  # followed once
    return [decode_structured(line) for line in outbox.lines()]


async def test_a_rank_pods_log_is_read_by_the_evidence_parsers(tmp_path):
    events = await _observe_logs(tmp_path, ["step 10 loss 2.31", *OOM], lines_per_s=1000, burst=1000)
    (oom,) = [e for e in events if isinstance(e, ProcessEvidence) and e.data.category is EvidenceCategory.CUDA_OOM]
    assert (oom.rank, oom.node, oom.attempt) == (3, "gpu-node-4", 1)
    assert oom.jobid is not None
    assert oom.jobid.startswith("k8s-team-a-pretrain-")
    assert oom.data.error_type == "torch.OutOfMemoryError"


async def test_a_flooded_log_is_read_at_the_rate_and_says_how_much_it_skipped(tmp_path):
    flood = [f"step {i} loss 2.31" for i in range(3000)]
    events = await _observe_logs(tmp_path, [*flood, *OOM], lines_per_s=1.0, burst=100)
    (skipped,) = [e for e in events if isinstance(e, RawEvidence) and "not read" in e.data.summary]
    assert skipped.rank == 3
    assert "log lines of pod team-a/pretrain-workers-1-1-x11 not read" in skipped.data.summary


def test_the_rate_limit_lets_a_burst_through_then_the_rate():
    limit = RateLimit(rate=10.0, burst=5.0, at=0.0)
    assert [limit.allow(0.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert limit.allow(0.1) is True
    assert limit.allow(0.1) is False
    assert limit.dropped == 3
