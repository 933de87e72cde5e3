"""The access log: one line per proxied request, as plain text or JSON (``access_log``).

Lines go through ``logging`` on the dedicated logger ``session_router.access`` (level INFO, not
propagated to the root logger), to stderr or to ``access_log_file``. With ``access_log = "off"``
(the default) no ``AccessLog`` exists and the proxy does no work for it at all.

Fields: ``time`` (UTC, when the answer ended), ``method``, ``route`` (the router's route path, never
the client's query string), ``status`` (what the client got; 499 = the client went away),
``duration_ms``, ``ttfb_ms`` (until the backend's response head arrived; none when no backend
answered), ``backend`` (name), ``session`` (a blake2b hash of the session id, 12 hex digits: never
the id itself), ``placement`` (the placement outcome: sticky, new, spill, ...), the token counts
from the answer's ``usage`` when the router read one, and ``request_id``.

Text::

    time=2026-12-01T11:20:00.123Z method=POST route=/v1/chat/completions status=200 duration_ms=12.345
    ttfb_ms=4.101 backend=b0 session=1a2b3c4d5e6f placement=sticky prompt_tokens=120
    completion_tokens=8 cached_tokens=96 request_id=4f1c...      (one line; "-" = none)

JSON: the same keys in one object per line (``null`` = none).
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import time

import msgspec

from router.errors import ConfigError
from router.inspect import Usage

ACCESS_LOGGER = "session_router.access"
FORMATS = ("off", "text", "json")

#: values written unquoted in the text format; anything else is JSON-quoted (no log forging)
_PLAIN = re.compile(r"[!#-~]*")
_encode = msgspec.json.Encoder().encode


def session_hash(session_id: str) -> str:
    """The session id as the access log shows it: 12 hex digits of its blake2b hash."""
    return hashlib.blake2b(session_id.encode("utf-8", "surrogateescape"), digest_size=6).hexdigest()


class AccessRecord(msgspec.Struct):
    """One line of the JSON format (and the field order of the text one)."""

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


class AccessLog:
    """Writes access lines in ``fmt`` ("text" or "json") to ``path`` (empty: stderr)."""

    def __init__(self, fmt: str, path: str = "") -> None:
        if fmt not in ("text", "json"):
            raise ConfigError(f"access_log: must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.json = fmt == "json"
        self.path = path
        try:
            handler: logging.Handler = logging.FileHandler(path, encoding="utf-8") if path else \
                logging.StreamHandler(sys.stderr)
        except OSError as exc:
            raise ConfigError(f"access_log_file: cannot open {path}: {exc.strerror or exc}") from None
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.handler = handler
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # not also in the router's own log
        self.logger.addHandler(handler)
        self._second = -1
        self._stamp = ""

    def write(self, method: str, route: str, status: int, duration_s: float, ttfb_s: float | None,
              backend: str | None, session_id: str | None, placement: str | None, usage: Usage | None,
              request_id: str) -> None:
        """Log one finished request."""
        record = AccessRecord(
            time=self._now(),
            method=method,
            route=route,
            status=status,
            duration_ms=round(duration_s * 1000, 3),
            ttfb_ms=round(ttfb_s * 1000, 3) if ttfb_s is not None else None,
            backend=backend,
            session=session_hash(session_id) if session_id is not None else None,
            placement=placement,
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            completion_tokens=usage.completion_tokens if usage is not None else None,
            cached_tokens=usage.cached_tokens if usage is not None else None,
            request_id=request_id,
        )
        self.logger.info(_encode(record).decode() if self.json else _text(record))

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()

    def _now(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:  # the date part is rendered once per second
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((now - second) * 1000):03d}Z"


def _text(r: AccessRecord) -> str:
    return (
        f"time={r.time} method={r.method} route={_value(r.route)} status={r.status} duration_ms={r.duration_ms} "
        f"ttfb_ms={_value(r.ttfb_ms)} backend={_value(r.backend)} session={_value(r.session)} "
        f"placement={_value(r.placement)} prompt_tokens={_value(r.prompt_tokens)} "
        f"completion_tokens={_value(r.completion_tokens)} cached_tokens={_value(r.cached_tokens)} "
        f"request_id={_value(r.request_id)}"
    )


def _value(value: str | float | int | None) -> str:
    if value is None:
        return "-"
    if not isinstance(value, str):
        return str(value)
    if value and value != "-" and _PLAIN.fullmatch(value) is not None:
        return value
    return _encode(value).decode()
