"""session-router: a session-aware router for vLLM-compatible inference backends."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: the installed distribution's version (pyproject.toml is the one place it is written)
    __version__ = version("session-router")
except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
    __version__ = "0+unknown"
