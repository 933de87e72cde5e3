"""Placement policies: one module per policy, chosen by name in the config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contract.errors import ConfigError
from router.placement.base import REASONS, Outcome, Placement, PlacementHint, Policy, SessionPins
from router.placement.kv_aware import KVAwarePolicy, KVAwareSettings, KVView
from router.placement.least_loaded import LeastLoadedPolicy
from router.placement.round_robin import RoundRobinPolicy
from router.placement.spread import PinCounts
from router.placement.session import (
    DEFAULT_STICKY_HEADROOM,
    SessionPolicy,
    load_bound,
    session_score,
    sticky_bound,
)

if TYPE_CHECKING:
    from router.config import PlacementConfig

POLICY_NAMES = ("kv_aware", "session", "round_robin", "least_loaded")

__all__ = [
    "POLICY_NAMES",
    "REASONS",
    "KVAwarePolicy",
    "KVAwareSettings",
    "KVView",
    "LeastLoadedPolicy",
    "Outcome",
    "Placement",
    "PinCounts",
    "PlacementHint",
    "Policy",
    "RoundRobinPolicy",
    "SessionPins",
    "SessionPolicy",
    "build_policy",
    "kv_aware_settings",
    "load_bound",
    "make_policy",
    "session_score",
    "sticky_bound",
]


def make_policy(name: str, *, load_factor: float, reported_load_weight: float,
                sticky_headroom: int = DEFAULT_STICKY_HEADROOM, kv_aware: KVAwareSettings | None = None,
                kv: KVView | None = None, pin_counts: PinCounts | None = None) -> Policy:
    """The policy called ``name`` (``kv_aware``, ``session``, ``round_robin`` or ``least_loaded``).

    ``kv_aware``: its settings (default ``KVAwareSettings`` with the load numbers given here), the
    router's KV index (None: no KV events) and the session table's pin counts (None: new sessions are
    not balanced by them). Raises ``ConfigError`` for an unknown name. The numbers'
    ranges are the configuration schema's (``router.config.PlacementConfig``), checked once when the
    configuration loads.
    """
    if name == "kv_aware":
        settings = kv_aware if kv_aware is not None else KVAwareSettings(
            load_factor=load_factor, sticky_headroom=sticky_headroom, reported_load_weight=reported_load_weight)
        return KVAwarePolicy(settings, kv=kv, pin_counts=pin_counts)
    if name == "session":
        return SessionPolicy(load_factor=load_factor, reported_load_weight=reported_load_weight,
                             sticky_headroom=sticky_headroom)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy(reported_load_weight=reported_load_weight)
    raise ConfigError(f"policy = {name!r}: unknown placement policy; choose one of {', '.join(POLICY_NAMES)}")


def kv_aware_settings(placement: PlacementConfig) -> KVAwareSettings:
    """The ``kv_aware`` settings of a ``[placement]`` section."""
    return KVAwareSettings(
        prefill_tokens_per_s=placement.prefill_tokens_per_s, per_request_step_s=placement.per_request_step_s,
        queued_request_s=placement.queued_request_s, move_factor=placement.move_factor,
        move_margin_s=placement.move_margin_s, kv_pressure_from=placement.kv_pressure_from,
        max_load_factor=placement.max_load_factor, load_factor=placement.load_factor,
        sticky_headroom=placement.sticky_headroom, reported_load_weight=placement.reported_load_weight,
        session_balance=placement.session_balance)


def build_policy(placement: PlacementConfig, *, kv: KVView | None = None,
                 pin_counts: PinCounts | None = None) -> Policy:
    """The policy a ``[placement]`` section names, with its settings (and for kv_aware the KV index and
    the session table's pin counts)."""
    return make_policy(placement.policy, load_factor=placement.load_factor,
                       reported_load_weight=placement.reported_load_weight,
                       sticky_headroom=placement.sticky_headroom, kv_aware=kv_aware_settings(placement), kv=kv,
                       pin_counts=pin_counts)
