"""What every generation route of session-backend shares.

``Frontend`` is the per-app state object (engine, tokenizer, ids, response store, in-flight count);
the free functions validate sampling values the way vLLM does, build the ``EngineCoreRequest``
that crosses the wire boundary, and ``GenerationRun`` folds the engine's step outputs into
per-choice results (tokens, text with stop strings applied, finish reasons, usage).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.engine.client import AsyncEngine
from backends.engine.errors import EngineDeadError
from backends.engine.outputs import EngineConfig, RequestOutput
from backends.engine.request import EngineCoreRequest, SamplingParams
from backends.protocol import PromptTokensDetails, Usage
from backends.responses_store import ResponseStore
from backends.tokenizer import Tokenizer
from contract.errors import BadRequestError, InvalidJSONError, NotFoundError
from contract.ids import IdGenerator

if TYPE_CHECKING:
    from backends.kv_transfer import KVTransfer, RemoteLoad

REQUEST_ID_HEADER = "X-Request-Id"
#: vLLM's RequestOutputKind.DELTA: each output carries only the new tokens
OUTPUT_KIND_DELTA = 1
#: vLLM's RequestOutputKind.FINAL_ONLY: one output when the request finishes (non-streaming)
OUTPUT_KIND_FINAL_ONLY = 2


def package_version() -> str:
    try:
        return metadata.version("session-router")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"


@dataclass(eq=False)
class Frontend:
    """Per-application state of the HTTP frontend (stored under ``FRONTEND`` in the app)."""

    config: EngineConfig
    tokenizer: Tokenizer
    engine: AsyncEngine
    registry: CollectorRegistry
    store: ResponseStore
    ids: IdGenerator = field(default_factory=IdGenerator)
    created: int = field(default_factory=lambda: int(time.time()))
    version: str = field(default_factory=package_version)
    #: generation requests being served now (``GET /load``)
    in_flight: int = 0
    #: P/D: the KV transfer agent (side channel, pulls, prompt-source counters); None in bare tests
    kv: "KVTransfer | None" = None

    @property
    def fingerprint(self) -> str:
        return f"session-backend-{self.version}"

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")

    def check_engine(self) -> None:
        """Fail with a 503 before a stream starts when the engine loop is not running."""
        if not self.engine.is_running:
            raise EngineDeadError("The engine is not running; this backend cannot generate. Try another backend.")

    def base_request_id(self, request: web.Request, body_request_id: str | None) -> str:
        """vLLM's order: the X-Request-Id header, else the body's request_id, else a fresh id."""
        rid = request.headers.get(REQUEST_ID_HEADER) or body_request_id or self.ids.next()
        request[REQUEST_ID_KEY] = rid
        return rid

    def engine_request_id(self, external_id: str) -> str:
        """The engine's internal id: unique even when clients reuse an X-Request-Id (as vLLM does)."""
        return f"{external_id}-{self.ids.next()[-8:]}"


#: the base request id chosen for this request, echoed as X-Request-Id by the middleware
REQUEST_ID_KEY = web.RequestKey("request_id", str)


# ---- body decoding -----------------------------------------------------------------------------


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
        raise InvalidJSONError("Request body nests JSON arrays or objects too deeply; flatten it.") from None
    try:
        data.decode("utf-8")  # msgspec does not check the strings of fields it skips; JSON is UTF-8
    except UnicodeDecodeError as exc:
        raise InvalidJSONError(f"Request body is not valid UTF-8 (bad byte at offset {exc.start}); "
                               "JSON must be UTF-8 encoded.") from None
    return result


def _param_of(message: str) -> str | None:
    # msgspec says "... - at `$.sampling_params.max_tokens`"
    mark = message.rfind("at `$.")
    if mark < 0:
        return None
    return message[mark + 6 :].rstrip("`")


# ---- validation (vLLM's rules and messages) ------------------------------------------------


def check_prompt_ids(tokenizer: Tokenizer, ids: list[int], param: str) -> None:
    if not ids:
        raise BadRequestError("The prompt cannot be empty; send at least one token.", param=param)
    bad = tokenizer.out_of_vocab(ids)
    if bad is not None:
        if bad < 0:
            raise BadRequestError(f"Token ids must be non-negative, got {bad}.", param=param)
        raise BadRequestError(
            f"Token id {bad} is out of vocabulary (the vocabulary has {tokenizer.vocab_size} ids).",
            param=param,
        )


def resolve_max_tokens(config: EngineConfig, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """Check the prompt fits and return the number of tokens to generate at most."""
    limit = config.max_model_len
    if prompt_len >= limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input.",
            param="prompt" if param == "max_tokens" else "input",
        )
    if max_tokens is None:
        return limit - prompt_len
    if max_tokens < 1:
        raise BadRequestError(f"{param} must be at least 1, got {max_tokens}.", param=param)
    if prompt_len + max_tokens > limit:
        raise BadRequestError(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is {limit} "
            f"tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {limit} - {prompt_len}).",
            param=param,
        )
    return max_tokens


def sampling_params(
    config: EngineConfig,
    *,
    n: int = 1,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_tokens: int,
    min_tokens: int = 0,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    final_only: bool = False,
) -> SamplingParams:
    """Validate sampling values (400 on a bad one) and build the engine's SamplingParams."""
    if n < 1:
        raise BadRequestError(f"n must be at least 1, got {n}.", param="n")
    if n > config.max_num_seqs:
        raise BadRequestError(
            f"n must be at most max_num_seqs ({config.max_num_seqs}), got {n}.", param="n"
        )
    if temperature is None:
        temperature = 1.0
    elif temperature < 0:
        raise BadRequestError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    if top_p is None:
        top_p = 1.0
    elif not 0.0 < top_p <= 1.0:
        raise BadRequestError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    if top_k is None:
        top_k = 0
    elif top_k < -1:
        raise BadRequestError(f"top_k must be -1 (disable), 0 or at least 1, got {top_k}.", param="top_k")
    if min_tokens < 0:
        raise BadRequestError(f"min_tokens must be non-negative, got {min_tokens}.", param="min_tokens")
    if min_tokens > max_tokens:
        raise BadRequestError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    if stop_token_ids and any(t < 0 for t in stop_token_ids):
        raise BadRequestError("stop_token_ids must be non-negative.", param="stop_token_ids")
    if stop is not None and any(not s for s in stop):
        raise BadRequestError("stop strings must not be empty.", param="stop")
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop or None,
        stop_token_ids=stop_token_ids or None,
        ignore_eos=ignore_eos,
        # stop strings are applied here, token by token, so they need every step's delta
        output_kind=OUTPUT_KIND_FINAL_ONLY if final_only and not stop else OUTPUT_KIND_DELTA,
        extra_args=extra,
    )


def stop_list(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop] if stop else None
    return stop or None


def engine_request(
    fe: Frontend,
    *,
    external_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    session_id: str | None,
    cache_salt: str | None = None,
    priority: int = 0,
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=fe.engine_request_id(external_id),
        prompt_token_ids=prompt_ids,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=cache_salt,
        data_parallel_rank=None,
        priority=priority,
        external_req_id=external_id,
        session_id=session_id,
    )


# ---- folding engine outputs --------------------------------------------------------------


class Choice:
    """One child sequence's progress as seen by the frontend."""

    __slots__ = ("index", "token_ids", "last_ids", "text", "sent", "finish_reason", "stop_reason", "done")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        #: the ids the last applied output added
        self.last_ids: list[int] = []
        #: the text so far, kept only when stop strings must be checked (else decoded at the end)
        self.text = ""
        #: how many characters of ``text`` were already streamed
        self.sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.done = False


class GenerationRun:
    """Fold ``RequestOutput``s of one request (all its children) into choices and usage.

    Stop strings are applied here (the engine works on token ids): the text is cut before the
    first stop string, the choice finishes with ``finish_reason="stop"`` and ``stop_reason`` set to
    that string, and when every choice is done the caller closes the engine stream (an abort).
    While streaming, the last ``len(longest stop) - 1`` characters are held back, so a stop string
    split across tokens is never sent.
    """

    __slots__ = (
        "tokenizer", "choices", "stops", "holdback", "prompt_tokens", "cached_tokens",
        "generated", "kv_transfer_params", "remaining", "remote",
    )

    def __init__(self, tokenizer: Tokenizer, n: int, stops: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.choices = [Choice(i) for i in range(n)]
        self.stops = stops
        self.holdback = max(len(s) for s in stops) - 1 if stops else 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        #: generated ids over all children (what the engine's accounting counts)
        self.generated = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.remaining = n
        #: P/D decode: what was pulled from a remote prefill for this request (None: nothing)
        self.remote: RemoteLoad | None = None

    def apply(self, out: RequestOutput) -> list[Choice]:
        """Take one step's output; return the choices it moved (done ones are not moved again)."""
        moved: list[Choice] = []
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        stops = self.stops
        for delta in out.deltas:
            self.generated += len(delta.token_ids)
            choice = self.choices[delta.index]
            if choice.done:
                continue
            moved.append(choice)
            choice.last_ids = delta.token_ids
            choice.token_ids += delta.token_ids
            if stops:
                self._check_stops(choice, self.tokenizer.decode(delta.token_ids))
                if choice.done:
                    continue
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                choice.stop_reason = delta.stop_reason
                choice.done = True
                self.remaining -= 1
        return moved

    def _check_stops(self, choice: Choice, new_text: str) -> None:
        start = max(0, len(choice.text) - self.holdback)
        text = choice.text = choice.text + new_text
        best = -1
        hit = ""
        for s in self.stops or ():
            idx = text.find(s, start)
            if idx >= 0 and (best < 0 or idx < best):
                best, hit = idx, s
        if best >= 0:
            choice.text = text[:best]
            choice.finish_reason = "stop"
            choice.stop_reason = hit
            choice.done = True
            self.remaining -= 1

    @property
    def finished(self) -> bool:
        return self.remaining <= 0

    def final_text(self, choice: Choice) -> str:
        if self.stops:
            return choice.text
        return self.tokenizer.decode(choice.token_ids)

    def stream_text(self, choice: Choice) -> str:
        """The text of ``choice`` that may be sent now (call once per ``apply`` that moved it)."""
        if not self.stops:
            return self.tokenizer.decode(choice.last_ids)
        limit = len(choice.text) if choice.done else len(choice.text) - self.holdback
        if limit <= choice.sent:
            return ""
        piece = choice.text[choice.sent : limit]
        choice.sent = limit
        return piece

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            total_tokens=self.prompt_tokens + self.generated,
            completion_tokens=self.generated,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )
