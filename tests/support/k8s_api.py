"""A Kubernetes API server for tests: the list and watch protocol over real HTTP, with its failures on demand.

It speaks what the API concepts page and the API reference describe, as far as an observer reads it:
- lists (`GET /api/v1/pods`, `/api/v1/namespaces/<ns>/pods`, `/apis/<group>/<version>/...`) answering a
  `<Kind>List` with `metadata.resourceVersion`, paged by `limit` / `continue`;
- watches (`?watch=1&resourceVersion=R&allowWatchBookmarks=true&timeoutSeconds=T`) answering a chunked stream
  of JSON lines (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`), from the history after R; R older than the
  compacted history answers `410 Gone`, as the HTTP status (a `Status` body) or as an `ERROR` event;
- the discovery documents kubectl reads first (`/api`, `/apis`, `/api/v1`, `/apis/kueue.x-k8s.io/v1beta1`).

Faults: `gone_after` (an ERROR 410 after N events of a watch, the history compacted), `drop_after` (the
connection cut after N events), `slow_s` (every line sent in two chunks with a pause), `stop()` / `start()`
(the server away and back on the same port). Every request is recorded.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

KINDS = {
    "pods": ("Pod", "v1", True),
    "nodes": ("Node", "v1", False),
    "events": ("Event", "v1", True),
    "workloads": ("Workload", "kueue.x-k8s.io/v1beta1", True),
}
PLURAL_OF = {kind: plural for plural, (kind, _, _) in KINDS.items()}


@dataclass
class Change:
    """One entry of the history: the object as it was at its resourceVersion."""

    version: int
    plural: str
    type: str
    obj: dict[str, Any]


@dataclass
class Faults:
    """What goes wrong, counted down per watch request (None: never)."""

    gone_after: int | None = None
    gone_as_status: bool = False
    drop_after: int | None = None
    drop_times: int = 0
    slow_s: float = 0.0


@dataclass
class FakeKubeApi:
    """The server. `apply` changes objects as the cluster would; watches see each change once."""

    version: int = 1000
    compacted: int = 0
    objects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: {p: {} for p in KINDS})
    history: list[Change] = field(default_factory=list)
    faults: Faults = field(default_factory=Faults)
    bookmark_every_s: float = 0.2
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    logs: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    """(namespace, pod name) -> the lines of its container's log, served as `.../pods/<name>/log`."""
    port: int = 0
    _tick: asyncio.Event | None = None
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The server's address."""
        return f"http://127.0.0.1:{self.port}"

    def _current_tick(self) -> asyncio.Event:
        """Set at the next change: a watch takes it before reading the history, so no change slips between."""
        if self._tick is None:
            self._tick = asyncio.Event()
        return self._tick

    def _notify(self) -> None:
        tick, self._tick = self._current_tick(), asyncio.Event()
        tick.set()

    async def apply(self, change_type: str, obj: dict[str, Any]) -> int:
        """Store a change (ADDED, MODIFIED, DELETED) at the next resourceVersion, and wake the watches."""
        plural = PLURAL_OF[obj["kind"]]
        self.version += 1
        stored = copy.deepcopy(obj)
        stored.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        uid = stored["metadata"]["uid"]
        if change_type == "DELETED":
            self.objects[plural].pop(uid, None)
        else:
            self.objects[plural][uid] = stored
        self.history.append(Change(self.version, plural, change_type, stored))
        self._notify()
        return self.version

    async def bump(self) -> None:
        """Move the resourceVersion on with a change no observer watches (another kind)."""
        self.version += 1
        self._notify()

    def compact(self) -> None:
        """Forget the history so far: a watch from an earlier resourceVersion gets 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    def watch_requests(self, plural: str) -> list[dict[str, str]]:
        """The query of every watch request on a collection."""
        return [q for path, q in self.requests if path.endswith(f"/{plural}") and q.get("watch") in {"1", "true"}]

    def list_requests(self, plural: str) -> list[dict[str, str]]:
        """The query of every list request on a collection."""
        return [q for path, q in self.requests if path.endswith(f"/{plural}") and "watch" not in q]

    # --- HTTP ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The routes."""
        app = web.Application()
        app.router.add_get("/api", self._api_versions)
        app.router.add_get("/apis", self._api_groups)
        app.router.add_get("/version", self._version)
        app.router.add_get("/api/v1", self._core_resources)
        app.router.add_get("/apis/kueue.x-k8s.io/v1beta1", self._kueue_resources)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/log", self._log)
        app.router.add_get("/api/v1/{plural}", self._collection)
        app.router.add_get("/api/v1/namespaces/{ns}/{plural}", self._collection)
        app.router.add_get("/apis/{group}/{gv}/{plural}", self._collection)
        app.router.add_get("/apis/{group}/{gv}/namespaces/{ns}/{plural}", self._collection)
        return app

    async def start(self) -> None:
        """Listen (on the same port as before when restarted)."""
        self._runner = web.AppRunner(self.app(), shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """Go away: close the listener and every open watch."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    async def _version(_request: web.Request) -> web.Response:
        return web.json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-lanes-tests"})

    @staticmethod
    async def _api_versions(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
            }
        )

    @staticmethod
    async def _api_groups(_request: web.Request) -> web.Response:
        version = {"groupVersion": "kueue.x-k8s.io/v1beta1", "version": "v1beta1"}
        group = {"name": "kueue.x-k8s.io", "versions": [version], "preferredVersion": version}
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]})

    @staticmethod
    def _resource(plural: str) -> dict[str, Any]:
        kind, _, namespaced = KINDS[plural]
        return {
            "name": plural,
            "singularName": kind.lower(),
            "namespaced": namespaced,
            "kind": kind,
            "verbs": ["get", "list", "watch"],
        }

    async def _core_resources(self, _request: web.Request) -> web.Response:
        resources = [self._resource(p) for p in ("pods", "nodes", "events")]
        return web.json_response({"kind": "APIResourceList", "groupVersion": "v1", "resources": resources})

    async def _kueue_resources(self, _request: web.Request) -> web.Response:
        body = {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": "kueue.x-k8s.io/v1beta1",
            "resources": [self._resource("workloads")],
        }
        return web.json_response(body)

    async def _log(self, request: web.Request) -> web.StreamResponse:
        """A container's log: its lines (with an RFC 3339 stamp each when timestamps=true), then the end."""
        self.requests.append((request.path, dict(request.query)))
        lines = self.logs.get((request.match_info["ns"], request.match_info["name"]))
        if lines is None:
            return web.json_response(self._status(404, "NotFound", "pods not found"), status=404)
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        stamp = "2026-12-07T12:41:06.123456789Z " if request.query.get("timestamps") == "true" else ""
        for start in range(0, len(lines), 100):
            await response.write("".join(f"{stamp}{line}\n" for line in lines[start : start + 100]).encode())
        return response

    def _status(self, code: int, reason: str, message: str) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        plural = request.match_info["plural"]
        query = dict(request.query)
        self.requests.append((request.path, query))
        if plural not in KINDS:
            return web.json_response(self._status(404, "NotFound", f"the server could not find {plural}"), status=404)
        namespace = request.match_info.get("ns")
        if query.get("watch") in {"1", "true"}:
            return await self._watch(request, plural, namespace, query)
        return self._list(plural, namespace, query)

    @staticmethod
    def _visible(namespace: str | None, obj: dict[str, Any]) -> bool:
        return namespace is None or obj["metadata"].get("namespace") == namespace

    def _list(self, plural: str, namespace: str | None, query: dict[str, str]) -> web.Response:
        kind, api_version, _ = KINDS[plural]
        items = sorted(
            (o for o in self.objects[plural].values() if self._visible(namespace, o)),
            key=lambda o: int(o["metadata"]["resourceVersion"]),
        )
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items) or 1
        page = items[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        body = {"kind": f"{kind}List", "apiVersion": api_version, "metadata": meta, "items": page}
        return web.json_response(body)

    async def _send(self, response: web.StreamResponse, item: dict[str, Any]) -> None:
        line = json.dumps(item, separators=(",", ":")).encode() + b"\n"
        if self.faults.slow_s:
            half = len(line) // 2
            await response.write(line[:half])
            await asyncio.sleep(self.faults.slow_s)
            await response.write(line[half:])
        else:
            await response.write(line)

    async def _watch(
        self, request: web.Request, plural: str, namespace: str | None, query: dict[str, str]
    ) -> web.StreamResponse:
        kind, api_version, _ = KINDS[plural]
        since = query.get("resourceVersion") or ""
        if since and since != "0" and int(since) < self.compacted:
            message = f"too old resource version: {since} ({self.compacted})"
            if self.faults.gone_as_status:
                return web.json_response(self._status(410, "Expired", message), status=410)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            await self._send(response, {"type": "ERROR", "object": self._status(410, "Expired", message)})
            return response
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        timeout = min(float(query.get("timeoutSeconds") or 30), 30.0)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sent = 0
        if not since or since == "0":  # "start at most recent": the current objects as ADDED first
            cursor = self.version
            for obj in list(self.objects[plural].values()):
                if self._visible(namespace, obj):
                    await self._send(response, {"type": "ADDED", "object": obj})
        else:
            cursor = int(since)
        while loop.time() < deadline:
            tick = self._current_tick()
            pending = [
                c for c in self.history if c.version > cursor and c.plural == plural and self._visible(namespace, c.obj)
            ]
            for change in pending:
                if self.faults.gone_after is not None and sent >= self.faults.gone_after:
                    self.faults.gone_after = None
                    self.compact()
                    message = f"too old resource version: {cursor} ({self.compacted})"
                    await self._send(response, {"type": "ERROR", "object": self._status(410, "Expired", message)})
                    return response
                if self.faults.drop_after is not None and sent >= self.faults.drop_after and self.faults.drop_times:
                    self.faults.drop_times -= 1
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await self._send(response, {"type": change.type, "object": change.obj})
                cursor = change.version
                sent += 1
            try:
                async with asyncio.timeout(self.bookmark_every_s):
                    await tick.wait()
            except TimeoutError:
                missed = any(
                    c.version > cursor and c.plural == plural and self._visible(namespace, c.obj) for c in self.history
                )
                if bookmarks and self.version > cursor and not missed:
                    cursor = self.version
                    bookmark = {
                        "kind": kind,
                        "apiVersion": api_version,
                        "metadata": {"resourceVersion": str(cursor)},
                    }
                    await self._send(response, {"type": "BOOKMARK", "object": bookmark})
        return response
