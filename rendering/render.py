"""OpenAI request bodies -> ``GenerateRequest``s, as vLLM 0.32's render server makes them.

``Renderer`` holds one model's compiled template and tokenizer (built once, shared read-only) and
renders ``/v1/chat/completions`` bodies (the template, then the tokenizer without adding special
tokens again) and ``/v1/completions`` bodies (each prompt encoded with special tokens, or taken as
token ids), checks them in vLLM's order with vLLM's answers (request model validators, model name,
tool choice, untrusted templates, output budget, template, context length, sampling values) and
answers ``/tokenize`` and ``/detokenize``. Every refusal is a ``ClientError`` whose
``.status``/``.body()`` are vLLM's.

The conversation the template sees is ``rendering.conversation``'s; the request-model checks are
``rendering.checks``'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from contract.errors import BadRequestError, NotFoundError
from rendering.checks import (
    check_generation_prompt,
    completion_prompts,
    refuse_tool_choice,
    validate_chat,
    validate_completion,
)
from rendering.conversation import (
    build_conversation,
    consolidate_system,
    cut_after_final_message,
    developer_to_system,
    has_media,
    tool_dicts,
)
from rendering.generate_request import GenerateRequest, SamplingParams, random_id
from rendering.incremental import PromptEncoder, PromptState
from rendering.model import RenderModel
from rendering.requests import (
    ChatRequest,
    CompletionRequest,
    Message,
    RequestValidationError,
    decode_chat_request,
    decode_completion_request,
    field_error,
)
from rendering.sampling import chat_sampling_params, completion_sampling_params, validation_error
from rendering.template import ChatTemplate
from rendering.vocabulary import check_vocabulary

#: names ``apply_chat_template`` takes itself (vLLM lets them through whatever the template reads)
_APPLY_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
_UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.")
#: transformers' refusal (vLLM's validator only sees flags the body wrote)
_BOTH_PROMPT_FLAGS = ("continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                      "when you want the model to continue the final message, and add_generation_prompt when you want "
                      "to add a header that will prompt it to start a new assistant message instead.")
_NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
                "chat template if the tokenizer does not define one.")


@dataclass
class RenderedChat:
    """A rendered chat request: what to send the engine, what derender needs, the prompt state."""

    request: GenerateRequest
    chat: ChatRequest
    prompt: PromptState


class _TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class _DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class _TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class _DetokenizeResponse(msgspec.Struct):
    prompt: str


_tokenize_decoder = msgspec.json.Decoder(_TokenizeRequest, strict=False)
_detokenize_decoder = msgspec.json.Decoder(_DetokenizeRequest, strict=False)
_encoder = msgspec.json.Encoder()


def new_request_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` with 16 hex digits, the form vLLM 0.32's render answers carry."""
    return f"{prefix}-{random_id()}"


@dataclass(slots=True)
class _Limits:
    """``TokenizeParams``: the context budget one request's prompt is checked against."""

    max_total: int | None  # the context length (None: unchecked, as /tokenize)
    requested: int  # output tokens asked for (0: none)
    truncate: int | None  # truncate_prompt_tokens
    side: str | None  # truncation_side


class Renderer:
    """One model's render: compiled template, tokenizer, limits. Thread-safe, no per-request state."""

    def __init__(self, model: RenderModel) -> None:
        self.model = model
        self._tokenizer = model.tokenizer
        self._prompts = PromptEncoder(model.tokenizer)  # incremental encode (rendering.incremental)
        self._template = (ChatTemplate(model.chat_template, special_tokens=model.special_tokens)
                          if model.chat_template else None)
        self._knows_developer = bool(model.chat_template) and (
            '"developer"' in model.chat_template or "'developer'" in model.chat_template)
        #: the names a render passes to the template: those it reads, and apply_chat_template's own
        self._accepted = (self._template.variables | _APPLY_KWARGS) if self._template is not None else _APPLY_KWARGS
        self._defaults = dict(model.default_sampling)
        self._default_max_tokens: int | None = self._defaults.pop("max_tokens", None)

    # --- chat ------------------------------------------------------------------------------------
    def render_chat(
        self, body: bytes, *, request_id: str | None = None, previous: PromptState | None = None
    ) -> RenderedChat:
        """A ``/v1/chat/completions`` body -> its ``GenerateRequest`` (+ what derender needs).

        ``request_id`` is the whole id to use (``chatcmpl-`` + the ``X-Request-Id`` header, as vLLM
        takes it); without one, ``chatcmpl-`` + the body's ``request_id``, else 16 random hex digits."""
        chat = decode_chat_request(body)
        validate_chat(chat, body)
        self.check_model(chat.model)
        if chat.use_beam_search:
            raise BadRequestError("Beam search is not supported by the render endpoint")
        refuse_tool_choice(chat)
        if chat.chat_template is not None or (chat.chat_template_kwargs or {}).get("chat_template") is not None:
            raise BadRequestError(_UNTRUSTED_TEMPLATE)
        if chat.max_completion_tokens is not None:
            requested, param = chat.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = chat.max_tokens, "max_tokens"
        limits = self._limits(requested, param, chat.truncate_prompt_tokens, chat.truncation_side)

        offsets: list[tuple[int, int]] | None = None  # per token, when the client asks for them
        reused = self._reused_ids(chat)
        if reused is not None:
            token_ids = reused
            prompt = PromptState(text="", token_ids=[])  # nothing rendered: the next turn starts afresh
            if len(token_ids) > self.model.max_model_len:
                raise BadRequestError(f"Input length ({len(token_ids)}) exceeds model's maximum context length "
                                      f"({self.model.max_model_len}).")
        else:
            text = self._chat_text(chat.messages, chat_template_kwargs=chat.chat_template_kwargs,
                                   add_generation_prompt=chat.add_generation_prompt,
                                   continue_final_message=chat.continue_final_message,
                                   documents=chat.documents, reasoning_effort=chat.reasoning_effort,
                                   tools=tool_dicts(chat.tools))
            self._check_text(text, limits)
            if chat.return_token_offsets:
                encoding = self._tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)
                prompt = PromptState(text=text, token_ids=encoding.ids)
                offsets = list(encoding.offsets)
            elif chat.add_special_tokens or limits.truncate is not None:
                prompt = PromptState(text=text, token_ids=self._prompts.encode_ids(
                    text, add_special_tokens=chat.add_special_tokens))
            else:
                prompt = self._prompts.encode(text, previous)
            token_ids = self._check_ids(list(prompt.token_ids), limits, offsets=offsets)
        if not token_ids:
            raise BadRequestError("No token_ids rendered")

        params = chat_sampling_params(chat, max_tokens=self._max_tokens(len(token_ids), requested),
                                      defaults=self._defaults)
        request = GenerateRequest(
            request_id=request_id or f"chatcmpl-{chat.request_id or random_id()}",
            token_ids=token_ids,
            sampling_params=params,
            model=chat.model,
            reasoning_ended=None if chat.include_reasoning else True,
            stream=bool(chat.stream),
            stream_options=chat.stream_options if chat.stream else None,
            cache_salt=chat.cache_salt,
            priority=chat.priority,
            token_offsets=offsets,
        )
        return RenderedChat(request=request, chat=chat, prompt=prompt)

    def chat_text(self, chat: ChatRequest) -> str:
        """The chat template applied to ``chat``'s conversation: the text render tokenizes."""
        return self._chat_text(chat.messages, chat_template_kwargs=chat.chat_template_kwargs,
                               add_generation_prompt=chat.add_generation_prompt,
                               continue_final_message=chat.continue_final_message, documents=chat.documents,
                               reasoning_effort=chat.reasoning_effort, tools=tool_dicts(chat.tools))

    # --- completions -----------------------------------------------------------------------------
    def render_completions(self, body: bytes, *, request_id: str | None = None) -> list[GenerateRequest]:
        """A ``/v1/completions`` body -> one ``GenerateRequest`` per prompt (``<id>-<i>`` if several).

        ``request_id`` is the whole base id (``cmpl-…``), as for chat; several prompts get ``-0``, ``-1``, …"""
        req = decode_completion_request(body)
        validate_completion(req, body)
        self.check_model(req.model)
        if req.use_beam_search:
            raise BadRequestError("Beam search is not supported by the render endpoint")
        if req.suffix is not None:
            if req.echo:
                raise BadRequestError("Echo is unsupported with suffix.", param="suffix")
            if req.prompt_embeds is not None:
                raise BadRequestError("suffix is not supported with prompt_embeds", param="suffix")
            if req.truncate_prompt_tokens is not None:
                raise BadRequestError("suffix is not supported with truncate_prompt_tokens", param="suffix")
            raise BadRequestError("suffix is only supported for models with FIM completion rendering",
                                  param="suffix")
        if req.prompt_embeds is not None:
            raise BadRequestError("prompt_embeds are not supported by this renderer", param="prompt_embeds")
        prompts = completion_prompts(req.prompt)
        limits = self._limits(req.max_tokens, "max_tokens", req.truncate_prompt_tokens, req.truncation_side)

        rendered: list[list[int]] = []
        all_offsets: list[list[tuple[int, int]] | None] = []
        for prompt in prompts:
            offsets: list[tuple[int, int]] | None = None
            if isinstance(prompt, str):
                self._check_text(prompt, limits)
                if req.return_token_offsets:
                    encoding = self._tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
                    ids, offsets = encoding.ids, list(encoding.offsets)
                else:
                    ids = self._prompts.encode_ids(prompt, add_special_tokens=req.add_special_tokens)
                rendered.append(self._check_ids(ids, limits, offsets=offsets))
            else:  # client ids have no text to point into
                rendered.append(self._in_vocabulary(self._check_ids(list(prompt), limits, encoded=False)))
            all_offsets.append(offsets)

        base = request_id or f"cmpl-{req.request_id or random_id()}"
        out: list[GenerateRequest] = []
        for index, token_ids in enumerate(rendered):
            if not token_ids:
                raise BadRequestError("No token_ids rendered")
            params = completion_sampling_params(req, max_tokens=self._max_tokens(len(token_ids), req.max_tokens),
                                                defaults=self._defaults)
            out.append(self._completion_request(req, base if len(rendered) == 1 else f"{base}-{index}",
                                                token_ids, params, all_offsets[index]))
        return out

    @staticmethod
    def _completion_request(req: CompletionRequest, request_id: str, token_ids: list[int],
                            params: SamplingParams, offsets: list[tuple[int, int]] | None) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id,
            token_ids=token_ids,
            token_offsets=offsets,
            sampling_params=params,
            model=req.model,
            stream=bool(req.stream),
            stream_options=req.stream_options if req.stream else None,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )

    # --- tokenize / detokenize ------------------------------------------------------------------
    def tokenize(self, body: bytes) -> bytes:
        """``POST /tokenize`` (a ``prompt`` or chat ``messages``) -> ``{count, max_model_len, tokens, token_strs}``."""
        req = _decode_json(_tokenize_decoder, body)
        if req.messages is not None:
            check_generation_prompt(req.continue_final_message, req.add_generation_prompt, body)
        self.check_model(req.model)
        if req.messages is not None:
            if req.chat_template is not None or (req.chat_template_kwargs or {}).get("chat_template") is not None:
                raise BadRequestError(_UNTRUSTED_TEMPLATE)
            text = self._chat_text(req.messages, chat_template_kwargs=req.chat_template_kwargs,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message, documents=None,
                                   reasoning_effort=None, tools=tool_dicts(req.tools))
            special = bool(req.add_special_tokens)
        elif req.prompt is not None:
            text = req.prompt
            special = True if req.add_special_tokens is None else req.add_special_tokens
        else:
            raise field_error("prompt", "Field required")
        strs: list[str] | None = None
        if req.return_token_strs:
            encoding = self._tokenizer.encode(text, add_special_tokens=special)
            ids, strs = encoding.ids, list(encoding.tokens)
        else:
            ids = self._prompts.encode_ids(text, add_special_tokens=special)
        return _encoder.encode(_TokenizeResponse(count=len(ids), max_model_len=self.model.max_model_len,
                                                 tokens=ids, token_strs=strs))

    def detokenize(self, body: bytes) -> bytes:
        """``POST /detokenize`` ``{tokens}`` -> ``{prompt}`` (special tokens kept, as vLLM's)."""
        req = _decode_json(_detokenize_decoder, body)
        for index, token in enumerate(req.tokens):
            if token < 0:
                raise field_error(f"tokens.{index}", f"Input should be greater than or equal to 0, got {token}")
        self.check_model(req.model)
        return _encoder.encode(_DetokenizeResponse(prompt=self._tokenizer.decode(req.tokens,
                                                                                 skip_special_tokens=False)))

    # --- checks -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """404 as vLLM for a model name this renderer does not serve (none given is fine)."""
        if name and name != self.model.name:
            raise NotFoundError(f"The model `{name}` does not exist. Valid aliases: {self.model.name}.",
                                param="model")

    def _limits(self, requested: int | None, param: str, truncate: int | None, side: str | None) -> _Limits:
        """``build_tok_params``: refuse an output budget larger than the context, or a truncation beyond it."""
        context = self.model.max_model_len
        output = requested or 0
        if output > context:
            raise validation_error(f"{param}={output} cannot be greater than max_model_len={context}. "
                                   "Please request fewer output tokens.", parameter=param, value=output)
        if truncate is not None and truncate > context:
            raise validation_error(f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len "
                                   f"= {context}. Please request a smaller truncation size.",
                                   parameter="truncate_prompt_tokens", value=truncate)
        return _Limits(max_total=context, requested=output, truncate=truncate, side=side)

    def _check_text(self, text: str, limits: _Limits) -> None:
        """A prompt longer than the context could hold at the longest token's length is refused unread."""
        if limits.max_total is None or limits.truncate is not None:
            return
        max_chars = limits.max_total * self.model.max_chars_per_token
        if len(text) > max_chars:
            raise validation_error(
                f"This model's maximum context length is {limits.max_total} tokens. However, your prompt "
                f"contains {len(text)} characters (more than {max_chars} characters, which is the upper bound "
                f"for {limits.max_total} input tokens). Please reduce the length of the input prompt.",
                parameter="input_text", value=len(text))

    def _check_ids(self, ids: list[int], limits: _Limits, *, encoded: bool = True,
                   offsets: list[tuple[int, int]] | None = None) -> list[int]:
        """Truncation (``truncate_prompt_tokens``), then the context-length check, as vLLM words it.

        ``encoded``: the ids are the tokenizer's for a text prompt (vLLM's tokenizer stops at the
        context + 1 tokens, so that is the most its message can report); else the client's own ids.
        ``offsets`` (per token, when asked for) are cut as the ids are, in place."""
        if limits.max_total is None:
            return ids
        keep = limits.truncate
        if keep is not None:
            if keep < 0:
                keep = limits.max_total - 1 if limits.requested else limits.max_total
            if keep < len(ids):
                side = limits.side or self.model.truncation_side
                cut = slice(len(ids) - keep, None) if side == "left" else slice(0, keep)
                ids = ids[cut]
                if offsets is not None:
                    offsets[:] = offsets[cut]
        if len(ids) > limits.max_total:
            count = min(len(ids), limits.max_total + 1) if encoded else len(ids)
            qualifier = "at least " if count == limits.max_total + 1 else ""
            raise validation_error(
                f"This model's maximum context length is {limits.max_total} tokens. However, your prompt "
                f"contains {qualifier}{count} input tokens, which exceeds this limit even without any output "
                "tokens. Please reduce the length of the input prompt.", parameter="input_tokens", value=count)
        return ids

    def _in_vocabulary(self, ids: list[int]) -> list[int]:
        """Client token ids past the vocabulary: the 400 vLLM's engine answers for them (its input
        processor's check), given here so that such a prompt never reaches an engine."""
        check_vocabulary(ids, self.model.max_token_id)
        return ids

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """vLLM's ``get_max_tokens``: the remaining context, capped by the request (else the model's default)."""
        value = self.model.max_model_len - prompt_len
        fallback = requested if requested is not None else self._default_max_tokens
        return value if fallback is None else min(value, fallback)

    def _reused_ids(self, chat: ChatRequest) -> list[int] | None:
        """P/D decode-side reuse: ``kv_transfer_params.prompt_token_ids`` taken instead of rendering."""
        kv = chat.kv_transfer_params
        if not isinstance(kv, dict) or "prompt_token_ids" not in kv:
            return None
        ids = kv.pop("prompt_token_ids")
        if ids is None or chat.echo or has_media(chat.messages):
            return None
        if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
            raise validation_error("`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
                                   "non-negative integers.", parameter="kv_transfer_params.prompt_token_ids")
        top = max(ids)
        if top > self.model.max_token_id:
            raise validation_error(f"Token id {top} is out of vocabulary",
                                   parameter="kv_transfer_params.prompt_token_ids")
        return ids

    # --- the template -------------------------------------------------------------------------
    def _chat_text(
        self,
        messages: list[Message],
        *,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        documents: list[dict[str, Any]] | None,
        reasoning_effort: str | None,
        tools: list[dict[str, Any]] | None,
    ) -> str:
        if self._template is None:
            raise BadRequestError(_NO_TEMPLATE)
        template = self._template
        conversation = build_conversation(messages, template.content_format)
        if not self._knows_developer and any(m["role"] == "developer" for m in conversation):
            conversation = consolidate_system(developer_to_system(conversation))
        if not conversation:
            raise BadRequestError("Cannot apply chat template to an empty conversation. "
                                  "Provide at least one message.")

        # vLLM's kwargs: the server's (tools), then the request's chat_template_kwargs, then its own
        # fields (None and "auto" leave a value alone); only names the template reads or
        # apply_chat_template takes get through
        kwargs: dict[str, Any] = {"tools": tools} if tools is not None else {}
        kwargs.update(chat_template_kwargs or {})
        own: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                               "continue_final_message": continue_final_message,
                               "documents": documents, "reasoning_effort": reasoning_effort}
        if reasoning_effort is not None and "enable_thinking" not in (chat_template_kwargs or {}):
            own["enable_thinking"] = reasoning_effort != "none"
        kwargs.update({k: v for k, v in own.items() if v is not None and v != "auto"})
        accepted = self._accepted
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        if kwargs.get("continue_final_message") and kwargs.get("add_generation_prompt"):
            raise BadRequestError(_BOTH_PROMPT_FLAGS)
        extra = {k: v for k, v in kwargs.items() if k not in _APPLY_KWARGS}
        text = template.render(conversation, add_generation_prompt=bool(kwargs.get("add_generation_prompt", False)),
                               tools=kwargs.get("tools"), documents=kwargs.get("documents"), extra=extra)
        if kwargs.get("continue_final_message"):
            text = cut_after_final_message(text, conversation)
        return text


def _decode_json(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(f"1 validation error:\n  {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from exc
