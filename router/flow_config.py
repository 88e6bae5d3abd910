"""Flow control's configuration (``quire router`` flags, ``QUIRE_*`` variables, chart values):
whether requests wait in the router when the engines are full, how tenants are told apart,
their queues, deadlines and rate limits. Bad values raise ValueError naming the flag's field."""

from __future__ import annotations

from dataclasses import dataclass

from router.tenants import TenantPolicy, TenantTable, parse_tenants


# --gradient-limit's spellings -> its mode (a boolean, as the flag was before auto, still works)
GRADIENT_LIMIT_MODES = {"auto": "auto", "on": "on", "off": "off", "true": "on", "false": "off",
                        "1": "on", "0": "off", "yes": "on", "no": "off"}


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """Admission of requests before placement (``router.flow``)."""

    flow_control: bool = True  # False: every request goes straight to placement
    engine_slots: int = 0  # requests in flight per engine; 0: learned from its load reports
    # auto (default): only while more than one tenant or priority has demand, when the trade
    # of throughput for latency buys the others their share of speed (router.flow); on:
    # always (a latency-for-throughput trade on CPU engines); off: never. true / false too.
    gradient_limit: str = "auto"
    tenant_header: str | None = None  # HTTP header / gRPC metadata key naming the tenant
    tenants: str | None = None  # per-tenant settings: JSON / YAML text, or @path of a file
    max_queue_per_tenant: int = 256  # waiting requests per tenant (more: 429)
    queue_timeout_s: float = 0.0  # longest wait in the router (0: only the request's deadline)
    tenant_requests_per_minute: float = 0.0  # per tenant, unless its entry says (0: no limit)
    tenant_tokens_per_minute: float = 0.0  # prompt + generated tokens, the same way

    def __post_init__(self) -> None:
        def check(cond: bool, name: str, message: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {message}")

        check(self.engine_slots >= 0, "engine_slots",
              f"must be >= 0 (0: learned from the engines' load reports), got "
              f"{self.engine_slots}")
        check(self.max_queue_per_tenant >= 0, "max_queue_per_tenant",
              f"must be >= 0, got {self.max_queue_per_tenant}")
        check(self.queue_timeout_s >= 0, "queue_timeout_s",
              f"must be >= 0 (0: none), got {self.queue_timeout_s}")
        for name in ("tenant_requests_per_minute", "tenant_tokens_per_minute"):
            check(getattr(self, name) >= 0, name,
                  f"must be >= 0 (0: no limit), got {getattr(self, name)}")
        mode = GRADIENT_LIMIT_MODES.get(str(self.gradient_limit).strip().lower())
        check(mode is not None, "gradient_limit",
              f"choose from auto, on, off (or true / false), got {self.gradient_limit!r}")
        object.__setattr__(self, "gradient_limit", mode)
        check(self.tenant_header is None or bool(self.tenant_header.strip()), "tenant_header",
              "must not be empty")
        self.table()  # a bad tenants table fails at start, naming the entry

    def default_policy(self) -> TenantPolicy:
        return TenantPolicy(max_queue=self.max_queue_per_tenant,
                            requests_per_minute=self.tenant_requests_per_minute,
                            tokens_per_minute=self.tenant_tokens_per_minute)

    def table(self) -> TenantTable:
        """The tenants table (reads the file that ``tenants`` names with @)."""
        return parse_tenants(self.tenants, self.default_policy(), self.tenant_header)


FLOW_HELP = {
    "flow_control": "hold requests in the router while the engines are full, and choose what "
                    "runs next by priority and tenant (false: straight to placement)",
    "engine_slots": "requests in flight per engine (0: learned from each engine's load "
                    "reports: what it runs while it keeps requests waiting)",
    "gradient_limit": "admit fewer requests than the engines' slots where running more only "
                      "makes each one slower (per-token time grows with the batch, as on a "
                      "CPU): auto (default): only while more than one tenant or priority has "
                      "demand, so one tenant alone gets every slot; on (true): always; off "
                      "(false): never",
    "tenant_header": "HTTP header / gRPC metadata key naming the tenant (default: the API key)",
    "tenants": "per-tenant weight, priority, max_queue, requests_per_minute, "
               "tokens_per_minute and api_key_sha256: JSON or YAML, or @FILE",
    "max_queue_per_tenant": "requests a tenant may have waiting (more: 429); default for "
                            "tenants the table does not set",
    "queue_timeout_s": "longest a request waits for a slot (then 429; 0: until its deadline)",
    "tenant_requests_per_minute": "per-tenant requests a minute (0: no limit); default for "
                                  "tenants the table does not set",
    "tenant_tokens_per_minute": "per-tenant prompt + generated tokens a minute (0: no limit)",
}
