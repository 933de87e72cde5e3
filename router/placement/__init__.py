"""Placement policies: one module per policy, chosen by name in the config."""
