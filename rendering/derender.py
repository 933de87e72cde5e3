"""Generate answers -> OpenAI answers: the coordinator's derender, as vLLM's own routes answer.

One ``ChatDerender`` / ``CompletionDerender`` per client request. Each choice (``n > 1``, and
per prompt for completions) has its own ``IncrementalDetokenizer`` and ``StopStrings``; ids are
taken one at a time, so the text, the stop-string match and the token count do not depend on
how the engine grouped ids into stream events (a whole answer and a stream give the same text).

- ``whole(response)``: a non-stream generate answer -> the ``chat.completion`` JSON bytes.
- ``chunk(event)``: one generate stream event -> the SSE bytes to send now (maybe ``b""``); the
  role events go out before the first content (``start()`` sends them earlier if wanted).
- ``finish()``: the usage event (``stream_options.include_usage``) and ``data: [DONE]``.
- ``collect(event)`` + ``collected()``: a stream from the engine answered as one whole answer
  (a non-stream client with stop strings: the router can abort the engine as soon as they hit).
- ``stopped``: a stop string ended every choice still running: the engine must be aborted
  (``POST /inference/v1/abort_requests``); later events are ignored.

Usage: ``prompt_tokens`` from the engine's usage when it sends one (else the prompt's length);
with ``prompt_tokens_details=True`` (vLLM's ``--enable-prompt-tokens-details``; off by default, as in
vLLM) the whole answer's and the usage event's ``usage`` carry ``prompt_tokens_details.cached_tokens``
from the engine's usage when it reports cached prompt tokens (none cached: null, as vLLM);
``completion_tokens`` counts the ids each choice consumed: every id up to and including the one
that completed a stop string (as vLLM's engine, which stops there), none after it.

An engine that ended a choice on a stop token (``finish_reason: "stop"`` with the id as
``stop_reason``, or on EOS) has that last id left out of the text unless
``include_stop_str_in_output``, as vLLM's detokenizer does. ``logprobs`` are named from the
engine's token-id logprobs (``rendering.derender_logprobs``) for the ids each choice consumed;
with completions ``echo`` they cover the generated tokens only (no prompt logprobs). Tool calls
and reasoning parsers are not applied.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET as _UNSET_MARK  # the generate Structs' "not sent"

from contract.errors import UpstreamProtocolError
from rendering.detokenize import IncrementalDetokenizer
from rendering.derender_logprobs import LogprobNamer
from rendering.generate_response import (
    GenerateLogProbs,
    GenerateUsage,
    PromptTokensDetails,
    GenerateLogProbsContent,
    GenerateResponse,
    GenerateStreamChunk,
    RunningStep,
    StreamError,
    running_steps,
)
from rendering.model import RenderModel
from rendering.openai_objects import (
    DONE_EVENT,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    CompletionStreamChoice,
    DeltaMessage,
    StreamUsage,
    UsageInfo,
    encode,
    sse_event,
)
from rendering.requests import ChatRequest, CompletionRequest
from rendering.stop_strings import StopStrings, stop_list

__all__ = ["ChatDerender", "ChoiceText", "CompletionDerender", "DerenderOptions", "echo_texts"]

#: the end of a chat event for a choice still running (no token ids, no usage)
_RUNNING_TAIL = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
#: the end of a completions event for a choice still running (no logprobs, no ids, no usage)
_RUNNING_COMPLETION_TAIL = (b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
                            b'"token_ids":null}]}\n\n')


@dataclass(slots=True)
class DerenderOptions:
    """The request fields derender reads (``from_chat`` / ``from_completion`` take them). Read-only by
    convention (not ``frozen``: a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, ~3 µs of every tokens-mode request against ~0.7 µs)."""

    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_tokens: int = 0
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    #: chat: the role of the answer ("assistant", or the last message's role without a
    #: generation prompt)
    role: str = "assistant"
    #: chat ``echo``: the text prepended to each answer (the last message when its role is the
    #: answer's role); completions ``echo``: whether to prepend the prompt
    echo_text: str | None = None
    echo: bool = False
    #: completions ``echo`` with ``max_tokens: 0``: the answer is the prompt alone
    echo_only: bool = False
    #: answer logprobs (chat ``logprobs: true``; completions ``logprobs: k``)
    logprobs: bool = False
    #: chat: how many ``top_logprobs`` to list per token
    top_logprobs: int = 0
    #: ``return_tokens_as_token_ids``: name tokens ``token_id:<id>``
    tokens_as_ids: bool = False

    @classmethod
    def from_chat(cls, chat: ChatRequest) -> DerenderOptions:
        role = "assistant"
        if not chat.add_generation_prompt and chat.messages:
            role = chat.messages[-1].role
        echo_text = None
        if chat.echo and chat.messages and chat.messages[-1].role == role:
            echo_text = _message_text(chat.messages[-1].content)
        return cls(
            **_shared_options(chat),
            role=role,
            echo_text=echo_text or None,
            logprobs=bool(chat.logprobs),
            top_logprobs=chat.top_logprobs or 0,
            tokens_as_ids=bool(chat.return_tokens_as_token_ids),
        )

    @classmethod
    def from_completion(cls, request: CompletionRequest) -> DerenderOptions:
        return cls(
            **_shared_options(request),
            echo=request.echo,
            echo_only=request.echo and request.max_tokens == 0,
            logprobs=request.logprobs is not None,
            tokens_as_ids=bool(request.return_tokens_as_token_ids),
        )


def _shared_options(request: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The options chat and completions requests set alike (``DerenderOptions``' fields by name)."""
    opts = request.stream_options
    usage = bool(request.stream) and opts is not None and bool(opts.include_usage)
    return {
        "n": request.n or 1,
        "stop": stop_list(request.stop),
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "min_tokens": request.min_tokens,
        "include_usage": usage,
        "continuous_usage": opts is not None and usage and bool(opts.continuous_usage_stats),
        "return_token_ids": bool(request.return_token_ids),
    }


def echo_texts(model: RenderModel, prompt: object, prompt_ids: Sequence[Sequence[int]]) -> list[str]:
    """The prompts as text, for completions ``echo`` (``CompletionDerender``'s ``prompt_texts``): as
    sent when they were text, else decoded from their ids (special tokens kept, as vLLM echoes them)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [model.tokenizer.decode(list(ids), skip_special_tokens=False) for ids in prompt_ids]


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if getattr(part, "text", None) is not None)


class ChoiceText:
    """One choice's text: detokenizer, stop strings, token count, end (``take`` one step's ids at a time).

    Derender's own, and the backends' where an engine answers text itself (a tokens-in request's
    ``output_mode: "text"``, stop strings on an engine that detokenizes, the Responses route)."""

    __slots__ = ("_detok", "_stops", "_min_tokens", "_include", "_eos", "tokens", "done", "finish_reason",
                 "stop_reason", "by_stop_string", "parts", "namer", "lp_entries", "lp_offset")

    def __init__(self, model: RenderModel, options: DerenderOptions, prompt_ids: Sequence[int] | None,
                 keep_text: bool) -> None:
        self._detok = IncrementalDetokenizer(
            model.tokenizer,
            prompt_ids=prompt_ids,
            skip_special_tokens=options.skip_special_tokens,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
            one_shot=model.byte_level_decoder,
            clean_texts=model.clean_step_texts,
        )
        self._stops = (
            StopStrings(options.stop, include_stop_str_in_output=options.include_stop_str_in_output)
            if options.stop else None
        )
        self._min_tokens = options.min_tokens
        self._include = options.include_stop_str_in_output
        self._eos = model.eos_token_id
        self.tokens = 0
        self.done = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        #: ended by a stop string here (the engine may still be generating)
        self.by_stop_string = False
        #: the whole text so far, for whole answers (None while streaming)
        self.parts: list[str] | None = [] if keep_text else None
        #: names the tokens of this choice's logprobs (None when not asked for)
        self.namer = (LogprobNamer(model.tokenizer, as_token_ids=options.tokens_as_ids)
                      if options.logprobs else None)
        #: whole answers: the logprob entries of the consumed ids (None while none came)
        self.lp_entries: list[GenerateLogProbsContent] | None = None
        #: completions' streamed ``text_offset``: runs on by the named tokens' lengths (not by the
        #: text sent, which lags while stop strings hold characters back), as vLLM 0.32 counts
        self.lp_offset = 0

    def step_logprobs(self, logprobs: GenerateLogProbs | None,
                      consumed: list[int]) -> list[GenerateLogProbsContent] | None:
        """The logprob entries of the ids this step consumed (kept for a whole answer too)."""
        if self.namer is None or logprobs is None or logprobs.content is None:
            return None
        entries = logprobs.content[: len(consumed)]
        if self.parts is not None:
            if self.lp_entries is None:
                self.lp_entries = []
            self.lp_entries.extend(entries)
        return entries

    def take_logged(self, ids: list[int] | None, finish_reason: str | None, stop_reason: Any,
                    logprobs: GenerateLogProbs | None) -> list[int]:
        """``take`` for a whole answer (the text stays in the choice), the step's logprobs kept with
        it: the ids consumed."""
        _, consumed = self.take(ids, finish_reason, stop_reason)
        self.step_logprobs(logprobs, consumed)
        return consumed

    def take(self, ids: list[int] | None, finish_reason: str | None,
             stop_reason: Any) -> tuple[str, list[int]]:
        """Consume one step's ids; answer the text to send and the ids consumed."""
        if ids is None:
            ids = []
        stops = self._stops
        if finish_reason is None and stops is None:  # the common step: no end, no stop strings
            return self.take_running(ids), ids
        decode = len(ids)
        if (finish_reason == "stop" and ids and not self._include
                and self._is_stop_token(ids[-1], stop_reason)):
            decode -= 1  # vLLM leaves the stop token's own text out
        if stops is None:  # and finish_reason is set: these are the choice's last ids
            text = self._detok.push_final(ids[:decode] if decode < len(ids) else ids)
            self.tokens += len(ids)
            consumed = ids
        else:
            pieces: list[str] = []
            push_one = self._detok.push_one
            feed = stops.feed
            count = 0
            for token_id in ids:
                count += 1
                self.tokens += 1
                if count > decode:
                    break
                piece = push_one(token_id)
                if piece:
                    out = feed(piece, check=self.tokens > self._min_tokens)
                    if out:
                        pieces.append(out)
                    if stops.matched is not None:
                        break
            consumed = ids if count == len(ids) else ids[:count]
            if stops.matched is not None:
                self.done = True
                self.by_stop_string = True
                self.finish_reason = "stop"
                self.stop_reason = stops.matched
            elif finish_reason is not None:
                pieces.append(stops.flush())
            text = "".join(pieces)
        if finish_reason is not None and not self.done:
            self.done = True
            self.finish_reason = finish_reason
            self.stop_reason = None if stop_reason is _UNSET_MARK else stop_reason
        if self.parts is not None and text:
            self.parts.append(text)
        return text, consumed

    def take_running(self, ids: list[int]) -> str:
        """``take`` of a step that ends nothing, when the choice has no stop strings (``plain``): the text."""
        self.tokens += len(ids)
        text = self._detok.push_one(ids[0]) if len(ids) == 1 else self._detok.push(ids)
        if self.parts is not None and text:
            self.parts.append(text)
        return text

    def take_running_steps(self, steps: list[list[int]]) -> list[str]:
        """``take_running`` of several steps in turn: their texts."""
        self.tokens += sum(map(len, steps))
        texts = self._detok.push_steps(steps)
        if self.parts is not None:
            self.parts.extend(text for text in texts if text)
        return texts

    @property
    def plain(self) -> bool:
        """No stop strings watch this choice: a step that ends nothing may be ``take_running``."""
        return self._stops is None

    def _is_stop_token(self, last: int, stop_reason: Any) -> bool:
        if isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
            return stop_reason == last
        return stop_reason in (None, _UNSET_MARK) and self._eos is not None and last == self._eos

    def text(self) -> str:
        return "".join(self.parts) if self.parts else ""


class _Base:
    """What chat and completions derender share: choices, usage, the stream's life."""

    def __init__(self, model: RenderModel, options: DerenderOptions, *, request_id: str, created: int | None,
                 prompt_tokens: int, system_fingerprint: str | None, prompt_tokens_details: bool = False) -> None:
        self.model = model
        #: vLLM's ``enable_prompt_tokens_details``: report the engine's cached prompt tokens in ``usage``
        self.prompt_tokens_details = prompt_tokens_details
        #: cached prompt tokens the engine reported, per prompt
        self._cached: dict[int, int] = {}
        #: vLLM's ``system_fingerprint`` ("vllm-<version>-<hash8>" of the engine's config; None, as
        #: the derender route and ``--fingerprint-mode none`` answer, unless the caller has one)
        self.system_fingerprint = system_fingerprint
        self.options = options
        self.request_id = request_id
        self.created = int(time.time()) if created is None else created
        self.prompt_tokens = prompt_tokens
        self.failed = False
        #: the engine's error event, when one arrived
        self.error: StreamError | None = None
        self._choices: dict[int, ChoiceText] = {}
        #: running stream events carry nothing but the text (each kind sets it after this)
        self._plain = False

    # -- shared state ----------------------------------------------------------------------------

    def _new_choice(self, prompt_ids: Sequence[int] | None, keep_text: bool) -> ChoiceText:
        return ChoiceText(self.model, self.options, prompt_ids, keep_text)

    def _lean_steps(self, datas: list[bytes]) -> tuple[ChoiceText, list[RunningStep]] | None:
        """For ``running``: the leading running steps of ``datas`` (``running_steps``) and their choice, when
        the stream is plain and that choice is under way without stop strings; None otherwise."""
        if not self._plain or self.failed:
            return None
        steps = running_steps(datas)
        if not steps:
            return None
        choice = self._choices.get(steps[0].index)
        if choice is None or choice.done or not choice.plain:
            return None
        return choice, steps

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self._choices.values())

    @property
    def finished(self) -> bool:
        """Every choice has ended (by the engine or by a stop string)."""
        return bool(self._choices) and all(c.done for c in self._choices.values()) and len(self._choices) >= self._expected

    @property
    def stopped(self) -> bool:
        """A stop string ended choices and none is left running: abort the engine request."""
        return self.finished and any(c.by_stop_string for c in self._choices.values())

    @property
    def _expected(self) -> int:
        return self.options.n

    def _note_cached(self, usage: GenerateUsage | None, prompt: int = 0) -> None:
        """Keep the engine's cached prompt tokens (only when they are reported in answers)."""
        if self.prompt_tokens_details and usage is not None:
            details = usage.prompt_tokens_details
            if isinstance(details, PromptTokensDetails):
                self._cached[prompt] = details.cached_tokens

    def _details(self) -> PromptTokensDetails | None:
        cached = sum(self._cached.values())
        return PromptTokensDetails(cached_tokens=cached) if cached else None

    def _whole_usage(self) -> UsageInfo:
        completion = self.completion_tokens
        return UsageInfo(prompt_tokens=self.prompt_tokens, total_tokens=self.prompt_tokens + completion,
                         completion_tokens=completion, prompt_tokens_details=self._details())

    def _final_usage(self) -> StreamUsage:
        """The usage event's ``usage`` (nulls left out)."""
        completion = self.completion_tokens
        details = self._details()
        return StreamUsage(prompt_tokens=self.prompt_tokens, total_tokens=self.prompt_tokens + completion,
                           completion_tokens=completion,
                           prompt_tokens_details=_UNSET_MARK if details is None else details)

    def _stream_usage(self, completion: int) -> bytes:
        """A chat event's continuous usage (vLLM sets ``completion_tokens_details`` there); the
        bytes ``StreamUsage(..., completion_tokens_details=None)`` encodes to."""
        prompt = self.prompt_tokens
        return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"completion_tokens_details":null}' % (
            prompt, prompt + completion, completion)

    def _fail(self, error: StreamError) -> None:
        """The engine sent an error event: the answer is that error."""
        self.failed = True
        self.error = error

    def _error_event(self, error: StreamError) -> bytes:
        self._fail(error)
        return b'data: {"error":' + encode(error) + b"}\n\n"


class ChatDerender(_Base):
    """``chat.completion`` / ``chat.completion.chunk`` answers for one chat request."""

    def __init__(self, model: RenderModel, chat: ChatRequest | DerenderOptions, *, request_id: str,
                 created: int | None = None, prompt_ids: Sequence[int] | None = None,
                 prompt_tokens: int | None = None, system_fingerprint: str | None = None,
                 prompt_tokens_details: bool = False) -> None:
        options = chat if isinstance(chat, DerenderOptions) else DerenderOptions.from_chat(chat)
        if prompt_tokens is None:
            prompt_tokens = len(prompt_ids) if prompt_ids is not None else 0
        super().__init__(model, options, request_id=request_id, created=created, prompt_tokens=prompt_tokens,
                         system_fingerprint=system_fingerprint, prompt_tokens_details=prompt_tokens_details)
        self._prompt_ids = prompt_ids  # not copied: a prompt can be 100k ids
        self._role_sent = False
        self._collecting = False
        self._collected_ids: dict[int, list[int]] = {}
        self._collected_kv: dict[str, Any] | None = None
        #: no token ids and no usage in running events: those are constant bytes around the text
        self._plain = not (self.options.return_token_ids or self.options.continuous_usage or self.options.logprobs)
        self._heads: dict[int, bytes] = {}
        self._head = b""  # made at the first content event (a whole answer needs none)

    def _choice(self, index: int) -> ChoiceText:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = self._new_choice(self._prompt_ids, self._collecting)
        return choice

    # -- whole answers ---------------------------------------------------------------------------

    def whole(self, response: GenerateResponse) -> bytes:
        """The ``chat.completion`` for a non-stream generate answer."""
        self._collecting = True
        if response.usage is not None and response.usage.prompt_tokens:
            self.prompt_tokens = response.usage.prompt_tokens
        self._note_cached(response.usage)
        ids_of: dict[int, list[int]] = {}
        for gc in sorted(response.choices, key=_index):
            choice = self._choice(gc.index)
            ids_of[gc.index] = choice.take_logged(gc.token_ids, gc.finish_reason or "stop", gc.stop_reason,
                                                  gc.logprobs)
        return self._whole_bytes(ids_of, response.kv_transfer_params, _ec(response.ec_transfer_params))

    def collect(self, chunk: GenerateStreamChunk) -> None:
        """Take one generate stream event for a whole answer (see ``collected``)."""
        self._collecting = True
        if chunk.error is not _UNSET_MARK:
            self._fail(chunk.error)
            return
        if chunk.usage is not None and chunk.usage.prompt_tokens:
            self.prompt_tokens = chunk.usage.prompt_tokens
        self._note_cached(chunk.usage)
        for gc in chunk.choices:
            choice = self._choice(gc.index)
            if choice.done:
                continue
            consumed = choice.take_logged(gc.token_ids, gc.finish_reason, gc.stop_reason, gc.logprobs)
            self._collected_ids.setdefault(gc.index, []).extend(consumed)
        if chunk.kv_transfer_params is not _UNSET_MARK:
            self._collected_kv = chunk.kv_transfer_params

    def collected(self) -> bytes:
        """The ``chat.completion`` for the events ``collect`` took.

        Raises ``UpstreamProtocolError`` when the engine sent an error event instead.
        """
        if self.error is not None:
            raise UpstreamProtocolError(f"the engine failed while generating: {self.error.message}")
        for choice in self._choices.values():
            if not choice.done:  # the stream ended without a finish: send what was held back
                choice.take(None, "stop", None)
        return self._whole_bytes(self._collected_ids, self._collected_kv, None)

    def _whole_bytes(self, ids_of: dict[int, list[int]], kv: dict[str, Any] | None,
                     ec: dict[str, Any] | None) -> bytes:
        opts = self.options
        echo = opts.echo_text or ""
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            logprobs = None
            if choice.namer is not None and choice.lp_entries is not None:
                logprobs = choice.namer.chat(choice.lp_entries, opts.top_logprobs)
            choices.append(ChatCompletionChoice(
                index=index,
                message=ChatMessage(role=opts.role, content=echo + choice.text()),
                logprobs=logprobs,
                finish_reason=choice.finish_reason if choice.finish_reason is not None else "stop",
                stop_reason=choice.stop_reason,
                token_ids=ids_of.get(index, []) if opts.return_token_ids else None,
            ))
        return encode(ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model.name,
            choices=choices,
            system_fingerprint=self.system_fingerprint,
            usage=self._whole_usage(),
            prompt_token_ids=list(self._prompt_ids or ()) if opts.return_token_ids else None,
            kv_transfer_params=kv,
            ec_transfer_params=ec,
        ))

    # -- streams ---------------------------------------------------------------------------------

    def start(self) -> bytes:
        """The first events: one role event per choice (and the echo), once."""
        if self._role_sent:
            return b""
        self._role_sent = True
        opts = self.options
        usage = StreamUsage(prompt_tokens=self.prompt_tokens, total_tokens=self.prompt_tokens,
                            completion_tokens=0, completion_tokens_details=None) if opts.continuous_usage else _UNSET_MARK
        prompt_ids = list(self._prompt_ids or ()) if opts.return_token_ids else None
        out = []
        for i in range(opts.n):
            out.append(sse_event(ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.model.name,
                choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role=opts.role, content=""))],
                usage=usage, prompt_token_ids=prompt_ids, prompt_text=None,
            )))
        if opts.echo_text:
            for i in range(opts.n):
                out.append(sse_event(ChatCompletionChunk(
                    id=self.request_id, created=self.created, model=self.model.name,
                    choices=[ChatStreamChoice(index=i, delta=DeltaMessage(content=opts.echo_text))],
                    usage=usage,
                )))
        return b"".join(out)

    def chunk(self, chunk: GenerateStreamChunk) -> bytes:
        """The SSE bytes for one generate stream event (``b""`` when there is nothing to send)."""
        if self.failed:
            return b""
        if chunk.error is not _UNSET_MARK:
            return self._error_event(chunk.error)
        if chunk.usage is not None:
            if chunk.usage.prompt_tokens:
                self.prompt_tokens = chunk.usage.prompt_tokens
            self._note_cached(chunk.usage)
        if not chunk.choices:
            return b""
        out = [] if self._role_sent else [self.start()]
        for gc in chunk.choices:
            event = self._event(gc.index, gc.token_ids, gc.finish_reason, gc.stop_reason, gc.logprobs)
            if event:
                out.append(event)
        return out[0] if len(out) == 1 else b"".join(out)

    def running(self, datas: list[bytes]) -> tuple[bytes, int]:
        """``chunk`` of the leading events of ``datas`` (their JSON, in order) that are the bulk of a
        stream: running steps, with only new token ids, of choices already under way and without stop
        strings, on a stream whose running events hold nothing but the text. Decoded lean and written
        around the text, byte for byte as ``chunk`` writes them: their SSE bytes, and how many events
        that was. The caller decodes the others in full (``decode_stream_chunk``) for ``chunk``."""
        lean = self._lean_steps(datas) if self._role_sent else None
        head = self._heads.get(lean[1][0].index) if lean is not None else None
        if lean is None or head is None:  # no head: the choice has not sent content yet
            return b"", 0
        choice, steps = lean
        texts = choice.take_running_steps([step.token_ids for step in steps])
        return b"".join([head + encode(text) + _RUNNING_TAIL for text in texts]), len(steps)

    def step(self, index: int, token_ids: list[int], finish_reason: str | None = None,
             stop_reason: Any = _UNSET_MARK) -> bytes:
        """``chunk`` for one choice's step (no logprobs), without a ``GenerateStreamChunk``: for an engine in
        the same process (the backends' text routes), per token."""
        if self.failed:
            return b""
        event = self._event(index, token_ids, finish_reason, stop_reason, None)
        return event if self._role_sent else self.start() + event

    def _event(self, index: int, token_ids: list[int] | None, finish_reason: str | None, stop_reason: Any,
               logprobs_in: GenerateLogProbs | None) -> bytes:
        """The SSE event of one choice's step (``b""``: nothing to send)."""
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choice(index)
        elif choice.done:
            return b""
        text, consumed = choice.take(token_ids, finish_reason, stop_reason)
        if not text and not consumed and not choice.tokens and not choice.done:
            return b""
        if self._plain and not choice.done:  # the common event: pre-encoded around the text
            return self._content_head(index) + encode(text) + _RUNNING_TAIL
        token_ids_out = encode(consumed) if self.options.return_token_ids else b"null"
        entries = choice.step_logprobs(logprobs_in, consumed)
        logprobs = (b"null" if entries is None or choice.namer is None
                    else encode(choice.namer.chat(entries, self.options.top_logprobs)))
        if choice.done:
            tail = (b'},"logprobs":' + logprobs + b',"finish_reason":' + encode(choice.finish_reason)
                    + b',"stop_reason":' + encode(choice.stop_reason) + b',"token_ids":' + token_ids_out + b"}]")
        else:
            tail = b'},"logprobs":' + logprobs + b',"finish_reason":null,"token_ids":' + token_ids_out + b"}]"
        if self.options.continuous_usage:
            tail += b',"usage":' + self._stream_usage(choice.tokens)
        if choice.done and self.system_fingerprint is not None and not self.options.include_usage:
            tail += b',"system_fingerprint":' + encode(self.system_fingerprint)
        return self._content_head(index) + encode(text) + tail + b"}\n\n"

    def _content_head(self, index: int) -> bytes:
        head = self._heads.get(index)
        if head is None and not self._heads:  # the first content event: the bytes every one starts with
            self._head = (b'data: {"id":' + encode(self.request_id) + b',"object":"chat.completion.chunk","created":'
                          + str(self.created).encode() + b',"model":' + encode(self.model.name)
                          + b',"choices":[{"index":')
        if head is None:
            head = self._heads[index] = self._head + str(index).encode() + b',"delta":{"content":'
        return head

    def finish(self) -> bytes:
        """The usage event (if asked for) and ``data: [DONE]``."""
        if self.options.include_usage and not self.failed:
            usage = sse_event(ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.model.name, choices=[],
                usage=self._final_usage(),
                system_fingerprint=_or_unset(self.system_fingerprint),
            ))
            return usage + DONE_EVENT
        return DONE_EVENT


class CompletionDerender(_Base):
    """``text_completion`` answers (whole and streamed) for one completions request.

    A completions request renders to one generate request per prompt; ``prompt_ids[p]`` and
    ``prompt_texts[p]`` (for ``echo``) describe prompt ``p``, and its choice ``i`` is answered as
    index ``p * n + i``, as vLLM numbers them.
    """

    def __init__(self, model: RenderModel, request: CompletionRequest | DerenderOptions, *, request_id: str,
                 created: int | None = None, prompt_ids: Sequence[Sequence[int]] | None = None,
                 prompt_texts: Sequence[str] | None = None, prompt_tokens: Sequence[int] | None = None,
                 system_fingerprint: str | None = None, prompt_tokens_details: bool = False) -> None:
        options = request if isinstance(request, DerenderOptions) else DerenderOptions.from_completion(request)
        self._prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self._prompt_texts = list(prompt_texts) if prompt_texts is not None else None
        self._num_prompts = max(len(self._prompt_ids or ()), len(self._prompt_texts or ()), 1)
        if prompt_tokens is not None:
            self._prompt_counts = list(prompt_tokens)
        elif self._prompt_ids is not None:
            self._prompt_counts = [len(p) for p in self._prompt_ids]
        else:
            self._prompt_counts = [0] * self._num_prompts
        super().__init__(model, options, request_id=request_id, created=created,
                         prompt_tokens=sum(self._prompt_counts), system_fingerprint=system_fingerprint,
                         prompt_tokens_details=prompt_tokens_details)
        self._echoed: set[int] = set()
        self._collecting = False
        self._collected_ids: dict[tuple[int, int], list[int]] = {}
        self._collected_kv: dict[str, Any] | None = None
        opts = self.options
        #: running events carry nothing but the text: constant bytes around it (as chat's)
        self._plain = not (opts.echo or opts.return_token_ids or opts.continuous_usage or opts.logprobs)
        self._head = (b'data: {"id":' + encode(request_id) + b',"object":"text_completion","created":'
                      + str(self.created).encode() + b',"model":' + encode(model.name) + b',"choices":[{"index":')

    @property
    def _expected(self) -> int:
        return self.options.n * self._num_prompts

    def _choice_of(self, prompt: int, index: int) -> ChoiceText:
        key = prompt * self.options.n + index
        choice = self._choices.get(key)
        if choice is None:
            ids = self._prompt_ids[prompt] if self._prompt_ids is not None and prompt < len(self._prompt_ids) else None
            choice = self._choices[key] = self._new_choice(ids, self._collecting)
        return choice

    def _set_prompt_tokens(self, prompt: int, count: int) -> None:
        while len(self._prompt_counts) <= prompt:
            self._prompt_counts.append(0)
        self._prompt_counts[prompt] = count
        self.prompt_tokens = sum(self._prompt_counts)

    def _prompt_text(self, prompt: int) -> str:
        if self.options.return_token_ids:  # vLLM echoes no prompt text with return_token_ids
            return ""
        texts = self._prompt_texts
        return texts[prompt] if texts is not None and prompt < len(texts) else ""

    def _prompt_id_list(self, prompt: int) -> Sequence[int]:
        ids = self._prompt_ids
        return ids[prompt] if ids is not None and prompt < len(ids) else ()

    # -- whole answers ---------------------------------------------------------------------------

    def whole(self, responses: Sequence[GenerateResponse]) -> bytes:
        """The ``text_completion`` for the generate answers of every prompt, in prompt order."""
        self._collecting = True
        taken: list[tuple[int, int, list[int]]] = []
        kv = None
        ec = None
        for prompt, response in enumerate(responses):
            if response.usage is not None and response.usage.prompt_tokens:
                self._set_prompt_tokens(prompt, response.usage.prompt_tokens)
            self._note_cached(response.usage, prompt)
            if prompt == 0:
                kv = response.kv_transfer_params
                ec = _ec(response.ec_transfer_params)
            for gc in sorted(response.choices, key=_index):
                choice = self._choice_of(prompt, gc.index)
                consumed = choice.take_logged(gc.token_ids, gc.finish_reason or "stop", gc.stop_reason, gc.logprobs)
                taken.append((prompt, gc.index, consumed))
        return self._whole_bytes(taken, kv, ec)

    def collect(self, chunk: GenerateStreamChunk, prompt: int = 0) -> None:
        """Take one generate stream event of prompt ``prompt`` for a whole answer (``collected``)."""
        self._collecting = True
        if chunk.error is not _UNSET_MARK:
            self._fail(chunk.error)
            return
        if chunk.usage is not None and chunk.usage.prompt_tokens:
            self._set_prompt_tokens(prompt, chunk.usage.prompt_tokens)
        self._note_cached(chunk.usage, prompt)
        for gc in chunk.choices:
            choice = self._choice_of(prompt, gc.index)
            if choice.done:
                continue
            consumed = choice.take_logged(gc.token_ids, gc.finish_reason, gc.stop_reason, gc.logprobs)
            self._collected_ids.setdefault((prompt, gc.index), []).extend(consumed)
        if prompt == 0 and chunk.kv_transfer_params is not _UNSET_MARK:
            self._collected_kv = chunk.kv_transfer_params

    def collected(self) -> bytes:
        """The ``text_completion`` for the events ``collect`` took.

        Raises ``UpstreamProtocolError`` when the engine sent an error event instead.
        """
        if self.error is not None:
            raise UpstreamProtocolError(f"the engine failed while generating: {self.error.message}")
        n = self.options.n
        for key, choice in self._choices.items():
            if not choice.done:  # the stream ended without a finish: send what was held back
                choice.take(None, "stop", None)
            self._collected_ids.setdefault((key // n, key % n), [])
        taken = [(prompt, index, ids) for (prompt, index), ids in sorted(self._collected_ids.items())]
        return self._whole_bytes(taken, self._collected_kv, None)

    def _whole_bytes(self, taken: list[tuple[int, int, list[int]]], kv: dict[str, Any] | None,
                     ec: dict[str, Any] | None) -> bytes:
        opts = self.options
        choices: list[CompletionChoice] = []
        for prompt, index, consumed in taken:
            choice = self._choices[prompt * opts.n + index]
            prompt_ids = self._prompt_id_list(prompt)
            if opts.echo_only:
                text, token_ids = self._prompt_text(prompt), list(prompt_ids)
            elif opts.echo:
                text, token_ids = self._prompt_text(prompt) + choice.text(), [*prompt_ids, *consumed]
            else:
                text, token_ids = choice.text(), consumed
            logprobs = None
            if choice.namer is not None and choice.lp_entries is not None and not opts.echo_only:
                start = len(self._prompt_text(prompt)) if opts.echo else 0
                logprobs = choice.namer.completion(choice.lp_entries, start)[0]
            choices.append(CompletionChoice(
                index=len(choices),
                text=text,
                logprobs=logprobs,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                token_ids=token_ids if opts.return_token_ids else None,
                prompt_token_ids=list(prompt_ids) if opts.return_token_ids else None,
            ))
        return encode(CompletionResponse(
            id=self.request_id, created=self.created, model=self.model.name, choices=choices,
            system_fingerprint=self.system_fingerprint, usage=self._whole_usage(), kv_transfer_params=kv,
            ec_transfer_params=ec,
        ))

    # -- streams ---------------------------------------------------------------------------------

    def chunk(self, chunk: GenerateStreamChunk, prompt: int = 0) -> bytes:
        """The SSE bytes for one generate stream event of prompt ``prompt``."""
        if self.failed:
            return b""
        if chunk.error is not _UNSET_MARK:
            return self._error_event(chunk.error)
        if chunk.usage is not None and chunk.usage.prompt_tokens:
            self._set_prompt_tokens(prompt, chunk.usage.prompt_tokens)
        self._note_cached(chunk.usage, prompt)
        out = []
        for gc in chunk.choices:
            event = self._event(prompt, gc.index, gc.token_ids, gc.finish_reason, gc.stop_reason, gc.logprobs)
            if event:
                out.append(event)
        return b"".join(out)

    def running(self, datas: list[bytes]) -> tuple[bytes, int]:
        """``chunk(event, prompt=0)`` of the leading events of ``datas`` that are the bulk of a stream, as
        ``ChatDerender.running`` says: their SSE bytes, and how many events that was."""
        lean = self._lean_steps(datas)
        if lean is None or lean[1][0].index >= self.options.n:  # an index past n: not prompt 0's choice
            return b"", 0
        choice, steps = lean
        texts = choice.take_running_steps([step.token_ids for step in steps])
        head = self._head + str(steps[0].index).encode() + b',"text":'
        return b"".join([head + encode(text) + _RUNNING_COMPLETION_TAIL for text in texts]), len(steps)

    def step(self, index: int, token_ids: list[int], finish_reason: str | None = None,
             stop_reason: Any = _UNSET_MARK, prompt: int = 0) -> bytes:
        """``chunk`` for one choice's step (no logprobs), without a ``GenerateStreamChunk``: for an engine in
        the same process (the backends' text routes), per token."""
        if self.failed:
            return b""
        return self._event(prompt, index, token_ids, finish_reason, stop_reason, None)

    def _event(self, prompt: int, index: int, token_ids: list[int] | None, finish_reason: str | None,
               stop_reason: Any, logprobs_in: GenerateLogProbs | None) -> bytes:
        """The SSE event of one choice's step (``b""``: nothing to send)."""
        opts = self.options
        key = prompt * opts.n + index
        choice = self._choice_of(prompt, index)
        if choice.done:
            return b""
        text, consumed = choice.take(token_ids, finish_reason, stop_reason)
        if self._plain and not choice.done:  # the common event: pre-encoded around the text
            if text or consumed or choice.tokens:
                return self._head + str(key).encode() + b',"text":' + encode(text) + _RUNNING_COMPLETION_TAIL
            return b""
        entries = choice.step_logprobs(logprobs_in, consumed)
        prompt_ids_out = None
        echoed = 0  # characters of prompt text in front of the generated text
        if key not in self._echoed and (opts.echo or opts.return_token_ids):
            self._echoed.add(key)
            prompt_ids_out = list(self._prompt_id_list(prompt))
            if opts.echo:
                prefix = self._prompt_text(prompt)
                echoed = len(prefix)
                text = prefix + ("" if opts.echo_only else text)
        elif not text and not consumed and not choice.tokens and not choice.done:
            return b""
        logprobs = None
        if entries is not None and choice.namer is not None and not opts.echo_only:
            logprobs, choice.lp_offset = choice.namer.completion(entries, choice.lp_offset + echoed)
        event = CompletionChunk(
            id=self.request_id, created=self.created, model=self.model.name,
            choices=[CompletionStreamChoice(
                index=key, text=text, logprobs=logprobs,
                finish_reason=choice.finish_reason if choice.done else None,
                stop_reason=choice.stop_reason if choice.done else None,
                prompt_token_ids=prompt_ids_out,
                token_ids=consumed if opts.return_token_ids else None,
            )],
        )
        if choice.done and self.system_fingerprint is not None and not opts.include_usage:
            event.system_fingerprint = self.system_fingerprint
        if opts.continuous_usage:
            count = self._prompt_counts[prompt] if prompt < len(self._prompt_counts) else 0
            event.usage = StreamUsage(prompt_tokens=count, total_tokens=count + choice.tokens,
                                      completion_tokens=choice.tokens)
        return sse_event(event)

    def finish(self) -> bytes:
        """The usage event (if asked for) and ``data: [DONE]``."""
        if self.options.include_usage and not self.failed:
            return sse_event(CompletionChunk(
                id=self.request_id, created=self.created, model=self.model.name, choices=[],
                usage=self._final_usage(),
                system_fingerprint=_or_unset(self.system_fingerprint),
            )) + DONE_EVENT
        return DONE_EVENT


def _index(choice: Any) -> int:
    return choice.index


def _ec(value: Any) -> Any:
    return None if value is _UNSET_MARK else value


def _or_unset(value: Any) -> Any:
    return _UNSET_MARK if value is None else value
