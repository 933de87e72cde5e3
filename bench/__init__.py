"""Benchmarks and demo drivers of session-router (run as ``python -m bench.<name>``)."""
