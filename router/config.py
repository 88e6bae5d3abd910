"""Grouped, frozen, validated router configuration (torch-free).

Each group becomes command-line flags and ``QUIRE_*`` variables through ``quire.config_args``.
Bad values raise ``ValueError`` naming the field. Only this module and the CLI read the
environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from quire.limits import DEFAULT_MAX_N

DISCOVERY_KINDS = ("static", "dns", "kubernetes")
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, slots=True)
class RouterServerConfig:
    """Where the router listens and what it accepts on both fronts."""

    host: str = "0.0.0.0"
    port: int = 50050  # gRPC: quire.v1.EngineService, grpc.health.v1, reflection
    http_port: int = 8000  # OpenAI-compatible HTTP and /metrics; -1: no HTTP front
    tokenizer: str | None = None  # directory with tokenizer.json (None: the embedded model's)
    model_name: str | None = None  # served model name (None: the engines' model name)
    api_keys: str | None = None  # comma-separated; set: both fronts require one of them
    api_key_file: str | None = None  # one key per line, read at start
    max_body_bytes: int = 8 << 20  # HTTP request body limit (413 above it)
    max_message_bytes: int = 16 << 20  # gRPC message limit
    max_n: int = DEFAULT_MAX_N
    max_tokens_limit: int = 0  # larger max_tokens: 400; unset: this (0: no cap, as vLLM)
    max_prompt_chars: int = 1 << 20  # text prompts and chat messages, checked before tokenizing
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    tokenizer_threads: int = 2  # the bounded pool that tokenizes long prompts off the loop
    http_header_timeout_s: float = 10.0  # a request's headers must arrive within this
    http_body_timeout_s: float = 60.0  # and its body within this
    request_timeout_s: float = 600.0  # deadline of HTTP requests (gRPC clients set their own)
    # the Responses API's stored responses (previous_response_id, GET, background), in bytes
    # (0: store nothing, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE)
    responses_store_bytes: int = 16 << 20
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "port", f"must be in [0, 65536), got {self.port}")
        _check(-1 <= self.http_port < 65536, "http_port",
               f"must be in [-1, 65536) (-1: off), got {self.http_port}")
        for name in ("max_body_bytes", "max_message_bytes", "max_n", "max_prompt_chars",
                     "max_stop_strings", "max_stop_string_len", "tokenizer_threads"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(0 <= self.max_tokens_limit < 2 ** 32, "max_tokens_limit",
               f"must be in [0, 2**32), got {self.max_tokens_limit}")
        for name in ("request_timeout_s", "http_header_timeout_s", "http_body_timeout_s"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check(self.responses_store_bytes >= 0, "responses_store_bytes",
               f"must be >= 0 (0: off), got {self.responses_store_bytes}")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s",
               f"must be >= 0, got {self.drain_timeout_s}")

    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: auth off). Reads ``api_key_file``."""
        keys = [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    keys += [line.strip() for line in f if line.strip()]
            except OSError as e:
                raise ValueError(f"api_key_file: cannot read {self.api_key_file}: {e}") from None
        return tuple(keys)


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How the router finds engines: a static list, DNS records, or the Kubernetes API."""

    discovery: str = "static"
    engines: str = ""  # static: comma-separated host:port
    dns_name: str | None = None  # dns: e.g. the engines' headless Service name
    engine_port: int = 50051  # dns / kubernetes: the engines' gRPC port
    dns_interval_s: float = 5.0  # dns: re-resolve period
    k8s_namespace: str | None = None  # None: this pod's namespace (else "default")
    k8s_service: str | None = None  # EndpointSlices of this Service ...
    k8s_label_selector: str | None = None  # ... or of this label selector
    k8s_port_name: str = "grpc"  # EndpointSlice port name (falls back to engine_port)
    k8s_watch_timeout_s: int = 300  # a watch ends after this; the router re-lists
    # dns / kubernetes: what the discovered engines are ("quire" gRPC, or "vllm" HTTP servers
    # at engine_port); a static list names each engine's kind in its URL (vllm://host:port)
    engine_kind: str = "quire"
    vllm_kv_events_port: int | None = None  # vllm: every pod's KV-event PUB port (None: off)
    vllm_kv_replay_port: int | None = None  # vllm: every pod's replay port (None: no replay)

    def __post_init__(self) -> None:
        _check(self.discovery in DISCOVERY_KINDS, "discovery",
               f"must be one of {DISCOVERY_KINDS}, got {self.discovery!r}")
        _check(0 < self.engine_port < 65536, "engine_port",
               f"must be in (0, 65536), got {self.engine_port}")
        _check(self.dns_interval_s > 0, "dns_interval_s", f"must be > 0, got {self.dns_interval_s}")
        _check(self.k8s_watch_timeout_s >= 1, "k8s_watch_timeout_s",
               f"must be >= 1, got {self.k8s_watch_timeout_s}")
        from router.endpoint import ENGINE_KIND_NAMES, parse_engine

        _check(self.engine_kind in ENGINE_KIND_NAMES, "engine_kind",
               f"must be one of {ENGINE_KIND_NAMES}, got {self.engine_kind!r}")
        for name in ("vllm_kv_events_port", "vllm_kv_replay_port"):
            value = getattr(self, name)
            _check(value is None or 0 < value < 65536, name, f"must be in (0, 65536), got {value}")
        if self.discovery == "static":
            _check(bool(self.static_addresses()), "engines",
                   "static discovery needs at least one host:port")
            for spec in self.static_addresses():
                try:
                    address = parse_engine(spec).address
                except ValueError as e:
                    raise ValueError(str(e)) from None
                host, sep, port = address.rpartition(":")
                _check(bool(sep and host and port.isdigit()), "engines",
                       f"{spec!r} is not host:port")
        elif self.discovery == "dns":
            _check(bool(self.dns_name), "dns_name", "dns discovery needs a name to resolve")
        else:
            _check(bool(self.k8s_service) != bool(self.k8s_label_selector), "k8s_service",
                   "kubernetes discovery needs exactly one of k8s_service and k8s_label_selector")

    def static_addresses(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.engines.split(",") if a.strip())

    def namespace(self) -> str:
        if self.k8s_namespace:
            return self.k8s_namespace
        try:
            with open(_SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
                return f.read().strip() or "default"
        except OSError:
            return "default"

    def selector(self) -> str:
        """The EndpointSlice label selector."""
        if self.k8s_service:
            return f"kubernetes.io/service-name={self.k8s_service}"
        return self.k8s_label_selector or ""


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How requests are placed and retried."""

    policy: str = "prefix_aware"  # prefix_aware, least_loaded, round_robin, session_affinity
    session_header: str = "x-session-id"  # session_affinity: the key's header / metadata key
    max_attempts: int = 2  # engines tried before the first token (1: no retry)
    load_interval_ms: int = 100  # engines' load report period
    approx_index_blocks: int = 65536  # per engine, for engines whose KV-event feed is down
    vllm_block_size: int = 16  # vLLM engines' KV block size (vLLM's default; its CPU build: 128)
    prefill_tokens_per_s: float = 2000.0  # prefix_aware's estimate of an engine's prefill rate
    lora_load_s: float = 0.05  # prefix_aware: the least a LoRA adapter read is priced at
    # LoRA adapters no engine holds are loaded on demand from <dir>/<name> (a path on the
    # engines; vLLM's filesystem resolver); "": only adapters loaded through the router
    lora_resolver_dir: str = ""
    connect_timeout_s: float = 10.0
    reconnect_max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        from router.balancer import POLICIES

        _check(self.policy in POLICIES, "policy",
               f"must be one of {sorted(POLICIES)}, got {self.policy!r}")
        _check(bool(self.session_header), "session_header", "must not be empty")
        _check(self.max_attempts >= 1, "max_attempts", f"must be >= 1, got {self.max_attempts}")
        _check(self.load_interval_ms >= 10, "load_interval_ms",
               f"must be >= 10, got {self.load_interval_ms}")
        _check(self.approx_index_blocks >= 1, "approx_index_blocks",
               f"must be >= 1, got {self.approx_index_blocks}")
        _check(self.vllm_block_size >= 1, "vllm_block_size",
               f"must be >= 1, got {self.vllm_block_size}")
        _check(self.prefill_tokens_per_s > 0, "prefill_tokens_per_s",
               f"must be > 0, got {self.prefill_tokens_per_s}")
        _check(self.lora_load_s >= 0, "lora_load_s", f"must be >= 0, got {self.lora_load_s}")
        _check(self.connect_timeout_s > 0, "connect_timeout_s",
               f"must be > 0, got {self.connect_timeout_s}")
        _check(self.reconnect_max_backoff_s > 0, "reconnect_max_backoff_s",
               f"must be > 0, got {self.reconnect_max_backoff_s}")


@dataclass(frozen=True, slots=True)
class EngineTLSConfig:
    """TLS from the router to the engines (off when no CA is given)."""

    engine_tls_ca_file: str | None = None  # set: TLS, engines' certificates checked against it
    engine_tls_cert_file: str | None = None  # with key: the router's client cert (mutual TLS)
    engine_tls_key_file: str | None = None
    engine_tls_server_name: str | None = None  # override the name checked in engine certs

    def __post_init__(self) -> None:
        _check((self.engine_tls_cert_file is None) == (self.engine_tls_key_file is None),
               "engine_tls_cert_file", "a client certificate needs both cert and key files")
        _check(self.engine_tls_ca_file is not None or self.engine_tls_cert_file is None,
               "engine_tls_ca_file", "mutual TLS to engines needs engine_tls_ca_file too")

    @property
    def enabled(self) -> bool:
        return self.engine_tls_ca_file is not None

    def credentials(self):
        """``grpc.ChannelCredentials`` (None when TLS is off)."""
        if not self.enabled:
            return None
        import grpc

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise ValueError(f"engine_tls: cannot read {path}: {e}") from None

        return grpc.ssl_channel_credentials(read(self.engine_tls_ca_file),
                                            read(self.engine_tls_key_file),
                                            read(self.engine_tls_cert_file))



HELP = {
    "port": "gRPC port (quire.v1.EngineService, grpc.health.v1, reflection)",
    "http_port": "OpenAI-compatible HTTP port, also /health, /metrics, /debug/decisions (-1: off)",
    "tokenizer": "directory with tokenizer.json (default: fetched from the first engine)",
    "model_name": "model name served on the OpenAI API (default: the engines')",
    "api_keys": "comma-separated API keys; set: both fronts require 'Bearer <key>'",
    "api_key_file": "file with one API key per line",
    "max_tokens_limit": "largest max_tokens accepted (larger: 400) and the default when a "
                        "request sets none (0: only the engines' limits)",
    "max_prompt_chars": "longest text prompt / chat conversation in characters, checked before "
                        "tokenizing",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_len": "longest stop string in characters",
    "tokenizer_threads": "threads that tokenize long prompts off the event loop",
    "http_header_timeout_s": "HTTP: a request's headers must arrive within this (slow clients "
                             "are disconnected)",
    "http_body_timeout_s": "HTTP: a request's body must arrive within this (408 otherwise)",
    "request_timeout_s": "deadline of HTTP requests (background Responses too, queueing "
                         "included)",
    "responses_store_bytes": "the Responses API's stored responses (previous_response_id, GET, "
                             "background), bytes of JSON kept per router process (0: off)",
    "drain_timeout_s": "on SIGTERM, how long in-flight requests may finish",
    "discovery": "static, dns or kubernetes",
    "engines": "static discovery: comma-separated engines: host:port (a Quire engine) or "
               "vllm://host:port?kv_events=tcp://host:5557&kv_replay=tcp://host:5558 (a vLLM "
               "server and its KV-event endpoints)",
    "engine_kind": "dns / kubernetes discovery: quire, or vllm (vLLM's OpenAI server at "
                   "engine_port)",
    "vllm_kv_events_port": "dns / kubernetes with engine_kind vllm: every pod's KV-event port",
    "vllm_kv_replay_port": "dns / kubernetes with engine_kind vllm: every pod's replay port",
    "vllm_block_size": "vLLM engines' KV block size (vLLM does not report it; its CPU build "
                       "uses 128, GPU builds 16); KV events override it",
    "dns_name": "dns discovery: name to resolve (e.g. the engines' headless Service)",
    "engine_port": "dns / kubernetes discovery: the engines' gRPC port",
    "k8s_namespace": "kubernetes discovery: namespace (default: this pod's)",
    "k8s_service": "kubernetes discovery: watch this Service's EndpointSlices",
    "k8s_label_selector": "kubernetes discovery: or EndpointSlices with this label selector",
    "k8s_port_name": "kubernetes discovery: EndpointSlice port name of the engines' gRPC port",
    "policy": "prefix_aware, least_loaded, round_robin, session_affinity or prefix_affinity",
    "session_header": "session_affinity: HTTP header / gRPC metadata key of the session",
    "max_attempts": "engines tried before the first token (1: no retry)",
    "approx_index_blocks": "per engine, blocks remembered for engines whose KV feed is down",
    "prefill_tokens_per_s": "prefix_aware: assumed prefill rate of an engine",
    "lora_load_s": "prefix_aware: seconds a LoRA adapter read costs on an engine whose host "
                   "memory does not hold it, at least (a Quire engine's measured read time "
                   "when longer)",
    "lora_resolver_dir": "a request naming a LoRA adapter no engine holds loads it from "
                         "DIR/<name> (a directory on the engines, inside their "
                         "--lora-adapter-dirs) on the engine where it costs least, as vLLM's "
                         "filesystem resolver; unset: such a request is a 404",
    "engine_tls_ca_file": "TLS to engines: CA bundle that signs their certificates",
    "engine_tls_cert_file": "mutual TLS to engines: the router's client certificate",
    "engine_tls_key_file": "mutual TLS to engines: the router's client key",
    "engine_tls_server_name": "TLS to engines: name expected in their certificates",
}
