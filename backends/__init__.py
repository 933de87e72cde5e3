"""session-backend: a vLLM-compatible inference server with an embedded, simulated engine core."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: the installed distribution's version (the same distribution as the router: session-router)
    __version__ = version("session-router")
except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
    __version__ = "0+unknown"
