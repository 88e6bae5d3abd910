"""A loopback stand-in for the Kubernetes API server, for discovery tests.

No real API server runs here. This stand-in serves only what the router uses, over real HTTP so
that the official ``kubernetes`` client talks to it unchanged:

    GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices
        LIST: an ``EndpointSliceList`` with ``metadata.resourceVersion``;
        WATCH (``watch=true`` / ``watch=1``): chunked, newline-delimited JSON events
        ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`` after the asked
        ``resourceVersion``, ending after ``timeoutSeconds``; an ERROR event with a 410 Status
        when that resourceVersion is older than the stand-in retains.

``labelSelector`` supports equality terms (``k=v``, ``k==v``, ``k!=v``) and bare keys. Tests
change the state with ``put_slice`` / ``delete_slice``; open watches see the change at once.
``broadcast=False`` applies a change that only a LIST reveals, as if its event had been lost,
and ``compact()`` forgets past events, so watches behind the current version get 410 Gone.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
_SUFFIX = "/endpointslices"


def make_slice(name: str, service: str, endpoints: list[dict], *, port: int | None = 50051,
               port_name: str = "grpc", address_type: str = "IPv4") -> dict:
    """An EndpointSlice as the API serves it, labelled for ``service``."""
    ports = [] if port is None else [{"name": port_name, "port": port, "protocol": "TCP"}]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "addressType": address_type, "endpoints": endpoints, "ports": ports}


def pod_endpoint(pod: str | None, ip: str, *, ready: bool | None = True,
                 serving: bool | None = None, terminating: bool | None = None) -> dict:
    conditions = {k: v for k, v in (("ready", ready), ("serving", serving),
                                    ("terminating", terminating)) if v is not None}
    endpoint: dict = {"addresses": [ip], "conditions": conditions}
    if pod is not None:
        endpoint["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "default"}
    return endpoint


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


class K8sStandin:
    def __init__(self, port: int = 0) -> None:
        self._cond = threading.Condition()
        self._rv = 1
        self._compacted_rv = 0  # watches from below this version get 410 Gone
        self._objects: dict[tuple[str, str], dict] = {}  # (namespace, name) -> slice
        self._events: list[tuple[int, str, str, dict]] = []  # (rv, namespace, type, object)
        self._fail_next: list[int] = []  # HTTP statuses for the next requests
        self._closed = False
        self.num_lists = 0
        self.num_watches = 0
        self.open_watches = 0
        standin = self

        class Handler(_Handler):
            owner = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> K8sStandin:
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> K8sStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- state, changed by tests ---

    def put_slice(self, namespace: str, obj: dict, *, broadcast: bool = True) -> None:
        key = (namespace, obj["metadata"]["name"])
        with self._cond:
            kind = "MODIFIED" if key in self._objects else "ADDED"
            self._commit(namespace, kind, json.loads(json.dumps(obj)), broadcast)

    def delete_slice(self, namespace: str, name: str, *, broadcast: bool = True) -> None:
        with self._cond:
            self._commit(namespace, "DELETED", self._objects[(namespace, name)], broadcast)

    def compact(self) -> None:
        """Forgets every past event: any watch not at the newest version gets 410 Gone."""
        with self._cond:
            self._events.clear()
            self._compacted_rv = self._rv
            self._cond.notify_all()

    def fail_next(self, *statuses: int) -> None:
        """The next requests (LIST or WATCH) answer these HTTP statuses with a Status body."""
        with self._cond:
            self._fail_next.extend(statuses)

    def _commit(self, namespace: str, kind: str, obj: dict, broadcast: bool) -> None:
        self._rv += 1
        obj["metadata"]["namespace"] = namespace
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (namespace, obj["metadata"]["name"])
        if kind == "DELETED":
            del self._objects[key]
        else:
            self._objects[key] = obj
        if broadcast:
            self._events.append((self._rv, namespace, kind, obj))
        self._cond.notify_all()

    # --- serving, called from handler threads ---

    def take_failure(self) -> int | None:
        with self._cond:
            return self._fail_next.pop(0) if self._fail_next else None

    def list_body(self, namespace: str, selector: str) -> dict:
        with self._cond:
            self.num_lists += 1
            items = [o for (ns, _), o in sorted(self._objects.items())
                     if ns == namespace and selector_matches(selector, _labels(o))]
            return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def next_events(self, namespace: str, selector: str, after_rv: int,
                    wait_s: float) -> list[dict] | None:
        """Events after ``after_rv`` (waiting up to ``wait_s`` for one); None: 410 Gone."""
        with self._cond:
            if after_rv < self._compacted_rv:
                return None
            found = self._matching(namespace, selector, after_rv)
            if not found and not self._closed:
                self._cond.wait(wait_s)
                if after_rv < self._compacted_rv:
                    return None
                found = self._matching(namespace, selector, after_rv)
            return found

    def _matching(self, namespace: str, selector: str, after_rv: int) -> list[dict]:
        return [{"type": kind, "object": obj} for rv, ns, kind, obj in self._events
                if rv > after_rv and ns == namespace and selector_matches(selector, _labels(obj))]

    def count_watch(self, delta: int) -> None:
        with self._cond:
            self.num_watches += max(delta, 0)
            self.open_watches += delta

    def current_rv(self) -> int:
        with self._cond:
            return self._rv

    @property
    def closed(self) -> bool:
        return self._closed


def _labels(obj: dict) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    owner: K8sStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet tests
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not (url.path.startswith(_PREFIX) and url.path.endswith(_SUFFIX)):
            self._send_json(404, _status(404, "NotFound", f"{url.path} is not served here"))
            return
        failure = self.owner.take_failure()
        if failure is not None:
            self._send_json(failure, _status(failure, HTTPStatus(failure).phrase, "injected"))
            return
        namespace = url.path[len(_PREFIX):-len(_SUFFIX)]
        selector = query.get("labelSelector", "")
        if query.get("watch") in ("true", "1"):
            self._watch(namespace, selector, query)
        else:
            self._send_json(200, self.owner.list_body(namespace, selector))

    def _send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, namespace: str, selector: str, query: dict[str, str]) -> None:
        owner = self.owner
        deadline = time.monotonic() + float(query.get("timeoutSeconds", 1800))
        after_rv = int(query.get("resourceVersion") or 0)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        owner.count_watch(+1)
        try:
            if after_rv == 0:  # "any version": the current state first, as the real server does
                for obj in owner.list_body(namespace, selector)["items"]:
                    self._chunk({"type": "ADDED", "object": obj})
                after_rv = owner.current_rv()
            if self._stream(namespace, selector, after_rv, deadline) and \
                    query.get("allowWatchBookmarks") in ("true", "1"):
                # the real server sends a bookmark as a watch times out
                self._chunk({"type": "BOOKMARK", "object": {
                    "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(owner.current_rv())}}})
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            pass
        finally:
            owner.count_watch(-1)
            self.close_connection = True

    def _stream(self, namespace: str, selector: str, after_rv: int, deadline: float) -> bool:
        """Sends events until the deadline (True) or a 410, a close, a gone client (False)."""
        while not self.owner.closed and not self._client_gone():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            events = self.owner.next_events(namespace, selector, after_rv, min(remaining, 0.1))
            if events is None:
                self._chunk({"type": "ERROR", "object": _status(
                    410, "Expired", f"too old resource version: {after_rv}")})
                return False
            for event in events:
                self._chunk(event)
                after_rv = int(event["object"]["metadata"]["resourceVersion"])
        return False

    def _chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _client_gone(self) -> bool:
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def api_client_for(url: str):
    """A real ``kubernetes.client.ApiClient`` aimed at the stand-in (no proxy from the env)."""
    from kubernetes import client

    configuration = client.Configuration(host=url)
    configuration.proxy = None
    return client.ApiClient(configuration)
