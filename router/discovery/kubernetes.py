"""Kubernetes discovery: the Ready pods of a label selector in a namespace, watched through the API server.

What a pod must be to be a backend: matched by ``label_selector`` in ``namespace``; not terminating
(no ``deletionTimestamp``); given an IP (``status.podIP``); condition ``Ready`` ``"True"``; and a
container port named ``port_name`` (its ``containerPort``). The backend's URL is
``http://<podIP>:<containerPort>``. A pod that stops being Ready, starts terminating or is deleted
leaves the set at once.

The protocol, as client-go's reflector does it, with nothing but ``get``/``list``/``watch`` on pods
(``deploy/`` holds the Role):

1. **list** ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...``: the whole set, and the list's
   ``resourceVersion``;
2. **watch** from that version (``watch=1&resourceVersion=...&allowWatchBookmarks=true&timeoutSeconds=...``):
   ``ADDED``/``MODIFIED``/``DELETED`` change one pod each; ``BOOKMARK`` only advances the version; each
   event's ``metadata.resourceVersion`` is remembered. When the server ends the watch (its timeout), it
   is resumed from the last version, without a list;
3. **410 Gone** (the version is too old, as an HTTP status or as an ``ERROR`` event): list again, at once
   (a 410 again before any event arrived waits a backoff first: an API that expires every version at
   once is not flooded with lists);
4. any other failure (connection refused or reset, timeouts, 5xx, 401/403, garbage): counted, logged,
   then retried after a bounded exponential backoff with jitter (``discovery.backoff_*``). The set found
   before stays as it is meanwhile: an API server that cannot be reached never empties a pool.

Credentials: a kubeconfig file (``discovery.kubeconfig``, its ``kubernetes_context``), or in-cluster (the
pod's service-account token and CA, ``KUBERNETES_SERVICE_HOST``), loaded by ``kubernetes-asyncio``, whose
``ApiClient`` also makes the calls (TLS, token refresh). The pods are decoded with msgspec into the few
fields read here, not into the client's models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from router.config.schema import KubernetesDiscoveryConfig
from router.discovery.backoff import Backoff
from router.discovery.metrics import DiscoveryMetrics
from router.membership import normalize_url

logger = logging.getLogger(__name__)

SOURCE = "kubernetes"
#: the server ends each watch after a random time in this range (as client-go spreads its watches)
WATCH_TIMEOUT_S = (240, 300)
#: no byte from a watch for this long past its timeout: the connection is dead
READ_GRACE_S = 30.0
#: connecting to the API server (and a whole list call) is bounded by these
CONNECT_TIMEOUT_S = 5.0
LIST_TIMEOUT_S = 30.0
#: a watch the server ended sooner than this with no event waits a backoff before the next one
#: (a server that closes watches at once must not be hammered)
SHORT_WATCH_S = 1.0


# ---- the few fields read from a pod (the API's JSON; everything else is skipped by the decoder)
class _Meta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""
    deletionTimestamp: str | None = None


class _Port(msgspec.Struct):
    name: str = ""
    containerPort: int = 0


class _Container(msgspec.Struct):
    ports: list[_Port] | None = None


class _Spec(msgspec.Struct):
    containers: list[_Container] = []


class _Condition(msgspec.Struct):
    type: str = ""
    status: str = ""


class _Status(msgspec.Struct):
    podIP: str | None = None
    conditions: list[_Condition] | None = None


class Pod(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    spec: _Spec = msgspec.field(default_factory=_Spec)
    status: _Status = msgspec.field(default_factory=_Status)


class _ListMeta(msgspec.Struct):
    resourceVersion: str = ""


class PodList(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[Pod] | None = None


class WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class ApiStatus(msgspec.Struct):
    """The API's ``Status`` object (an ``ERROR`` event's object, an error answer's body)."""

    code: int = 0
    reason: str = ""
    message: str = ""


_pod_list = msgspec.json.Decoder(PodList)
_event = msgspec.json.Decoder(WatchEvent)
_pod = msgspec.json.Decoder(Pod)
_status = msgspec.json.Decoder(ApiStatus)


def backend_url(pod: Pod, port_name: str) -> str | None:
    """The pod's backend URL when it may take traffic (module docstring), else None."""
    if pod.metadata.deletionTimestamp is not None or not pod.status.podIP:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ()):
        return None
    for container in pod.spec.containers:
        for port in container.ports or ():
            if port.name == port_name and 0 < port.containerPort < 65536:
                ip = pod.status.podIP
                host = f"[{ip}]" if ":" in ip else ip
                try:
                    return normalize_url(f"http://{host}:{port.containerPort}")
                except Exception:
                    return None
    return None


class WatchFailed(Exception):
    """A list or watch call failed; ``reason`` is the metric's label (a closed set)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Gone(WatchFailed):
    """410: the resourceVersion watched from is too old; list again."""

    def __init__(self, message: str) -> None:
        super().__init__("gone", message)


async def api_client(kubeconfig: str, context: str = "") -> k8s_client.ApiClient:
    """An ``ApiClient`` from the kubeconfig file, or from the pod's in-cluster service account when
    ``kubeconfig`` is empty. Raises ``kubernetes_asyncio.config.ConfigException`` when neither works."""
    if kubeconfig:
        return await k8s_config.new_client_from_config(config_file=kubeconfig, context=context or None,
                                                       persist_config=False)
    configuration = k8s_client.Configuration()
    k8s_config.load_incluster_config(client_configuration=configuration)
    return k8s_client.ApiClient(configuration=configuration)


class PodWatch:
    """Lists and watches the pods of one pool's ``[discovery.<pool>.kubernetes]`` (module docstring) and
    reports the set of Ready backends to ``report`` after every change."""

    def __init__(self, pool: str, settings: KubernetesDiscoveryConfig,
                 client: Callable[[], Awaitable[k8s_client.ApiClient]], report: Callable[[frozenset[str]], None],
                 metrics: DiscoveryMetrics, backoff: Backoff, *, rng: random.Random | None = None,
                 watch_timeout_s: tuple[int, int] = WATCH_TIMEOUT_S) -> None:
        self.pool = pool
        self.settings = settings
        self._client_factory = client
        self._report = report
        self.metrics = metrics
        self.backoff = backoff
        self._rng = rng or random.Random()
        self.watch_timeout_s = watch_timeout_s
        #: pod name -> its backend URL, for the pods that may take traffic now
        self.backends: dict[str, str] = {}
        #: the resourceVersion to watch from (None: list first)
        self.resource_version: str | None = None
        #: completed lists (a resync after 410 is one more)
        self.lists = 0
        #: watch events applied (bookmarks included)
        self.events = 0
        #: 410s in a row with no event between them (the second one on waits a backoff), and the event
        #: count at the last one
        self._gone_streak = 0
        self._events_at_gone = 0

    async def run(self) -> None:
        """List and watch until cancelled; never raises otherwise."""
        api: k8s_client.CoreV1Api | None = None
        while True:
            try:
                if api is None:
                    api = k8s_client.CoreV1Api(await self._client_factory())
                if self.resource_version is None:
                    await self._list(api)
                    if self._gone_streak <= 1:  # not the list of a 410 that follows another at once
                        self.backoff.reset()
                if await self._watch(api):
                    self.backoff.reset()
                    continue
                delay = self.backoff.next_delay()  # ended at once without an event: do not hammer it
            except asyncio.CancelledError:
                raise
            except Gone as exc:
                self.metrics.error(self.pool, SOURCE, exc.reason)
                self.resource_version = None
                if self.events > self._events_at_gone:  # an event came since the last 410: a new streak
                    self._gone_streak = 0
                self._events_at_gone = self.events
                self._gone_streak += 1
                if self._gone_streak == 1:  # the usual expiry: list again at once
                    logger.info("kubernetes discovery for pool %s: %s; listing the pods again", self.pool, exc)
                    continue
                delay = self.backoff.next_delay()
                logger.warning("kubernetes discovery for pool %s: %s again with no event since the last one; keeping its %d "
                               "backends, listing again in %.1fs", self.pool, exc, len(self.backends), delay)
            except Exception as exc:  # noqa: BLE001 - every failure is retried; the set found stays
                reason, text = _describe(exc)
                self.metrics.error(self.pool, SOURCE, reason)
                delay = self.backoff.next_delay()
                logger.warning("kubernetes discovery for pool %s: %s; keeping its %d backends, retrying in %.1fs",
                               self.pool, text, len(self.backends), delay)
            await asyncio.sleep(delay)

    # ------------------------------------------------------------------ list

    def _params(self) -> dict[str, Any]:
        return {"label_selector": self.settings.label_selector, "_preload_content": False}

    async def _list(self, api: k8s_client.CoreV1Api) -> None:
        timeout = aiohttp.ClientTimeout(total=LIST_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        response = await api.list_namespaced_pod(self.settings.namespace, _request_timeout=timeout, **self._params())
        try:
            body = await response.read()
            _check(response.status, body, "list")
        finally:
            response.close()
        try:
            listed = _pod_list.decode(body)
        except msgspec.DecodeError as exc:
            raise WatchFailed("protocol", f"the pod list is not a PodList: {exc}") from None
        found: dict[str, str] = {}
        for pod in listed.items or ():
            url = backend_url(pod, self.settings.port_name)
            if url is not None:
                found[pod.metadata.name] = url
        self.backends = found
        self.resource_version = listed.metadata.resourceVersion or None
        self.lists += 1
        self._changed()
        if self.resource_version is None:
            raise WatchFailed("protocol", "the pod list has no metadata.resourceVersion to watch from")

    # ------------------------------------------------------------------ watch

    async def _watch(self, api: k8s_client.CoreV1Api) -> bool:
        """One watch from ``resource_version`` until the server ends it. Returns whether it delivered an
        event or lasted (False: it ended at once with nothing: the caller backs off)."""
        seconds = self._rng.randint(*self.watch_timeout_s)
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=seconds + READ_GRACE_S)
        loop = asyncio.get_running_loop()
        started = loop.time()
        response = await api.list_namespaced_pod(
            self.settings.namespace, watch=True, resource_version=self.resource_version,
            allow_watch_bookmarks=True, timeout_seconds=seconds, _request_timeout=timeout, **self._params())
        events = 0
        try:
            if response.status != 200:
                _check(response.status, await response.read(), "watch")
            while True:
                line = await response.content.readline()
                if not line:
                    break  # the server ended the watch (its timeout): resume from the last version
                if line.strip():
                    self._apply(line)
                    events += 1
        finally:
            response.close()
        return events > 0 or loop.time() - started >= SHORT_WATCH_S

    def _apply(self, line: bytes) -> None:
        try:
            event = _event.decode(line)
            if event.type == "ERROR":
                status = _status.decode(event.object)
                if status.code == 410:
                    raise Gone(f"the watch answered 410 {status.reason or 'Gone'}: {status.message}")
                raise WatchFailed(_status_reason(status.code), f"the watch sent an error: {status.code} "
                                  f"{status.reason}: {status.message}")
            pod = _pod.decode(event.object)
        except msgspec.DecodeError as exc:
            raise WatchFailed("protocol", f"a watch event is not a pod event: {exc}") from None
        self.events += 1
        if pod.metadata.resourceVersion:
            self.resource_version = pod.metadata.resourceVersion
        if event.type == "BOOKMARK":
            self.metrics.synced(self.pool, SOURCE, len(self.backends))
            return
        name = pod.metadata.name
        url = None if event.type == "DELETED" else backend_url(pod, self.settings.port_name)
        before = self.backends.get(name)
        if url is None:
            self.backends.pop(name, None)
        else:
            self.backends[name] = url
        if before != url:
            logger.info("kubernetes discovery for pool %s: pod %s %s", self.pool, name,
                        f"serves {url}" if url else "takes no traffic (not Ready, terminating or deleted)")
        self._changed()

    def _changed(self) -> None:
        self.metrics.synced(self.pool, SOURCE, len(self.backends))
        self._report(frozenset(self.backends.values()))


def _check(status: int, body: bytes, call: str) -> None:
    """Raise for an answer that is not a 200 (410: ``Gone``)."""
    if status == 200:
        return
    if status == 410:
        raise Gone(f"the {call} answered 410 Gone")
    detail = ""
    with contextlib.suppress(msgspec.DecodeError):
        detail = _status.decode(body).message
    hint = ("; the router's service account needs get, list and watch on pods in the namespace"
            if status in (401, 403) else "")
    shown = detail or body[:200].decode("utf-8", "replace")
    raise WatchFailed(_status_reason(status), f"the pod {call} answered {status}: {shown}{hint}")


def _status_reason(code: int) -> str:
    return f"status_{code // 100}xx" if 100 <= code < 600 else "protocol"


def _describe(exc: Exception) -> tuple[str, str]:
    """The metric reason and the log text of a failed call."""
    if isinstance(exc, WatchFailed):
        return exc.reason, str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout", "the API server did not answer in time"
    if isinstance(exc, aiohttp.ClientConnectionError):
        return "connect", f"cannot reach the API server: {exc.__class__.__name__}: {exc}"
    if isinstance(exc, aiohttp.ClientError):
        return "protocol", f"the API server's answer broke off: {exc.__class__.__name__}: {exc}"
    if isinstance(exc, k8s_config.ConfigException):
        return "credentials", f"no Kubernetes credentials: {exc}"
    return "error", f"{exc.__class__.__name__}: {exc}"
