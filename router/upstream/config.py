"""Timeouts and limits of the upstream connection pool (httpx-style: small explicit objects)."""

from __future__ import annotations

import msgspec

from contract.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB


class UpstreamTimeouts(msgspec.Struct, frozen=True):
    """Seconds. ``connect_s`` bounds opening a connection; ``first_byte_s`` bounds the wait for the
    response head after the request was written; ``total_s`` bounds the whole exchange, body included,
    counted from the call to ``UpstreamPool.request``."""

    connect_s: float = 5.0
    first_byte_s: float = 30.0
    total_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "first_byte_s", "total_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"upstream timeout {name} must be > 0, got {getattr(self, name)!r}")

    def capped(self, bound_s: float) -> UpstreamTimeouts:
        """These timeouts, none longer than ``bound_s``, and the whole exchange bounded by it."""
        return UpstreamTimeouts(min(self.connect_s, bound_s), min(self.first_byte_s, bound_s), bound_s)


class UpstreamLimits(msgspec.Struct, frozen=True):
    """Pool limits.

    ``max_idle_per_host``: keep-alive connections kept per backend (extra ones are closed on release).
    ``idle_timeout_s``: an idle connection older than this is closed by the sweeper.
    ``read_high_water`` / ``read_low_water``: bytes buffered in a response whose consumer is slower
    than the backend; above high water the socket stops being read, at or below low water it resumes.
    ``sweep_interval_s``: period of the one sweeper task that enforces every timeout of the pool
    (timeouts fire up to this much late).
    ``max_head_bytes``: a response head (status line and headers, 1xx heads before it included)
    larger than this fails the exchange (a 502) and closes the connection.
    ``max_body_bytes``: a body read whole (``UpstreamResponse.read``) larger than this fails the
    exchange and closes the connection; bodies consumed chunk by chunk (relayed streams) are not
    bounded by it.
    """

    max_idle_per_host: int = 256
    idle_timeout_s: float = 60.0
    read_high_water: int = 256 * KiB
    read_low_water: int = 64 * KiB
    sweep_interval_s: float = 0.1
    max_head_bytes: int = 64 * KiB
    max_body_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if self.max_idle_per_host < 0:
            raise ConfigError(f"max_idle_per_host must be >= 0, got {self.max_idle_per_host}")
        if not self.idle_timeout_s > 0:
            raise ConfigError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if not self.sweep_interval_s > 0:
            raise ConfigError(f"sweep_interval_s must be > 0, got {self.sweep_interval_s}")
        if self.max_head_bytes < 1 or self.max_body_bytes < 1:
            raise ConfigError(
                f"max_head_bytes and max_body_bytes must be >= 1, got {self.max_head_bytes} and {self.max_body_bytes}"
            )
        if self.read_high_water <= 0 or not 0 <= self.read_low_water <= self.read_high_water:
            raise ConfigError(
                f"need 0 <= read_low_water <= read_high_water and read_high_water > 0, "
                f"got low={self.read_low_water} high={self.read_high_water}"
            )
