"""Placement policies: one module per policy, chosen by name in the config."""

from __future__ import annotations

from contract.errors import ConfigError
from router.placement.base import Outcome, Placement, Policy, SessionPins
from router.placement.least_loaded import LeastLoadedPolicy
from router.placement.round_robin import RoundRobinPolicy
from router.placement.session import (
    DEFAULT_STICKY_HEADROOM,
    SessionPolicy,
    load_bound,
    session_score,
    sticky_bound,
)

POLICY_NAMES = ("session", "round_robin", "least_loaded")

__all__ = [
    "POLICY_NAMES",
    "LeastLoadedPolicy",
    "Outcome",
    "Placement",
    "Policy",
    "RoundRobinPolicy",
    "SessionPins",
    "SessionPolicy",
    "load_bound",
    "make_policy",
    "session_score",
    "sticky_bound",
]


def make_policy(name: str, *, load_factor: float, reported_load_weight: float,
                sticky_headroom: int = DEFAULT_STICKY_HEADROOM) -> Policy:
    """The policy called ``name`` (``session``, ``round_robin`` or ``least_loaded``).

    Raises ``ConfigError`` for an unknown name. The numbers' ranges are the configuration
    schema's (``router.config.PlacementConfig``), checked once when the configuration loads.
    """
    if name == "session":
        return SessionPolicy(load_factor=load_factor, reported_load_weight=reported_load_weight,
                             sticky_headroom=sticky_headroom)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy(reported_load_weight=reported_load_weight)
    raise ConfigError(f"policy = {name!r}: unknown placement policy; choose one of {', '.join(POLICY_NAMES)}")
