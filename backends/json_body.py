"""Reading a JSON request body the way vLLM's routes do: the Content-Type checked, the bytes
decoded into a request Struct, and every fault a 400 in OpenAI's error shape that says what was
wrong (the field, for a wrong type)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from contract.errors import BadRequestError, InvalidJSONError


async def read_json_body(request: web.Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    """Read and decode a JSON request body, as vLLM's FastAPI routes do: a body sent with a
    Content-Type that is not JSON (``text/plain``, a form, ``application/octet-stream``) is a
    400; a body without a Content-Type is read as JSON."""
    content_type = request.headers.get("Content-Type")
    if content_type is not None:
        mime = content_type.split(";", 1)[0].strip().lower()
        if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
            raise BadRequestError(
                f"Content-Type {mime or content_type!r} is not JSON; send the body as application/json."
            )
    return decode_body(await request.read(), decoder)


def decode_body(data: bytes, decoder: msgspec.json.Decoder[Any]) -> Any:
    """Decode a JSON body into a request Struct; malformed JSON or wrong types are a 400."""
    if not data:
        raise InvalidJSONError("Request body is empty; send a JSON object.")
    try:
        result = decoder.decode(data)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        raise BadRequestError(f"Invalid request body: {msg}", param=_param_of(msg)) from None
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's nesting bound (about 1,000 levels), also for skipped fields
        raise too_deep() from None
    check_utf8(data)
    return result


def too_deep() -> InvalidJSONError:
    return InvalidJSONError("Request body nests JSON arrays or objects too deeply; flatten it.")


def check_utf8(data: bytes) -> None:
    """A 400 for a body that is not UTF-8 (msgspec does not check the strings of fields it skips)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSONError(f"Request body is not valid UTF-8 (bad byte at offset {exc.start}); "
                               "JSON must be UTF-8 encoded.") from None


def _param_of(message: str) -> str | None:
    # msgspec says "... - at `$.sampling_params.max_tokens`"
    mark = message.rfind("at `$.")
    if mark < 0:
        return None
    return message[mark + 6 :].rstrip("`")
