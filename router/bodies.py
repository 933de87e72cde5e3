"""What the proxy reads from a request body: only what routing needs, decoded partially.

The request body is parsed once by msgspec into ``RoutingFields`` (``OpenFields`` for a body the
router does not own); fields the router never reads are skipped by the parser, and the bodies
that derivation may need (``messages``, ``input``) are kept as ``msgspec.Raw`` slices, decoded only
when a session id must be derived (``router.sessions.derive``). The original bytes are what gets
forwarded, unless a client's own ``kv_transfer_params`` must be removed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from contract.errors import BadRequestError, InvalidJSONError


class OpenFields(msgspec.Struct):
    """What routing reads from any JSON object body: the session channels and the model."""

    session_id: Any = None
    vllm_xargs: Any = None
    model: Any = None


class RoutingFields(OpenFields):
    """What routing reads from the body of an inference route (the router's own contract)."""

    stream: bool | None = None
    previous_response_id: Any = None
    stream_options: Any = None
    # kept undecoded (a zero-copy slice; empty when absent) until derivation needs them
    messages: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    #: only its presence matters (a client's own P/D parameters are stripped)
    kv_transfer_params: msgspec.Raw = msgspec.Raw()


class _KVParamsOnly(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw()


_fields_decoder = msgspec.json.Decoder(RoutingFields)
_open_decoder = msgspec.json.Decoder(OpenFields)
_kv_only_decoder = msgspec.json.Decoder(_KVParamsOnly)
_object_decoder = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()


def decode_routing_fields(body: bytes) -> RoutingFields:
    """Parse the fields routing needs; a body that is not a JSON object is a 400."""
    try:
        return _fields_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidJSONError(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's nesting bound (about 1,000 levels), also for skipped fields
        raise InvalidJSONError("request body nests JSON arrays or objects too deeply; flatten it") from None


def decode_open_fields(body: bytes) -> OpenFields | None:
    """The routing fields of a body the router does not own (``/tokenize``, the routes it does not
    name): read only when the body is a JSON object; anything else (empty, multipart, not JSON)
    gives None and is the backend's to judge."""
    if body[:1] != b"{" and body[:64].lstrip()[:1] != b"{":
        return None
    try:
        return _open_decoder.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return None


def wants_stream_usage(fields: RoutingFields) -> bool:
    opts = fields.stream_options
    return isinstance(opts, dict) and opts.get("include_usage") is True


# ---------------------------------------------------------------------------- kv_transfer_params

def without_kv_transfer_params(body: bytes, fields: OpenFields | None) -> bytes | None:
    """``body`` re-encoded without its top-level ``kv_transfer_params``, or None when it has none
    (then the original bytes are forwarded).

    ``fields`` (the routing fields of an inference route) already tell whether the key is there;
    for any other route a body that cannot hold the key, even escaped, is passed over without
    parsing, and one that is not a JSON object is left to the backend to answer."""
    if isinstance(fields, RoutingFields):
        if not fields.kv_transfer_params:
            return None
    else:
        if b"kv_transfer_param" not in body and b"\\u" not in body:
            return None
        try:
            if not _kv_only_decoder.decode(body).kv_transfer_params:
                return None
        except (msgspec.MsgspecError, RecursionError):
            return None
    try:
        obj = _object_decoder.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        # parsed when its fields were skipped, not when decoded whole (e.g. a number out of range)
        raise InvalidJSONError(
            "request body carries kv_transfer_params, which this router removes, and cannot be re-encoded "
            "without them (a number out of range or an invalid string); fix the body or leave the field out"
        ) from None
    value = obj.pop("kv_transfer_params", None)
    if value is not None and not isinstance(value, dict):  # as a backend would answer it (vLLM: a dict)
        raise BadRequestError(
            f"kv_transfer_params must be an object or null, got {type(value).__name__}; this router removes "
            "client kv_transfer_params anyway (trust_client_kv_params = false), so leave the field out",
            param="kv_transfer_params",
        )
    return _encoder.encode(obj)
