"""The engine pod's server settings (torch-free, so the CLI can build its flags cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

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
    max_message_bytes: int = 16 << 20
    drain_timeout_s: float = 30.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: mutual TLS, clients must present a cert

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file: TLS needs both a certificate and a key")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file: mutual TLS needs tls_cert_file/tls_key_file")
