"""The engine pod's server settings (torch-free, so the CLI can build its flags cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_worker.server.threads import check_wait_policy
from quire.limits import DEFAULT_MAX_N


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the engine pod listens and what it accepts."""

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = None  # None: no metrics server; 0: any free port
    model_name: str | None = None  # None: the model as named on the command line
    max_waiting_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    max_n: int = DEFAULT_MAX_N
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_prompt_chars: int = 1 << 20
    # max_tokens above this is refused (INVALID_ARGUMENT naming max_tokens); a request that sets
    # none gets this many at most (and never more than the model's length allows). 0: no cap.
    max_tokens_limit: int = 0  # 0: none (the model's length bounds it, as vLLM)
    http_timeout_s: float = 10.0  # the metrics server drops a connection not done within this
    max_message_bytes: int = 16 << 20
    # a structured-output grammar still compiling after this many seconds is stopped (its
    # worker process killed) and its request refused, INVALID_ARGUMENT naming the field
    grammar_compile_timeout_s: float = 30.0
    # address space a grammar compile worker's compiles may take beyond what it maps after its
    # imports (RLIMIT_AS): a compile needing more is refused, INVALID_ARGUMENT naming the field,
    # instead of exhausting the host's memory; 0: no cap
    grammar_compile_memory_bytes: int = 2 << 30
    drain_timeout_s: float = 30.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: mutual TLS, clients must present a cert
    # KV events also on vLLM's ZMQ wire (for llm-d's indexer, Dynamo): the PUB endpoint to bind,
    # e.g. tcp://POD_IP:5557 or ipc:///run/quire/events.sock; None: off
    kv_events_zmq: str | None = None
    kv_events_replay: str | None = None  # its replay (ROUTER) endpoint; None: no replay
    # how idle OpenMP threads wait: default (libgomp's spin-then-sleep), passive (sleep at once,
    # so server threads sharing the cores do not stall the whole team; each parallel region pays
    # a wake-up) or active (spin); see engine_worker/server/threads.py
    omp_wait_policy: str = "default"
    # LoRA adapters loaded at run time (LoadLoRAAdapter, the router's /v1/load_lora_adapter)
    # must lie inside one of these directories (comma-separated); None: run-time loading off
    lora_adapter_dirs: str | None = None

    def __post_init__(self) -> None:
        check_wait_policy(self.omp_wait_policy)
        for name in ("kv_events_zmq", "kv_events_replay"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name}: must be a tcp:// or ipc:// endpoint, got {value!r}")
        if self.kv_events_replay and not self.kv_events_zmq:
            raise ValueError("kv_events_replay: needs kv_events_zmq")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s: must be > 0, got "
                             f"{self.grammar_compile_timeout_s}")
        if self.grammar_compile_memory_bytes != 0 and self.grammar_compile_memory_bytes < 1 << 28:
            raise ValueError("grammar_compile_memory_bytes: must be 0 (no cap) or at least 256 "
                             f"MiB ({1 << 28}), got {self.grammar_compile_memory_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be in [0, 65536), got {self.metrics_port}")
        if not 0 <= self.max_tokens_limit < 2 ** 32:
            raise ValueError(f"max_tokens_limit: must be in [0, 2**32), got "
                             f"{self.max_tokens_limit}")
        if self.http_timeout_s <= 0:
            raise ValueError(f"http_timeout_s: must be > 0, got {self.http_timeout_s}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file: TLS needs both a certificate and a key")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file: mutual TLS needs tls_cert_file/tls_key_file")
