"""Who a request belongs to, and what that tenant is allowed: weight, default priority, queue
bound and rate limits.

A request's tenant is, first match wins: the value of the header / gRPC metadata key the
operator names (``--tenant-header``), the tenant its API key is mapped to in the tenants table,
``key:<first 12 hex of the key's SHA-256>`` for any other key, or ``anonymous``. The table maps
keys by their SHA-256 so that it holds no secret.

Tenants not named in the table get the defaults (the ``default`` entry of the table, or the
flags). Their metric label is ``other``: a header value is the client's to choose, and a label
per value would let a client grow the router's metrics without bound.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

ANONYMOUS = "anonymous"
OTHER_LABEL = "other"
_POLICY_KEYS = ("weight", "priority", "min_priority", "max_queue", "requests_per_minute",
                "tokens_per_minute")
_ENTRY_KEYS = frozenset(_POLICY_KEYS) | {"api_key_sha256"}


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's share and limits. ``priority`` is the default for requests that set none
    (vLLM's 0); lower runs first. ``min_priority``: the most urgent (lowest) priority its
    requests may ask for (None: any); asking for more is refused. 0 for a rate means no
    limit."""

    weight: float = 1.0
    priority: int = 0
    min_priority: int | None = None
    max_queue: int = 256
    requests_per_minute: float = 0.0
    tokens_per_minute: float = 0.0

    def check(self, where: str) -> None:
        """Raise ValueError naming ``where`` and the field of a bad value."""
        if not (isinstance(self.weight, (int, float)) and self.weight > 0):
            raise ValueError(f"{where}.weight: must be a number > 0, got {self.weight!r}")
        if not (isinstance(self.priority, int) and -2 ** 31 <= self.priority < 2 ** 31):
            raise ValueError(f"{where}.priority: must be an int32, got {self.priority!r}")
        floor = self.min_priority
        if floor is not None:
            if not (isinstance(floor, int) and -2 ** 31 <= floor < 2 ** 31):
                raise ValueError(f"{where}.min_priority: must be an int32 or null, got "
                                 f"{floor!r}")
            if self.priority < floor:
                raise ValueError(f"{where}.priority: {self.priority} is more urgent than its "
                                 f"min_priority {floor} (set its own min_priority)")
        if not (isinstance(self.max_queue, int) and self.max_queue >= 0):
            raise ValueError(f"{where}.max_queue: must be an integer >= 0, got "
                             f"{self.max_queue!r}")
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{where}.{name}: must be a number >= 0 (0: no limit), got "
                                 f"{value!r}")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str  # the fairness and rate-limit key
    label: str  # its metric label: the name when the table lists it, else "other"
    policy: TenantPolicy


def key_digest(api_key: str) -> str:
    """The key's sha256, of its bytes as sent (a non-UTF-8 header value reaches here decoded
    with surrogateescape, as aiohttp decodes headers)."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantTable:
    """Tenants by name, and API-key digests -> tenant name."""

    default: TenantPolicy = TenantPolicy()
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    key_tenants: Mapping[str, str] = field(default_factory=dict)  # sha256 hex -> tenant
    header: str | None = None  # lower-case metadata key naming the tenant

    def resolve(self, metadata: Sequence[tuple[str, str]]) -> Tenant:
        """The tenant of a request with these (gRPC, lower-case) metadata."""
        name = None
        authorization = None
        for key, value in metadata:
            if self.header is not None and key == self.header and value:
                name = value
            elif key == "authorization":
                authorization = value
        if name is None and authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                digest = key_digest(token.strip())
                name = self.key_tenants.get(digest, f"key:{digest[:12]}")
        name = name or ANONYMOUS
        policy = self.tenants.get(name)
        if policy is None:
            return Tenant(name, OTHER_LABEL, self.default)
        return Tenant(name, name, policy)

    def priority_label(self, priority: int) -> str:
        """A priority's metric label: its value where it is 0 or a tenant's default, else
        ``other`` (a client may send any int32: one label each would grow without bound)."""
        if priority == 0 or priority == self.default.priority or any(
                priority == p.priority for p in self.tenants.values()):
            return str(priority)
        return OTHER_LABEL


def parse_tenants(text: str | None, default: TenantPolicy, header: str | None,
                  flag: str = "tenants") -> TenantTable:
    """The table from ``--tenants``: JSON (or YAML) text, or ``@path`` of a file holding it::

        {"default": {"max_queue": 64},
         "tenants": {"gold": {"weight": 4, "priority": -1, "requests_per_minute": 600,
                              "tokens_per_minute": 200000, "min_priority": -1,
                              "api_key_sha256": ["<sha256 hex of the key>"]},
                     "batch": {"weight": 1, "priority": 10}}}

    Every error is a ValueError naming the flag and the entry."""
    header = header.lower() if header else None
    if not text:
        return TenantTable(default=default, header=header)
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {text[1:]}: {e.strerror or e}") from None
    data = _load(text, flag)
    if not isinstance(data, dict) or set(data) - {"default", "tenants"}:
        raise ValueError(f"{flag}: must be an object with 'default' and / or 'tenants', got "
                         f"{_keys(data)}")
    if "default" in data:
        default = _policy(data["default"], default, f"{flag}: default", keys=_POLICY_KEYS)
    entries = data.get("tenants") or {}
    if not isinstance(entries, dict):
        raise ValueError(f"{flag}: tenants: must be an object of tenant name -> settings")
    tenants, key_tenants = {}, {}
    for name, entry in entries.items():
        where = f"{flag}: tenants.{name}"
        if not name or name == OTHER_LABEL:
            raise ValueError(f"{where}: a tenant name must be non-empty and not "
                             f"{OTHER_LABEL!r}")
        tenants[name] = _policy(entry, default, where, keys=_ENTRY_KEYS)
        digests = entry.get("api_key_sha256", [])
        if isinstance(digests, str):
            digests = [digests]
        for digest in digests:
            if not (isinstance(digest, str) and len(digest) == 64 and
                    all(c in "0123456789abcdef" for c in digest.lower())):
                raise ValueError(f"{where}.api_key_sha256: {digest!r} is not a SHA-256 hex "
                                 "digest (printf %s KEY | sha256sum)")
            if key_tenants.setdefault(digest.lower(), name) != name:
                raise ValueError(f"{where}.api_key_sha256: {digest} is also tenant "
                                 f"{key_tenants[digest.lower()]!r}'s")
    return TenantTable(default=default, tenants=tenants, key_tenants=key_tenants, header=header)


def _load(text: str, flag: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    import yaml  # JSON is YAML too: this only adds YAML's other forms

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{flag}: neither JSON nor YAML ({' '.join(str(e).split())[:200]})") \
            from None


def _keys(data) -> str:
    return repr(sorted(data)) if isinstance(data, dict) else type(data).__name__


def _policy(entry, base: TenantPolicy, where: str, *, keys) -> TenantPolicy:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object, got {type(entry).__name__}")
    unknown = set(entry) - set(keys)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {sorted(unknown)} (known: "
                         f"{sorted(keys)})")
    policy = replace(base, **{k: v for k, v in entry.items() if k in _POLICY_KEYS})
    policy.check(where)
    return policy
