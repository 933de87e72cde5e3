"""The derenderers the engine leg (``router.tokens.generate.Derenderer``) answers clients with.

``rendering.derender.ChatDerender`` is one as it is. ``CompletionAnswer`` adapts a
``CompletionDerender`` for one prompt: ``whole`` takes that prompt's answer, and a stream collected
for a non-stream client (stop strings) is gathered into the ``GenerateResponse`` it adds up to while
a second derenderer, whose stream output is dropped, watches for the stop strings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from msgspec import UNSET

from contract.errors import UpstreamProtocolError
from rendering.derender import CompletionDerender
from rendering.generate_response import (
    GenerateChoice,
    GenerateLogProbs,
    GenerateResponse,
    GenerateStreamChunk,
    GenerateUsage,
)


class Gathered:
    """A generate stream's events gathered into the non-stream answer they add up to."""

    __slots__ = ("request_id", "choices", "kv_transfer_params", "usage")

    def __init__(self) -> None:
        self.request_id = ""
        self.choices: dict[int, GenerateChoice] = {}
        self.kv_transfer_params: dict[str, Any] | None = None
        self.usage: GenerateUsage | None = None

    def add(self, chunk: GenerateStreamChunk) -> None:
        if chunk.request_id is not UNSET:
            self.request_id = chunk.request_id
        if chunk.kv_transfer_params is not UNSET and chunk.kv_transfer_params is not None:
            self.kv_transfer_params = chunk.kv_transfer_params
        if chunk.usage is not None:
            self.usage = chunk.usage
        for step in chunk.choices:
            choice = self.choices.get(step.index)
            if choice is None:
                choice = self.choices[step.index] = GenerateChoice(index=step.index, finish_reason=None, token_ids=[])
            if step.token_ids:
                assert choice.token_ids is not None
                choice.token_ids.extend(step.token_ids)
            if step.finish_reason is not None:
                choice.finish_reason = step.finish_reason
                choice.stop_reason = None if step.stop_reason is UNSET else step.stop_reason
            if step.logprobs is not None and step.logprobs.content:
                if choice.logprobs is None or choice.logprobs.content is None:
                    choice.logprobs = GenerateLogProbs(content=[])
                assert choice.logprobs.content is not None
                choice.logprobs.content.extend(step.logprobs.content)

    def response(self) -> GenerateResponse:
        choices = [self.choices[index] for index in sorted(self.choices)]
        return GenerateResponse(request_id=self.request_id, usage=self.usage, choices=choices,
                                kv_transfer_params=self.kv_transfer_params)


class CompletionAnswer:
    """A ``CompletionDerender`` as the engine leg's ``Derenderer``; ``prompt`` (default 0) says which
    prompt's engine request an event or answer is from."""

    __slots__ = ("make", "derender", "watch", "gathered")

    def __init__(self, make: Callable[[], CompletionDerender]) -> None:
        """``make``: a new derenderer for the request (a collected answer needs two)."""
        self.make = make
        self.derender = make()
        self.watch: CompletionDerender | None = None
        self.gathered: list[Gathered] = []

    @property
    def _current(self) -> CompletionDerender:
        return self.watch if self.watch is not None else self.derender

    @property
    def stopped(self) -> bool:
        return self._current.stopped

    @property
    def failed(self) -> bool:
        return self._current.failed

    @property
    def prompt_tokens(self) -> int:
        return self._current.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self._current.completion_tokens

    def whole(self, response: GenerateResponse) -> bytes:
        return self.derender.whole([response])

    def chunk(self, chunk: GenerateStreamChunk, prompt: int = 0) -> bytes:
        return self.derender.chunk(chunk, prompt)

    def running(self, datas: list[bytes]) -> tuple[bytes, int]:
        return self.derender.running(datas)

    def finish(self) -> bytes:
        return self.derender.finish()

    def collect(self, chunk: GenerateStreamChunk, prompt: int = 0) -> None:
        if self.watch is None:
            self.watch = self.make()
        while len(self.gathered) <= prompt:
            self.gathered.append(Gathered())
        self.gathered[prompt].add(chunk)
        self.watch.chunk(chunk, prompt)  # only its stop-string state matters

    def collected(self) -> bytes:
        """The ``text_completion`` for the events ``collect`` took (every prompt's, in order)."""
        watch = self.watch
        if watch is not None and watch.error is not None:
            raise UpstreamProtocolError(f"the engine failed while generating: {watch.error.message}")
        gathered = self.gathered or [Gathered()]
        return self.derender.whole([g.response() for g in gathered])
