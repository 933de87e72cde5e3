"""session-router: a session-aware router for vLLM-compatible inference backends."""

__version__ = "0.1.0"
