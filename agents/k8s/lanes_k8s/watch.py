"""The list+watch loop: Kubernetes objects into the mapping, the mapping's events into the outbox.

The protocol (API concepts, "Efficient detection of changes"): list a collection and note its
`metadata.resourceVersion`; watch from there (`?watch=1&resourceVersion=R&allowWatchBookmarks=true`) and
read one JSON event per line (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`); every event moves R on.
When R is too old the server answers `410 Gone`, as the HTTP status or as an `ERROR` event carrying a
`Status` with code 410: then list again and reconcile, i.e. apply every listed object and a `DELETED` for
each object known before that the list no longer has. The mapping remembers what it published, so the
reconcile publishes only what changed while the watch was away, never an event twice.

Resuming. R per collection, the objects known per collection (trimmed to what the mapping reads) and the
mapping's memory are saved together in the state file, after the events they produced are in the outbox.
A restart watches on from the saved R; a crash between the outbox and the state file replays a few
objects, whose events come out with the same ids (JetStream keeps the first).

Outages. A refused connection, a dropped stream or an HTTP error other than 410 marks the collection not
ready and retries with exponential backoff (0.2 s doubling to 10 s, with jitter); the first event or list
that succeeds makes it ready again. `KubeWatch.ready` is true only while every collection is watched.

Why no Kubernetes client library. Both `kubernetes_asyncio` (36.1.0) and `lightkube` (1.0.1) install
here, and neither does the part that is hard: on 410, kubernetes_asyncio's `Watch` retries once with the
same resourceVersion and then raises for the caller to relist (its PR #327); lightkube's watch fails on an
`ERROR` event that carries a 410 Status (its open issue #108). Both leave relist-and-reconcile (the
deletions missed while away) to the caller. The observer reads Kueue's CRDs as plain JSON anyway, so their
typed models would not be used, and lightkube would add an HTTP stack beside the aiohttp the project
already ships. What a client would give is kubeconfig `exec` plugins (cloud logins); `lanes_k8s.kubeconfig`
says plainly that it does not run them and to use a token instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from lanes_contract.events import Event
from lanes_k8s.kubeconfig import ApiAccess
from lanes_k8s.mapping import KINDS, Change, Observer, ObserverMemory
from lanes_k8s.objects import K8sObjectError
from lanes_observe.outbox import Outbox, Sender

log = structlog.get_logger(__name__)
STATE_VERSION = 1
_GONE = 410


@dataclass(frozen=True)
class Resource:
    """A collection the observer watches."""

    kind: str
    api: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None) -> str:
        """The collection's URL path, in one namespace or across all of them."""
        if self.namespaced and namespace:
            return f"{self.api}/namespaces/{namespace}/{self.plural}"
        return f"{self.api}/{self.plural}"


RESOURCES = (
    Resource("Workload", "/apis/kueue.x-k8s.io/v1beta1", "workloads"),
    Resource("Pod", "/api/v1", "pods"),
    Resource("Node", "/api/v1", "nodes", namespaced=False),
    Resource("Event", "/api/v1", "events"),
)
assert tuple(r.kind for r in RESOURCES) == KINDS  # noqa: S101 - the mapping's order is the listing order


class GoneError(Exception):
    """The resourceVersion the watch asked for is no longer served: list again."""


class ApiError(Exception):
    """The API server answered with an error other than 410 (retried with backoff)."""


class KubeApi:
    """List and watch over HTTP, as the API server speaks it; nothing more."""

    def __init__(self, access: ApiAccess, *, page_size: int = 500, read_timeout_s: float = 330.0) -> None:
        """`read_timeout_s`: silence after which a connection is taken as dead; longer than a watch's timeout."""
        self.access = access
        self.page_size = page_size
        self._timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.access.ssl_context or True)
            headers = {"Accept": "application/json", **self.access.headers}
            self._session = aiohttp.ClientSession(headers=headers, timeout=self._timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()

    @staticmethod
    async def _refuse(response: aiohttp.ClientResponse, path: str) -> None:
        if response.status < 300:  # noqa: PLR2004 - HTTP success range
            return
        body = await response.text()
        try:
            message = str(json.loads(body).get("message") or body)
        except (ValueError, AttributeError):
            message = body
        if response.status == _GONE:
            raise GoneError(f"{path}: {message}")
        raise ApiError(f"{path}: HTTP {response.status}: {message[:300]}")

    async def list(self, path: str) -> tuple[list[dict[str, Any]], str]:
        """Every object of a collection (page by page) and the resourceVersion to watch from."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            params = {"limit": str(self.page_size)} | ({"continue": token} if token else {})
            async with self._client().get(self.access.server + path, params=params) as response:
                await self._refuse(response, path)  # a 410 on a continue token: the list starts over
                body = await response.json(content_type=None)
            if not isinstance(body, dict) or not isinstance(body.get("items"), list):
                raise ApiError(f"{path}: a list answer without items")
            items.extend(item for item in body["items"] if isinstance(item, dict))
            meta = body.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def lines(self, path: str, params: Mapping[str, str]) -> AsyncIterator[str]:
        """The lines of a streamed text answer (a pod's log), until the server ends it."""
        async with self._client().get(self.access.server + path, params=dict(params)) as response:
            await self._refuse(response, path)
            async for line in _lines_of(response):
                yield line.decode(errors="replace")

    async def watch(self, path: str, resource_version: str, timeout_s: int) -> AsyncIterator[dict[str, Any]]:
        """The watch events after `resource_version`, one per line, until the server ends the watch."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        async with self._client().get(self.access.server + path, params=params) as response:
            await self._refuse(response, path)
            yield OPENED
            async for line in _lines_of(response):
                if line.strip():
                    yield _watch_event(line, path)


async def _lines_of(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The lines of a streamed body as they arrive, however the chunks cut them (no length limit per line)."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line
    if pending:
        yield pending


OPENED: dict[str, Any] = {"type": "OPENED", "object": {}}
"""Not a watch event: what `KubeApi.watch` yields first, once the server has accepted the watch."""


def _watch_event(line: bytes, path: str) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise ApiError(f"{path}: a watch line that is not JSON: {line[:200]!r}") from exc
    if not isinstance(item, dict) or not isinstance(item.get("object"), dict):
        raise ApiError(f"{path}: a watch line without an object: {line[:200]!r}")
    if item.get("type") == "ERROR":
        status = item["object"]
        if status.get("code") == _GONE:
            raise GoneError(f"{path}: {status.get('message') or 'resourceVersion too old'}")
        raise ApiError(f"{path}: watch error {status.get('code')}: {status.get('message')}")
    return item


@dataclass
class Backoff:
    """Exponential backoff with jitter, reset by a success."""

    initial_s: float = 0.2
    cap_s: float = 10.0
    failures: int = 0

    def next_delay(self) -> float:
        """The pause before the next try."""
        self.failures += 1
        delay: float = min(self.cap_s, self.initial_s * 2.0 ** (self.failures - 1))
        jitter: float = random.uniform(0.8, 1.2)  # noqa: S311 - jitter, not a secret
        return delay * jitter

    def reset(self) -> None:
        """A success: the next failure starts from the initial pause."""
        self.failures = 0


_POD_SPEC_KEPT = ("nodeName",)


def trim(kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the mapping reads of an object: the copy kept to reconcile a relist (no templates, no managedFields)."""
    kept = dict(obj)
    meta = dict(kept.get("metadata") or {})
    meta.pop("managedFields", None)
    kept["metadata"] = meta
    spec = kept.get("spec")
    if kind == "Pod" and isinstance(spec, dict):
        containers = [{"name": c.get("name")} for c in spec.get("containers") or () if isinstance(c, dict)]
        kept["spec"] = {k: spec[k] for k in _POD_SPEC_KEPT if k in spec} | {"containers": containers}
    elif kind == "Workload" and isinstance(spec, dict):
        pod_sets = [
            {"name": p.get("name"), "count": p.get("count")} for p in spec.get("podSets") or () if isinstance(p, dict)
        ]
        kept["spec"] = {k: v for k, v in spec.items() if k != "podSets"} | {"podSets": pod_sets}
    return kept


def _check_version(saved: Any) -> None:
    if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
        found = saved.get("version") if isinstance(saved, dict) else None
        raise ValueError(f"state version {found!r}, expected {STATE_VERSION}")


@dataclass
class StreamState:
    """Where one collection's watch stands."""

    resource_version: str | None = None
    known: dict[str, dict[str, Any]] = field(default_factory=dict)
    ready: bool = False
    problem: str = "not listed yet"
    cuts: int = 0
    """Watches cut in a row since the last one that was accepted."""


class KubeWatch:
    """Lists and watches each collection, feeds the mapping, and hands its events to the outbox."""

    def __init__(
        self,
        api: KubeApi,
        outbox: Outbox,
        sender: Sender,
        *,
        namespaces: tuple[str, ...] = (),
        state_file: Path | None = None,
        resources: tuple[Resource, ...] = RESOURCES,
        watch_timeout_s: int = 300,
        save_every_s: float = 1.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.api = api
        self.outbox = outbox
        self.sender = sender
        self.namespaces = namespaces
        self.state_file = state_file
        self.resources = resources
        self.watch_timeout_s = watch_timeout_s
        self.save_every_s = save_every_s
        self._backoff = backoff or Backoff()
        self.streams: dict[str, StreamState] = {}
        self.observer = Observer()
        self.refused = 0
        """Objects the mapping could not read (each logged with its reason)."""
        self.relists = 0
        self._saved_at = 0.0
        self._to_send = asyncio.Event()
        self._load()

    # --- state ---------------------------------------------------------------------------------

    def _keys(self) -> list[tuple[str, Resource, str | None]]:
        keys: list[tuple[str, Resource, str | None]] = []
        for resource in self.resources:
            scopes: tuple[str | None, ...] = self.namespaces if (resource.namespaced and self.namespaces) else (None,)
            keys.extend((f"{resource.kind}:{scope or '*'}", resource, scope) for scope in scopes)
        return keys

    def _load(self) -> None:
        for key, _, _ in self._keys():
            self.streams[key] = StreamState()
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            saved = json.loads(self.state_file.read_text(encoding="utf-8"))
            _check_version(saved)
            self.observer = Observer(ObserverMemory.model_validate(saved["memory"]))
            for key, stream in saved["streams"].items():
                if key in self.streams:  # a collection no longer watched (another --namespace) is dropped
                    self.streams[key] = StreamState(resource_version=stream["resourceVersion"], known=stream["known"])
        except (ValueError, KeyError, TypeError) as exc:
            msg = f"the state file {self.state_file} cannot be read ({exc}); move it away to start afresh"
            raise ValueError(msg) from exc

    def save(self) -> None:
        """Write the resourceVersions, known objects and the mapping's memory (atomically)."""
        if self.state_file is None:
            return
        state = {
            "version": STATE_VERSION,
            "streams": {
                key: {"resourceVersion": s.resource_version, "known": s.known} for key, s in self.streams.items()
            },
            "memory": self.observer.memory.model_dump(mode="json"),
        }
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_name(self.state_file.name + ".partial")
        partial.write_text(json.dumps(state, separators=(",", ":")), encoding="utf-8")
        partial.replace(self.state_file)
        self._saved_at = time.monotonic()

    def _maybe_save(self) -> None:
        if time.monotonic() - self._saved_at >= self.save_every_s:
            self.save()

    @property
    def ready(self) -> bool:
        """Whether every collection is listed and being watched now."""
        return all(s.ready for s in self.streams.values())

    def problems(self) -> dict[str, str]:
        """Why each collection that is not ready is not."""
        return {key: s.problem for key, s in self.streams.items() if not s.ready}

    # --- applying ------------------------------------------------------------------------------

    def _apply(self, resource: Resource, stream: StreamState, change: Change, obj: dict[str, Any]) -> list[Event]:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        try:
            events = self.observer.apply(resource.kind, change, obj)
        except K8sObjectError as exc:
            self.refused += 1
            log.error("k8s object refused", kind=resource.kind, name=meta.get("name"), error=str(exc))  # noqa: TRY400 - the reason is the message
            events = []
        if change == "DELETED":
            stream.known.pop(uid, None)
        elif uid:
            stream.known[uid] = trim(resource.kind, obj)
        return events

    def emit(self, events: list[Event]) -> None:
        """Put events in the outbox and wake the sender."""
        if events:
            self.outbox.append(events)
            self._to_send.set()

    async def _relist(self, key: str, resource: Resource, scope: str | None) -> None:
        stream = self.streams[key]
        items, resource_version = await self.api.list(resource.path(scope))
        events: list[Event] = []
        listed: set[str] = set()
        for obj in items:
            obj.setdefault("kind", resource.kind)
            uid = str((obj.get("metadata") or {}).get("uid") or "")
            listed.add(uid)
            events.extend(self._apply(resource, stream, "MODIFIED" if uid in stream.known else "ADDED", obj))
        for uid in [uid for uid in stream.known if uid not in listed]:  # gone while the watch was away
            events.extend(self._apply(resource, stream, "DELETED", stream.known[uid]))
        self.emit(events)
        stream.resource_version = resource_version
        self.relists += 1
        self.save()
        log.info("k8s listed", collection=key, objects=len(items), resource_version=resource_version)

    async def _watch_once(self, key: str, resource: Resource, scope: str | None) -> None:
        stream = self.streams[key]
        if stream.resource_version is None:
            await self._relist(key, resource, scope)
        version = stream.resource_version or ""
        async for item in self.api.watch(resource.path(scope), version, self.watch_timeout_s):
            self._healthy(stream)
            if item is OPENED:
                continue
            obj = item["object"]
            obj_version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if item.get("type") != "BOOKMARK":
                obj.setdefault("kind", resource.kind)
                self.emit(self._apply(resource, stream, item.get("type", "MODIFIED"), obj))
            if obj_version:
                stream.resource_version = obj_version
            self._maybe_save()

    def _healthy(self, stream: StreamState) -> None:
        stream.cuts = 0
        if not stream.ready:
            stream.ready, stream.problem = True, ""
            if self.ready:
                log.info("k8s watch ready", collections=len(self.streams))
        self._backoff.reset()

    async def _follow(self, key: str, resource: Resource, scope: str | None, stop: asyncio.Event) -> None:
        stream = self.streams[key]
        while not stop.is_set():
            try:
                await self._watch_once(key, resource, scope)
            except GoneError as exc:
                log.info("k8s watch expired; listing again", collection=key, reason=str(exc))
                stream.resource_version = None
                continue
            except (aiohttp.ClientError, OSError, TimeoutError, ApiError) as exc:
                stream.cuts += 1
                if stream.ready and stream.cuts == 1 and not isinstance(exc, ApiError):
                    # A watch cut after the server accepted it (a proxy's idle timeout, a restarting replica):
                    # watch again at once from the same version; a second failure in a row is an outage.
                    log.info("k8s watch cut; watching again", collection=key, error=str(exc) or type(exc).__name__)
                    continue
                if stream.ready:
                    log.warning("k8s api unreachable; not ready", collection=key, error=str(exc) or type(exc).__name__)
                stream.ready, stream.problem = False, str(exc) or type(exc).__name__
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._backoff.next_delay())

    async def _send_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            waiter = asyncio.ensure_future(self._to_send.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            self._to_send.clear()
            await self.sender.send()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch every collection until `stop` is set; then save and send what is left."""
        streams = [
            asyncio.create_task(self._follow(key, resource, scope, stop), name=f"k8s-watch-{key}")
            for key, resource, scope in self._keys()
        ]
        sending = asyncio.create_task(self._send_loop(stop), name="k8s-send")
        try:
            await stop.wait()
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            await sending
            self.save()
            await self.sender.send()
