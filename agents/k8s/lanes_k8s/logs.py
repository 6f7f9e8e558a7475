"""`--logs`: the ranks' pod logs, followed through the API and read by the evidence parsers, at a bounded rate.

Each pod that is a rank of a job the observer follows (its Workload admitted, its rank known) has its main
container's log followed (`GET .../pods/<name>/log?follow=true&timestamps=true`). Every line goes through
`lanes_evidence`'s `LogParser` (the same parsers `lanes run` and the node agent use), and what it recognises
is published as evidence with the job, attempt, rank and node. Lines past the rate (a token bucket per pod,
50 lines/s with a burst of 500 by default) are not read; how many is published as raw evidence, so a
flooded log says that part of it was skipped rather than saying nothing.

Ids derive from the pod's uid and the line's number in its log, so following the log again from its start
after a cut (`sinceTime` is only to the second) publishes the same ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import structlog

from lanes_contract.events import Event, EvidenceCategory, EvidenceData, utc_now
from lanes_contract.ids import derived_event_id
from lanes_evidence.evidence import EVENT_OF_KIND, Evidence, lane_of
from lanes_evidence.parsers import LogParser, SourceContext
from lanes_k8s.mapping import SOURCE
from lanes_k8s.objects import k8s_token, parse_time
from lanes_k8s.watch import ApiError, KubeWatch

log = structlog.get_logger(__name__)


@dataclass
class RateLimit:
    """A token bucket: `rate` lines per second, up to `burst` at once."""

    rate: float
    burst: float
    tokens: float = -1.0
    at: float = field(default_factory=time.monotonic)
    dropped: int = 0

    def allow(self, now: float | None = None) -> bool:
        """Whether one more line may be read now; counts the ones that may not."""
        now = time.monotonic() if now is None else now
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.dropped += 1
        return False


@dataclass(frozen=True)
class RankPod:
    """A pod that is a rank: where its log is and whose it is."""

    uid: str
    namespace: str
    name: str
    container: str | None
    job_id: str
    attempt: int
    rank: int | None
    node: str


def split_timestamp(line: str) -> tuple[datetime | None, str]:
    """`2026-12-07T10:00:20.123456789Z text` (timestamps=true) as the time and the text."""
    stamp, _, text = line.partition(" ")
    try:
        at = parse_time(stamp[:26] + "Z" if len(stamp) > 27 and stamp.endswith("Z") else stamp)  # noqa: PLR2004 - RFC 3339 with nanoseconds
    except ValueError:
        return None, line
    return (at, text) if at is not None else (None, line)


class PodLogs:
    """Follows the log of every rank's pod the watch knows of, while it runs."""

    def __init__(self, watch: KubeWatch, *, lines_per_s: float = 50.0, burst: int = 500, max_pods: int = 256) -> None:
        self.watch = watch
        self.lines_per_s = lines_per_s
        self.burst = burst
        self.max_pods = max_pods
        self._following: dict[str, asyncio.Task[None]] = {}
        self.limits: dict[str, RateLimit] = {}

    def rank_pods(self) -> list[RankPod]:
        """The pods that are ranks of a followed job now (from the watch's known pods and the mapping's index)."""
        memory = self.watch.observer.memory
        found: list[RankPod] = []
        for key, stream in self.watch.streams.items():
            if not key.startswith("Pod:"):
                continue
            for uid, pod in stream.known.items():
                entry = memory.pods.get(uid)
                job = memory.jobs.get(entry[0]) if entry else None
                if entry is None or job is None or entry[3] is None:
                    continue
                meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
                containers = spec.get("containers") or [{}]
                found.append(
                    RankPod(
                        uid=uid,
                        namespace=str(meta.get("namespace") or ""),
                        name=str(meta.get("name") or ""),
                        container=containers[0].get("name"),
                        job_id=job.job_id,
                        attempt=entry[1],
                        rank=entry[2],
                        node=str(entry[3]),
                    )
                )
        return found[: self.max_pods]

    def _evidence_event(self, pod: RankPod, evidence: Evidence, number: int, at: datetime | None) -> Event:
        cls = EVENT_OF_KIND[evidence.kind]
        return cls(
            id=derived_event_id(pod.uid, str(cls.model_fields["type"].default), f"log/{number}"),
            source=SOURCE,
            node=k8s_token(pod.node),
            jobid=pod.job_id,
            attempt=pod.attempt,
            rank=evidence.rank if evidence.rank is not None else pod.rank,
            time=evidence.time or at or utc_now(),
            lane=lane_of(evidence.data),
            data=evidence.data,
        )

    def _dropped_event(self, pod: RankPod, limit: RateLimit) -> Event:
        data = EvidenceData(
            category=EvidenceCategory.RAW,
            summary=f"{limit.dropped} log lines of pod {pod.namespace}/{pod.name} not read: over "
            f"{self.lines_per_s:g} lines/s (--logs rate)",
            origin=f"k8s pod {pod.namespace}/{pod.name}"[:256],
        )
        return EVENT_OF_KIND["raw"](
            id=derived_event_id(pod.uid, "io.lanes.tel.raw.v1", f"dropped/{limit.dropped}"),
            source=SOURCE,
            node=k8s_token(pod.node),
            jobid=pod.job_id,
            attempt=pod.attempt,
            rank=pod.rank,
            lane=lane_of(data),
            data=data,
        )

    async def follow(self, pod: RankPod) -> None:
        """Read one pod's log to its end (the container's), publishing the evidence it holds."""
        limit = self.limits.setdefault(pod.uid, RateLimit(self.lines_per_s, float(self.burst)))
        context = SourceContext(
            origin=f"k8s pod {pod.namespace}/{pod.name}", node=pod.node, rank=pod.rank, year=utc_now().year, tz=UTC
        )
        parser = LogParser(context)
        params: dict[str, Any] = {"follow": "true", "timestamps": "true"}
        if pod.container:
            params["container"] = pod.container
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/log"
        number = 0
        reported = limit.dropped
        async for line in self.watch.api.lines(path, params):
            number += 1
            if not limit.allow():
                continue
            at, text = split_timestamp(line)
            events = [self._evidence_event(pod, e, number, at) for e in parser.feed(text)]
            self.watch.emit(events)
        rest = [self._evidence_event(pod, e, number + 1, None) for e in parser.finish()]
        if limit.dropped > reported:
            rest.append(self._dropped_event(pod, limit))
        self.watch.emit(rest)

    async def _follow_logged(self, pod: RankPod) -> None:
        try:
            await self.follow(pod)
        except (aiohttp.ClientError, OSError, TimeoutError, ApiError) as exc:
            log.warning("k8s pod log not followed", pod=f"{pod.namespace}/{pod.name}", error=str(exc))

    async def run(self, stop: asyncio.Event, *, every_s: float = 1.0) -> None:
        """Start following each new rank pod's log; a log is followed once (to its container's end)."""
        try:
            while not stop.is_set():
                for pod in self.rank_pods():
                    if pod.uid not in self._following:
                        self._following[pod.uid] = asyncio.create_task(self._follow_logged(pod))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every_s)
        finally:
            for task in self._following.values():
                task.cancel()
            await asyncio.gather(*self._following.values(), return_exceptions=True)
