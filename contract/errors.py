"""The one exception tree of session-router, shared by the router and the backends.

Every error a client can see is a ``SessionRouterError``; each class fixes the HTTP
status and the OpenAI ``error.type`` it maps to, and ``error_body`` renders vLLM's
error shape ``{"error": {"message", "type", "param", "code"}}`` in one place::

    SessionRouterError                      (500 InternalServerError)
     +-- ClientError                        (4xx: the request is wrong)
     |    +-- BadRequestError               400
     |    |    +-- InvalidJSONError         400  body is not the JSON the route needs
     |    |    +-- InvalidSessionIdError    400  session id breaks the contract
     |    +-- AuthenticationError           401
     |    +-- PermissionDeniedError         403
     |    +-- NotFoundError                 404
     |    +-- MethodNotAllowedError         405
     |    +-- PayloadTooLargeError          413
     +-- UpstreamError                      (5xx: a backend failed us)
     |    +-- NoHealthyBackendError         503
     |    +-- UpstreamConnectError          502
     |    +-- UpstreamStatusError           502  backend answered 5xx
     |    +-- UpstreamProtocolError         502  backend broke HTTP framing
     |    +-- UpstreamTimeoutError          504
     +-- ConfigError                        start-up only; never sent to a client
"""

from __future__ import annotations

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()


class SessionRouterError(Exception):
    status: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.error_type, self.param)


class ClientError(SessionRouterError):
    status = 400
    error_type = "BadRequestError"


class BadRequestError(ClientError):
    pass


class InvalidJSONError(BadRequestError):
    pass


class InvalidSessionIdError(BadRequestError):
    pass


class AuthenticationError(ClientError):
    status = 401
    error_type = "AuthenticationError"


class PermissionDeniedError(ClientError):
    status = 403
    error_type = "PermissionDeniedError"


class NotFoundError(ClientError):
    status = 404
    error_type = "NotFoundError"


class MethodNotAllowedError(ClientError):
    status = 405
    error_type = "MethodNotAllowedError"


class RequestTimeoutError(ClientError):
    status = 408
    error_type = "RequestTimeoutError"


class PayloadTooLargeError(ClientError):
    status = 413
    error_type = "PayloadTooLargeError"


class UpstreamError(SessionRouterError):
    status = 502
    error_type = "BadGatewayError"
    #: whether another backend may be tried for the same request
    retryable: bool = True
    #: metric label for this kind of failure
    reason: str = "protocol"


class NoHealthyBackendError(UpstreamError):
    status = 503
    error_type = "ServiceUnavailableError"
    retryable = False
    reason = "no_backend"


class UpstreamConnectError(UpstreamError):
    reason = "connect"


class UpstreamStatusError(UpstreamError):
    def __init__(self, message: str, *, upstream_status: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.upstream_status = upstream_status
        self.reason = f"status_{upstream_status}"


class UpstreamProtocolError(UpstreamError):
    pass


class UpstreamTimeoutError(UpstreamError):
    status = 504
    error_type = "GatewayTimeoutError"
    reason = "timeout"


class ConfigError(SessionRouterError):
    """A bad configuration file or flag; raised at start-up, never answered to a client."""


def error_body(status: int, message: str, error_type: str | None = None, param: str | None = None) -> bytes:
    """Render vLLM's error JSON for ``status``."""
    if error_type is None:
        error_type = _default_type(status)
    return _encoder.encode(ErrorBody(ErrorDetail(message=message, type=error_type, param=param, code=status)))


def _default_type(status: int) -> str:
    return {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        408: "RequestTimeoutError",
        413: "PayloadTooLargeError",
        502: "BadGatewayError",
        503: "ServiceUnavailableError",
        504: "GatewayTimeoutError",
    }.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")
