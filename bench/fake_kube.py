"""A small fake Kubernetes API server: pods only, over real HTTP on 127.0.0.1 (aiohttp); the discovery
tests (tests/router/discovery) and bench/discovery.py drive the router against it.

What it does as the real API server does (as far as discovery reads it):

- ``GET /api/v1/namespaces/{ns}/pods`` lists the namespace's pods matching ``labelSelector``
  (equality-based: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, joined by commas) with the list's
  ``metadata.resourceVersion``;
- ``...?watch=1&resourceVersion=N``: streams, one JSON line each, every change after N (``ADDED``,
  ``MODIFIED``, ``DELETED``; a pod whose labels stop matching is ``DELETED`` for that watch, one that
  starts matching ``ADDED``), then the changes as they happen; ``BOOKMARK`` events when
  ``allowWatchBookmarks=true`` (``bookmark()``, or every ``bookmark_every_s``); ends after ``timeoutSeconds``;
- a ``resourceVersion`` older than the retained history (``compact()``) gets ``410 Gone``: as an
  ``ERROR`` event in a 200 stream (what the API server does for watches), or as an HTTP 410
  (``gone_as_http``);
- a request without ``Authorization: Bearer <token>`` gets 401;
- ``stop()`` takes the server away (open watches broken off), ``start()`` brings it back on the same
  port; with ``forget=True`` it comes back with a new history (versions far ahead), like a restored etcd.

Every request is recorded (``requests``) so that tests can see lists, watches and their versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bench.procs import free_port

TOKEN = "discovery-test-token"


def pod(name: str, ip: str, *, ready: bool = True, labels: dict[str, str] | None = None, port: int = 8000,
        port_name: str = "http", namespace: str = "inference", deleting: bool = False) -> dict[str, Any]:
    """A pod as the API serves it (the fields discovery reads, and some it must skip)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                                "labels": labels if labels is not None else {"app": "vllm"},
                                "annotations": {"note": "skipped by the decoder"}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {
        "kind": "Pod", "apiVersion": "v1", "metadata": metadata,
        "spec": {"containers": [{"name": "sidecar", "image": "x"},
                                {"name": "engine", "image": "vllm",
                                 "ports": [{"name": "metrics", "containerPort": 9000, "protocol": "TCP"},
                                           {"name": port_name, "containerPort": port, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                   "conditions": [{"type": "Initialized", "status": "True"},
                                  {"type": "Ready", "status": "True" if ready else "False"},
                                  {"type": "ContainersReady", "status": "True" if ready else "False"}]},
    }


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector (the test's own, independent of the router's checks)."""
    for part in (p.strip() for p in selector.split(",") if p.strip()):
        if "!=" in part:
            key, value = part.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif part.startswith("!"):
            if part[1:].strip() in labels:
                return False
        elif part not in labels:
            return False
    return True


@dataclass
class Change:
    rv: int
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    at: float = field(default_factory=time.monotonic)


@dataclass
class Recorded:
    watch: bool
    resource_version: str | None
    selector: str
    status: int = 200


class FakeKubeAPI:
    """The fake (module docstring). ``await start()`` / ``await stop()``; ``url``, ``kubeconfig(dir)``."""

    def __init__(self, *, gone_as_http: bool = False, bookmark_every_s: float | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self.gone_as_http = gone_as_http
        self.bookmark_every_s = bookmark_every_s
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.rv = 1000
        self.history: list[Change] = []
        #: versions at or below this are compacted away (410 for a watch from there)
        self.oldest = self.rv
        self.requests: list[Recorded] = []
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Condition()
        self._bookmarks = 0
        #: watch responses open now
        self.open_watches = 0
        #: answer every request with this status (None: serve normally)
        self.fail_with: int | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    async def start(self, *, forget: bool = False) -> None:
        if forget:
            self.rv += 100_000
            self.history.clear()
            self.oldest = self.rv
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        self.port = self.port or free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True,
                          ssl_context=self.ssl_context).start()

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.shutdown()
            await runner.cleanup()

    def kubeconfig(self, directory: str, namespace: str = "inference", token: str = TOKEN) -> str:
        path = os.path.join(directory, "kubeconfig")
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "router", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": namespace}}],
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(config, fh)  # JSON is YAML
        return path

    # ---------------------------------------------------------------- changes

    async def put(self, body: dict[str, Any]) -> int:
        """Create or replace a pod; returns the new resourceVersion."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        return await self._change(key, body)

    async def delete(self, name: str, namespace: str = "inference") -> int:
        return await self._change((namespace, name), None)

    async def _change(self, key: tuple[str, str], after: dict[str, Any] | None) -> int:
        async with self._changed:
            self.rv += 1
            before = self.pods.get(key)
            if after is None:
                self.pods.pop(key, None)
                if before is not None:
                    before = {**before, "metadata": {**before["metadata"], "resourceVersion": str(self.rv)}}
            else:
                after = json.loads(json.dumps(after))
                after["metadata"]["resourceVersion"] = str(self.rv)
                self.pods[key] = after
            self.history.append(Change(self.rv, before, after))
            self._changed.notify_all()
            return self.rv

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        self.history.clear()
        self.oldest = self.rv

    async def bookmark(self) -> None:
        """A BOOKMARK (at the current version) to every watch that asked for them."""
        async with self._changed:
            self._bookmarks += 1
            self._changed.notify_all()

    async def advance(self, n: int = 1) -> int:
        """Versions move on (other objects changing), without a pod event for our selector."""
        async with self._changed:
            self.rv += n
            self._changed.notify_all()
            return self.rv

    def lists(self) -> int:
        return sum(1 for r in self.requests if not r.watch and r.status == 200)

    def watches(self) -> list[Recorded]:
        return [r for r in self.requests if r.watch]

    # ---------------------------------------------------------------- the API

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        watch = query.get("watch") in ("1", "true", "True")
        record = Recorded(watch, query.get("resourceVersion"), query.get("labelSelector", ""))
        self.requests.append(record)
        if self.fail_with is not None:
            record.status = self.fail_with
            return _status(self.fail_with, "InternalError", "the fake is told to fail")
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            record.status = 401
            return _status(401, "Unauthorized", "no or wrong bearer token")
        namespace = request.match_info["namespace"]
        selector = query.get("labelSelector", "")
        if not watch:
            items = [p for (ns, _), p in sorted(self.pods.items())
                     if ns == namespace and matches(selector, p["metadata"].get("labels", {}))]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        return await self._watch(request, record, namespace, selector)

    async def _watch(self, request: web.Request, record: Recorded, namespace: str, selector: str
                     ) -> web.StreamResponse:
        query = request.query
        since = int(query.get("resourceVersion") or self.rv)
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true", "True")
        deadline = time.monotonic() + float(query.get("timeoutSeconds", "1800"))
        if since < self.oldest:
            if self.gone_as_http:
                record.status = 410
                return _status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
            response = web.StreamResponse()
            response.content_type = "application/json"
            await response.prepare(request)
            await _line(response, {"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
                "message": f"too old resource version: {since} ({self.oldest})"}})
            return response
        response = web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request)
        self.open_watches += 1
        sent_bookmarks = self._bookmarks
        next_bookmark = time.monotonic() + (self.bookmark_every_s or 1e9)
        try:
            while time.monotonic() < deadline:
                for change in [c for c in self.history if c.rv > since]:
                    event = _event_for(change, namespace, selector)
                    since = change.rv
                    if event is not None:
                        await _line(response, event)
                if bookmarks and (self._bookmarks != sent_bookmarks or time.monotonic() >= next_bookmark):
                    sent_bookmarks = self._bookmarks
                    next_bookmark = time.monotonic() + (self.bookmark_every_s or 1e9)
                    since = max(since, self.rv)
                    await _line(response, {"type": "BOOKMARK", "object": {
                        "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}}})
                async with self._changed:
                    if not any(c.rv > since for c in self.history) and self._bookmarks == sent_bookmarks:
                        timeout = min(deadline, next_bookmark) - time.monotonic()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout))
        finally:
            self.open_watches -= 1
        return response


def _event_for(change: Change, namespace: str, selector: str) -> dict[str, Any] | None:
    def visible(obj: dict[str, Any] | None) -> bool:
        return obj is not None and obj["metadata"]["namespace"] == namespace and \
            matches(selector, obj["metadata"].get("labels", {}))

    was, now = visible(change.before), visible(change.after)
    if now:
        return {"type": "MODIFIED" if was else "ADDED", "object": change.after}
    if was:
        gone = change.before if change.after is None else change.after
        return {"type": "DELETED", "object": gone}
    return None


async def _line(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)
