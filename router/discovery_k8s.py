"""Kubernetes discovery: LIST then WATCH ``discovery.k8s.io/v1`` EndpointSlices with the official
(synchronous) client in one daemon thread, re-LISTing when a watch expires or the server answers
410 Gone. An endpoint is usable when ``conditions.ready`` is not False and
``conditions.terminating`` is not True (the API: nil ready means ready, nil terminating means
not terminating). ``serving`` is ignored on purpose: it stays true while a pod drains, and a
draining engine must get no new requests. See ``router.endpoint`` for the contract.

The ``kubernetes`` package is imported lazily: it is slow to import, and static or DNS routers
do not need it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from router.backoff import Backoff
from router.config import DiscoveryConfig
from router.endpoint import Endpoint, join_host_port

logger = logging.getLogger(__name__)

# One engine (pod) can appear in several slices: an IPv4 and an IPv6 slice on dual-stack
# clusters, or two slices for a moment while the controller moves it. It is one engine, so it
# gets one address: the lowest by (address family rank, address), deterministic across routers.
_ADDRESS_TYPE_RANK = {"IPv4": 0, "IPv6": 1, "FQDN": 2}


def _usable(conditions: Any) -> bool:
    if conditions is None:
        return True
    return conditions.ready is not False and conditions.terminating is not True


def _slice_port(ports: Any, port_name: str, default_port: int) -> int:
    for port in ports or ():
        if port.name == port_name and port.port:
            return port.port
    return default_port


def slice_endpoints(endpoint_slice: Any, *, port_name: str,
                    default_port: int) -> tuple[tuple[int, Endpoint], ...]:
    """The usable endpoints of one ``V1EndpointSlice``, each with its address family rank.

    The API calls an endpoint's addresses fungible ("clients may choose to only use the first
    element"), so an engine is reached at its first address only: one pod, one connection.
    """
    port = _slice_port(endpoint_slice.ports, port_name, default_port)
    rank = _ADDRESS_TYPE_RANK.get(endpoint_slice.address_type, len(_ADDRESS_TYPE_RANK))
    found = []
    for endpoint in endpoint_slice.endpoints or ():
        if not endpoint.addresses or not _usable(endpoint.conditions):
            continue
        address = join_host_port(endpoint.addresses[0], port)
        target = endpoint.target_ref
        engine_id = target.name if target is not None and target.name else address
        found.append((rank, Endpoint(engine_id, address)))
    return tuple(found)


def merge_slices(slices: Iterable[tuple[tuple[int, Endpoint], ...]]) -> frozenset[Endpoint]:
    best: dict[str, tuple[int, Endpoint]] = {}
    for entries in slices:
        for entry in entries:
            current = best.get(entry[1].engine_id)
            if current is None or entry < current:
                best[entry[1].engine_id] = entry
    return frozenset(endpoint for _, endpoint in best.values())


def _default_api_client() -> Any:
    """An ApiClient from the pod's service account, else from the kubeconfig.

    Both loaders fill our own Configuration, never the library's process-wide default.
    """
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError) as e:
            raise ValueError("discovery: kubernetes discovery found neither an in-cluster "
                             f"service account nor a kubeconfig: {e}") from None
    return client.ApiClient(configuration)


@dataclass(frozen=True, slots=True)
class K8sWatchParams:
    """What the LIST/WATCH loop needs; the timeouts and backoff are not user settings."""

    namespace: str
    label_selector: str
    port_name: str
    default_port: int
    watch_timeout_s: int
    connect_timeout_s: float = 5.0
    # A watch read idle this long is resumed from its resourceVersion (no LIST); it also bounds
    # a LIST, the one call that stop() cannot break.
    read_timeout_s: float = 5.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


class KubernetesDiscovery:
    name = "kubernetes"

    def __init__(self, api_client: Any, params: K8sWatchParams) -> None:
        self._api_client = api_client
        self._params = params

    @classmethod
    def from_config(cls, cfg: DiscoveryConfig, *, api_client: Any = None,
                    **_: Any) -> KubernetesDiscovery:
        params = K8sWatchParams(namespace=cfg.namespace(), label_selector=cfg.selector(),
                                port_name=cfg.k8s_port_name, default_port=cfg.engine_port,
                                watch_timeout_s=cfg.k8s_watch_timeout_s)
        return cls(api_client if api_client is not None else _default_api_client(), params)

    async def updates(self) -> AsyncIterator[frozenset[Endpoint]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[frozenset[Endpoint]] = asyncio.Queue()
        watcher = _SliceWatcher(self._api_client, self._params,
                                lambda endpoints: _push(loop, queue, endpoints))
        # A daemon thread, not asyncio.to_thread: a blocked read must not hold up the loop's
        # executor shutdown. stop() breaks a blocked watch read at once.
        thread = threading.Thread(target=watcher.run, name="quire-discovery-k8s", daemon=True)
        thread.start()
        try:
            last: frozenset[Endpoint] | None = None
            while True:
                endpoints = await queue.get()
                while not queue.empty():  # only the newest set matters
                    endpoints = queue.get_nowait()
                if endpoints != last:
                    last = endpoints
                    yield endpoints
        finally:
            watcher.stop()


def _push(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, endpoints: frozenset) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, endpoints)
    except RuntimeError:  # the loop closed between stop() and this push: nobody is listening
        pass


class _SliceWatcher:
    """The blocking LIST/WATCH loop, run in its own thread; publishes each new endpoint set."""

    def __init__(self, api_client: Any, params: K8sWatchParams,
                 publish: Callable[[frozenset[Endpoint]], None]) -> None:
        from kubernetes import client, watch

        self._api = client.DiscoveryV1Api(api_client)
        self._p = params
        self._publish_fn = publish
        self._stopped = threading.Event()
        self._decoder = watch.Watch()  # only its event decoding; see _watch_once
        self._lock = threading.Lock()  # guards _response between stop() and the thread
        self._response: Any = None
        self._slices: dict[str, tuple[tuple[int, Endpoint], ...]] = {}
        self._published: frozenset[Endpoint] | None = None

    def stop(self) -> None:
        """Called from the event loop's thread; the blocked read returns at once."""
        self._stopped.set()
        with self._lock:
            if self._response is not None:
                _shutdown(self._response)

    def run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = Backoff(self._p.backoff_initial_s, self._p.backoff_max_s)
        gone_in_a_row = 0
        while not self._stopped.is_set():
            try:
                resource_version = self._list()
                backoff.reset()
                self._watch_until_expiry(resource_version)
                gone_in_a_row = 0
            except ApiException as e:
                gone_in_a_row = gone_in_a_row + 1 if e.status == 410 else 0
                if gone_in_a_row == 1:  # our resourceVersion is too old: a fresh LIST, now
                    logger.info("kubernetes discovery: watch expired (410), re-listing")
                    continue
                self._fail(e, backoff)  # also a 410 right after a fresh LIST
            # Anything may go wrong against a remote API (bad JSON, a half-written object); this
            # thread must never die silently, or the pool would freeze on a stale set.
            except Exception as e:  # noqa: BLE001 - see the comment above
                self._fail(e, backoff)

    def _fail(self, error: Exception, backoff: Backoff) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        if self._stopped.is_set():
            return
        backoff_s = backoff.next_s()
        # The API unreachable or unhappy needs no traceback; anything else is a bug to read.
        expected = isinstance(error, (ApiException, HTTPError, OSError))
        logger.warning("kubernetes discovery (%s, %s): %s; keeping the last set, retrying in "
                       "%.1fs", self._p.namespace, self._p.label_selector, error, backoff_s,
                       exc_info=not expected)
        self._stopped.wait(backoff_s)  # a stop() ends the wait at once

    def _list(self) -> str:
        result = self._api.list_namespaced_endpoint_slice(
            self._p.namespace, label_selector=self._p.label_selector,
            _request_timeout=(self._p.connect_timeout_s, self._p.read_timeout_s))
        # Replaced whole, so a re-list never shows the pool a half-empty set.
        self._slices = {item.metadata.name: self._endpoints_of(item) for item in result.items}
        self._publish()
        return result.metadata.resource_version

    def _watch_until_expiry(self, resource_version: str) -> None:
        """Applies watch events until the server ends the watch; resumes after idle reads."""
        from urllib3.exceptions import ReadTimeoutError

        while not self._stopped.is_set():
            try:
                self._watch_once(resource_version)
                return  # the server ended the watch (timeout_seconds): the caller re-lists
            except ReadTimeoutError:
                # Nothing arrived for read_timeout_s (bookmarks come about once a minute): resume
                # from where we are, which is cheaper than a LIST.
                resource_version = self._decoder.resource_version or resource_version

    def _watch_once(self, resource_version: str) -> None:
        """One WATCH request. Not ``Watch.stream``: stop() must reach the response the moment
        it exists, and ``stream`` hides it until the first event."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        self._decoder.resource_version = resource_version
        response = self._api.list_namespaced_endpoint_slice(
            self._p.namespace, label_selector=self._p.label_selector, watch=True,
            resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self._p.watch_timeout_s, _preload_content=False,
            _request_timeout=(self._p.connect_timeout_s, self._p.read_timeout_s))
        with self._lock:
            self._response = response
        try:
            if self._stopped.is_set():  # stop() came while we connected
                return
            for line in iter_resp_lines(response):
                # Decodes the slice and records its resourceVersion (a BOOKMARK's too).
                event = self._decoder.unmarshal_event(line, "V1EndpointSlice")
                if self._stopped.is_set():
                    return
                if event is None:
                    continue
                if event["type"] == "ERROR":  # a Status; 410: our version is too old
                    status = event["raw_object"]
                    raise ApiException(status=status.get("code"), reason=status.get("message"))
                self._apply(event)
        finally:
            with self._lock:
                self._response = None
            response.close()  # a half-read stream must not go back to the pool for reuse
            response.release_conn()

    def _apply(self, event: dict) -> None:
        kind = event["type"]
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: only its resourceVersion matters, and Watch has taken it
        name = event["object"].metadata.name
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = self._endpoints_of(event["object"])
        self._publish()

    def _endpoints_of(self, endpoint_slice: Any) -> tuple[tuple[int, Endpoint], ...]:
        return slice_endpoints(endpoint_slice, port_name=self._p.port_name,
                               default_port=self._p.default_port)

    def _publish(self) -> None:
        endpoints = merge_slices(self._slices.values())
        if endpoints != self._published and not self._stopped.is_set():
            self._published = endpoints
            self._publish_fn(endpoints)


def _shutdown(response: Any) -> None:
    """Shuts the response's socket down, so a read blocked in another thread returns."""
    try:
        if hasattr(response, "shutdown"):  # urllib3 >= 2.3
            response.shutdown()
        else:
            response.connection.sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):  # already closed
        pass
