"""The access log: one line per proxied request, as plain text or JSON (``access_log``).

Lines go through ``logging`` on the dedicated logger ``session_router.access`` (level INFO, not
propagated to the root logger), to stderr or to ``access_log_file``. With ``access_log = "off"``
(the default) no ``AccessLog`` exists and the proxy does no work for it at all. Lines are written
in batches (a write per 64 KiB or per 0.5 s, whichever comes first, and at shutdown), not one
system call per request: a process killed outright loses at most the last half second of lines.

Fields: ``time`` (UTC, when the answer ended), ``method``, ``route`` (the router's route path, never
the client's query string), ``status`` (what the client got; 499 = the client went away),
``duration_ms``, ``ttfb_ms`` (until the backend's response head arrived; none when no backend
answered), ``backend`` (name), ``session`` (``contract.ids.session_hash`` of the session id, 16 hex
digits, the same value as the per-session metric label and ``session_hash`` in
``GET /v1/sessions/{id}``: never the id itself), ``placement`` (the placement outcome: sticky, new, spill, ...), the token counts
from the answer's ``usage`` when the router read one, and ``request_id``.

Text::

    time=2026-12-01T11:20:00.123Z method=POST route=/v1/chat/completions status=200 duration_ms=12.345
    ttfb_ms=4.101 backend=b0 session=1a2b3c4d5e6f placement=sticky prompt_tokens=120
    completion_tokens=8 cached_tokens=96 request_id=4f1c...      (one line; "-" = none)

JSON: the same keys in one object per line (``null`` = none).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TextIO

import msgspec

from contract.errors import ConfigError
from contract.ids import session_hash
from router.usage import Usage

ACCESS_LOGGER = "session_router.access"
FORMATS = ("off", "text", "json")
#: pending lines are written at least this often, and whenever this many characters are pending
FLUSH_S = 0.5
BATCH_CHARS = 64 * 1024

_encode = msgspec.json.Encoder().encode


class AccessRecord(msgspec.Struct):
    """One line of the JSON format (the text format has the same keys, in this order)."""

    time: str
    method: str
    route: str
    status: int
    duration_ms: float
    ttfb_ms: float | None
    backend: str | None
    session: str | None
    placement: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    request_id: str


class BatchingHandler(logging.Handler):
    """A handler that formats each record at once and writes the lines in batches: when
    ``BATCH_CHARS`` are pending, on ``flush()`` (the access log's timer) and on ``close()``."""

    def __init__(self, stream: TextIO, *, owned: bool) -> None:
        super().__init__()
        self.stream = stream
        self._owned = owned
        self._lines: list[str] = []
        self._size = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # the message is the line; a formatter an operator sets is applied
            line = record.getMessage() if self.formatter is None else self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._lines.append(line)
        self._size += len(line)
        if self._size >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        self.acquire()
        try:
            if not self._lines:
                return
            data = "\n".join(self._lines) + "\n"
            self._lines = []
            self._size = 0
            try:
                self.stream.write(data)
                self.stream.flush()
            except (OSError, ValueError) as exc:  # disk full, closed stream: say so, keep serving
                logging.getLogger(__name__).warning("access log: cannot write %d bytes: %s", len(data), exc)
        finally:
            self.release()

    def close(self) -> None:
        self.flush()
        if self._owned:
            self.stream.close()
        super().close()


class AccessLog:
    """Writes access lines in ``fmt`` ("text" or "json") to ``path`` (empty: stderr)."""

    def __init__(self, fmt: str, path: str = "") -> None:
        if fmt not in ("text", "json"):
            raise ConfigError(f"access_log: must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.json = fmt == "json"
        self.path = path
        if path:
            try:
                stream: TextIO = open(path, "a", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
            except OSError as exc:
                raise ConfigError(f"access_log_file: cannot open {path}: {exc.strerror or exc}") from None
            self.handler = BatchingHandler(stream, owned=True)
        else:
            self.handler = BatchingHandler(sys.stderr, owned=False)
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # not also in the router's own log
        self.logger.addHandler(self.handler)
        self._second = -1
        self._stamp = ""
        self._flush_timer: asyncio.TimerHandle | None = None

    def write(self, method: str, route: str, status: int, duration_s: float, ttfb_s: float | None,
              backend: str | None, session_id: str | None, placement: str | None, usage: Usage | None,
              request_id: str) -> None:
        """Log one finished request (from the event loop)."""
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):  # an operator turned it down through logging
            return
        now = self._now()
        session = session_hash(session_id) if session_id is not None else None
        if self.json:
            line = _encode(AccessRecord(
                time=now,
                method=method,
                route=route,
                status=status,
                duration_ms=round(duration_s * 1000, 3),
                ttfb_ms=round(ttfb_s * 1000, 3) if ttfb_s is not None else None,
                backend=backend,
                session=session,
                placement=placement,
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                completion_tokens=usage.completion_tokens if usage is not None else None,
                cached_tokens=usage.cached_tokens if usage is not None else None,
                request_id=request_id,
            )).decode()
        else:
            tokens = (f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
                      f"cached_tokens={usage.cached_tokens}" if usage is not None
                      else "prompt_tokens=- completion_tokens=- cached_tokens=-")
            line = (
                f"time={now} method={_value(method)} route={_value(route)} status={status} "
                f"duration_ms={duration_s * 1000:.3f} "
                f"ttfb_ms={f'{ttfb_s * 1000:.3f}' if ttfb_s is not None else '-'} backend={_value(backend)} "
                f"session={session or '-'} placement={placement or '-'} {tokens} request_id={_value(request_id)}"
            )
        # logger.handle: the logger's filters and handlers, without logger.info's caller lookup
        logger.handle(logger.makeRecord(ACCESS_LOGGER, logging.INFO, "", 0, line, None, None))
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._flush_timer = None
        self.handler.flush()

    def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self.logger.removeHandler(self.handler)
        self.handler.close()

    def _now(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:  # the date part is rendered once per second
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((now - second) * 1000):03d}Z"


def _value(value: str | None) -> str:
    """A text-format value: as is when it is visible ASCII without quotes, else JSON-quoted (so a
    client's request id cannot forge fields or lines); "-" for none."""
    if value is None:
        return "-"
    if value and value != "-" and value.isascii() and value.isprintable() and " " not in value \
            and '"' not in value:
        return value
    return _encode(value).decode()
