"""Router configuration: TOML decoded into msgspec Structs; CLI flags override the file.

Every setting has a default here, so an empty file is a valid configuration for one backend
given with ``--backend``. Unknown keys, wrong types and bad URLs stop start-up with a
``ConfigError`` that names the key.
"""

from __future__ import annotations

import msgspec

MiB = 1024 * 1024


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    name: str = ""


class TimeoutConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Upstream timeouts in seconds (httpx-style: one object, explicit defaults)."""

    connect_s: float = 5.0
    first_byte_s: float = 30.0
    total_s: float = 600.0


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"
    #: session | round_robin | least_loaded
    policy: str = "session"
    #: aggregated mode: the backends
    backends: list[BackendConfig] = []
    #: P/D mode: both lists non-empty
    prefill: list[BackendConfig] = []
    decode: list[BackendConfig] = []
    #: derive | mint | none
    stamp: str = "derive"
    load_factor: float = 1.25
    #: weight of the backends' scraped running+waiting count in the load signal (0 = own in-flight only)
    reported_load_weight: float = 0.0
    session_ttl_s: float = 3600.0
    max_sessions: int = 100_000
    session_metrics_top_k: int = 100
    max_body_bytes: int = 8 * MiB
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 30.0
    total_timeout_s: float = 600.0
    retries: int = 2
    retry_backoff_s: float = 0.05
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    #: passive ejection after this many consecutive failures; probed again (half-open) after eject_s
    eject_after_failures: int = 3
    eject_s: float = 5.0
    #: P/D: on prefill failure fall back to decode-only (true) or answer 502 (false)
    pd_fallback: bool = True
    #: bearer token for /admin; empty = admin API open (bind loopback only then)
    admin_token: str = ""
    #: serve /admin on a separate port (0 = on the data port)
    admin_port: int = 0
    drain_timeout_s: float = 30.0
    #: SO_REUSEPORT worker processes
    workers: int = 1
    #: bound on remembered Responses API ids (previous_response_id -> backend)
    max_response_ids: int = 100_000

    @property
    def timeouts(self) -> TimeoutConfig:
        return TimeoutConfig(self.connect_timeout_s, self.first_byte_timeout_s, self.total_timeout_s)

    @property
    def pd_mode(self) -> bool:
        return bool(self.prefill or self.decode)
