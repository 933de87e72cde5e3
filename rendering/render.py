"""OpenAI request bodies -> ``GenerateRequest``s, as vLLM 0.32's render server makes them.

``Renderer`` holds one model's compiled template and tokenizer (built once, shared read-only) and
renders ``/v1/chat/completions`` bodies (the template, then the tokenizer without adding special
tokens again) and ``/v1/completions`` bodies (each prompt encoded with special tokens, or taken as
token ids), checks them in vLLM's order with vLLM's answers (request model validators, model name,
tool choice, untrusted templates, output budget, template, context length, sampling values) and
answers ``/tokenize`` and ``/detokenize``. Every refusal is a ``ClientError`` whose
``.status``/``.body()`` are vLLM's.

The conversation the template sees is built as vLLM builds it (``ConversationMessage`` dicts):
text parts joined with newlines for a template that reads ``message['content']`` as a string,
``[{"type": "text", ...}]`` lists for one that loops over it; assistant tool-call arguments parsed to
objects; ``reasoning_content`` renamed ``reasoning`` (both kept); developer messages turned into
system ones for templates that do not know the role. Text only: media parts are refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from contract.errors import BadRequestError, NotFoundError
from rendering.generate_request import GenerateRequest, SamplingParams, random_id
from rendering.incremental import PromptEncoder, PromptState
from rendering.model import RenderModel
from rendering.requests import (
    ChatRequest,
    CompletionRequest,
    ContentPart,
    Message,
    RequestValidationError,
    decode_chat_request,
    decode_completion_request,
    field_error,
    validator_error,
)
from rendering.sampling import chat_sampling_params, completion_sampling_params, validation_error
from rendering.template import OPENAI_FORMAT, ChatTemplate

#: names ``apply_chat_template`` takes itself (vLLM lets them through whatever the template reads)
_APPLY_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
#: of those, the ones the template itself sees as variables
_TEMPLATE_SEES = frozenset({"tools", "documents", "add_generation_prompt"})
_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
_MEDIA_TYPES = frozenset({"input_image", "image_url", "image_embeds", "audio_embeds", "video_embeds",
                          "prompt_embeds", "image_pil", "audio_url", "input_audio", "video_url"})
_SUPPORTED_PART_TYPES = ", ".join(sorted(_MEDIA_TYPES | set(_TEXT_KEYS) | {"tool_reference"}))
_CORRECT_TOOL_CHOICE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.")
_NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
                "chat template if the tokenizer does not define one.")


@dataclass
class RenderedChat:
    """A rendered chat request: what to send the engine, what derender needs, the prompt state."""

    request: GenerateRequest
    chat: ChatRequest
    prompt: PromptState


class _FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class _Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: _FunctionDefinition
    defer_loading: bool | None = None


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


@dataclass(frozen=True)
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
        _validate_chat(chat, body)
        self.check_model(chat.model)
        if chat.use_beam_search:
            raise BadRequestError("Beam search is not supported by the render endpoint")
        _refuse_tool_choice(chat)
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
                                   tools=_tool_dicts(chat.tools))
            self._check_text(text, limits)
            if chat.add_special_tokens or limits.truncate is not None or chat.return_token_offsets:
                encoding = self._tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)
                prompt = PromptState(text=text, token_ids=encoding.ids)
                if chat.return_token_offsets:
                    offsets = list(encoding.offsets)
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
                               reasoning_effort=chat.reasoning_effort, tools=_tool_dicts(chat.tools))

    # --- completions -----------------------------------------------------------------------------
    def render_completions(self, body: bytes, *, request_id: str | None = None) -> list[GenerateRequest]:
        """A ``/v1/completions`` body -> one ``GenerateRequest`` per prompt (``<id>-<i>`` if several).

        ``request_id`` is the whole base id (``cmpl-…``), as for chat; several prompts get ``-0``, ``-1``, …"""
        req = decode_completion_request(body)
        _validate_completion(req, body)
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
        prompts = _completion_prompts(req.prompt)
        limits = self._limits(req.max_tokens, "max_tokens", req.truncate_prompt_tokens, req.truncation_side)

        rendered: list[list[int]] = []
        all_offsets: list[list[tuple[int, int]] | None] = []
        for prompt in prompts:
            offsets: list[tuple[int, int]] | None = None
            if isinstance(prompt, str):
                self._check_text(prompt, limits)
                encoding = self._tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
                if req.return_token_offsets:
                    offsets = list(encoding.offsets)
                rendered.append(self._check_ids(encoding.ids, limits, offsets=offsets))
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
        if req.messages is not None and req.continue_final_message and req.add_generation_prompt:
            raise validator_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  body_items=_body_items(body))
        self.check_model(req.model)
        if req.messages is not None:
            if req.chat_template is not None or (req.chat_template_kwargs or {}).get("chat_template") is not None:
                raise BadRequestError(_UNTRUSTED_TEMPLATE)
            text = self._chat_text(req.messages, chat_template_kwargs=req.chat_template_kwargs,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message, documents=None,
                                   reasoning_effort=None, tools=_tool_dicts(req.tools))
            special = bool(req.add_special_tokens)
        elif req.prompt is not None:
            text = req.prompt
            special = True if req.add_special_tokens is None else req.add_special_tokens
        else:
            raise field_error("prompt", "Field required")
        encoding = self._tokenizer.encode(text, add_special_tokens=special)
        strs = list(encoding.tokens) if req.return_token_strs else None
        return _encoder.encode(_TokenizeResponse(count=len(encoding.ids), max_model_len=self.model.max_model_len,
                                                 tokens=encoding.ids, token_strs=strs))

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
        if ids and max(ids) > self.model.max_token_id:
            raise BadRequestError(f"Token id {max(ids)} is out of vocabulary")
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
        if ids is None or chat.echo or _has_media(chat.messages):
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
        conversation = _conversation(messages, template.content_format)
        if not self._knows_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _consolidate_system(_developer_to_system(conversation))
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
        accepted = template.variables | _APPLY_KWARGS
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        extra = {k: v for k, v in kwargs.items() if k not in _APPLY_KWARGS}
        text = template.render(conversation, add_generation_prompt=bool(kwargs.get("add_generation_prompt", False)),
                               tools=kwargs.get("tools"), documents=kwargs.get("documents"), extra=extra)
        if kwargs.get("continue_final_message"):
            text = _cut_after_final_message(text, conversation)
        return text


def _decode_json(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(f"1 validation error:\n  {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from exc


def _body_items(body: bytes) -> int:
    """How many top-level keys the body has (vLLM's validation message counts them)."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return 0
    return len(decoded) if isinstance(decoded, dict) else 0


def _validate_common(req: ChatRequest | CompletionRequest, body: bytes) -> None:
    """Field bounds and the model validators chat and completions share (vLLM's request model)."""
    if req.seed is not None and not -(2**63) <= req.seed <= 2**63 - 1:
        raise field_error("seed", f"Input should be between -2**63 and 2**63 - 1, got {req.seed}")
    if not -(2**63) <= req.priority <= 2**63 - 1:
        raise field_error("priority", f"Input should be between -2**63 and 2**63 - 1, got {req.priority}")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < -1:
        raise field_error("truncate_prompt_tokens", "Input should be greater than or equal to -1")
    if req.truncation_side not in (None, "left", "right"):
        raise field_error("truncation_side", "Input should be 'left' or 'right'")
    if req.stream_interval is not None and req.stream_interval < 1:
        raise field_error("stream_interval", "Input should be greater than or equal to 1")
    if req.routed_experts_prompt_start < 0:
        raise field_error("routed_experts_prompt_start", "Input should be greater than or equal to 0")
    if req.cache_salt is not None:
        if not req.cache_salt:
            raise validator_error("Parameter 'cache_salt' must be a non-empty string if provided.",
                                  parameter="cache_salt", body_items=_body_items(body))
        if len(req.cache_salt) > 128 or any(c in "@/\\\x00" for c in req.cache_salt):
            raise validator_error("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                  "'@', '/', '\\\\', or NUL.", parameter="cache_salt", body_items=_body_items(body))
    fmt = req.response_format
    if fmt is not None and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise validator_error("When response_format type is 'json_schema', the 'json_schema' field must be "
                              "provided.", parameter="response_format", body_items=_body_items(body))
    if req.stream_options is not None and not req.stream:
        raise validator_error("Stream options can only be defined when `stream=True`.",
                              parameter="stream_options", body_items=_body_items(body))
    if req.logprob_token_ids and req.use_beam_search:
        raise validator_error("`logprob_token_ids` is not supported with beam search.",
                              parameter="logprob_token_ids", body_items=_body_items(body))
    if req.prompt_logprobs is not None:
        if req.stream and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1):
            raise validator_error("`prompt_logprobs` are not available when `stream=True`.",
                                  parameter="prompt_logprobs", body_items=_body_items(body))
        if req.prompt_logprobs < 0 and req.prompt_logprobs != -1:
            raise validator_error("`prompt_logprobs` must be a positive value or -1.", parameter="prompt_logprobs",
                                  value=req.prompt_logprobs, body_items=_body_items(body))
    structured = req.structured_outputs
    if structured is not None and sum(structured.get(k) is not None for k in ("json", "regex", "choice")) > 1:
        raise validator_error("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                              "or 'choice').", parameter="structured_outputs", body_items=_body_items(body))


def _validate_chat(chat: ChatRequest, body: bytes) -> None:
    """``ChatCompletionRequest``'s validators; settles ``tool_choice`` ("auto" when tools came alone)."""
    _validate_common(chat, body)
    if chat.reasoning_effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh", "max"):
        raise field_error("reasoning_effort", "Input should be 'none', 'minimal', 'low', 'medium', 'high', "
                                              "'xhigh' or 'max'")
    if chat.logprob_token_ids and not chat.logprobs:
        raise validator_error("when using `logprob_token_ids`, `logprobs` must be set to true.",
                              parameter="logprob_token_ids", body_items=_body_items(body))
    top = chat.top_logprobs
    if top is not None:
        if top < 0 and top != -1:
            raise validator_error("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs",
                                  value=top, body_items=_body_items(body))
        if (top == -1 or top > 0) and not chat.logprobs:
            raise validator_error("when using `top_logprobs`, `logprobs` must be set to true.",
                                  parameter="top_logprobs", body_items=_body_items(body))
    _validate_tools(chat, body)
    if chat.continue_final_message and chat.add_generation_prompt:
        raise validator_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              body_items=_body_items(body))


def _validate_tools(chat: ChatRequest, body: bytes) -> None:
    if chat.tools == []:
        raise validator_error("`tools` must not be an empty array. Either provide at least one tool or omit the "
                              "field entirely.", parameter="tools", body_items=_body_items(body))
    if chat.tools is not None:
        try:
            msgspec.convert(chat.tools, list[_Tool])
        except msgspec.ValidationError as exc:
            text = str(exc)
            raise field_error("tools", text.split(" - at `", 1)[0]) from exc
    choice = chat.tool_choice
    if choice is msgspec.UNSET:
        chat.tool_choice = choice = "auto" if chat.tools else "none"
    if choice == "none" or choice is None:
        return
    if chat.tools is None:
        raise validator_error("When using `tool_choice`, `tools` must be set.", parameter="tool_choice",
                              body_items=_body_items(body))
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise validator_error(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                                  '"required" are supported.', parameter="tool_choice", body_items=_body_items(body))
        return
    function = choice.get("function")
    if not isinstance(function, dict):
        raise validator_error(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                              parameter="tool_choice.function", body_items=_body_items(body))
    if "name" not in function:
        raise validator_error(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                              parameter="tool_choice.function.name", body_items=_body_items(body))
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise validator_error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                              parameter="tool_choice.function.name", body_items=_body_items(body))
    if not any((tool.get("function") or {}).get("name") == name for tool in chat.tools):
        raise validator_error("The tool specified in `tool_choice` does not match any of the specified `tools`",
                              parameter="tool_choice", body_items=_body_items(body))


def _validate_completion(req: CompletionRequest, body: bytes) -> None:
    _validate_common(req, body)
    if req.use_beam_search and req.echo and req.logprobs is not None:
        raise validator_error("`echo` with `logprobs` is not supported with beam search because beam search does "
                              "not compute prompt logprobs.", parameter="echo", body_items=_body_items(body))


def _refuse_tool_choice(chat: ChatRequest) -> None:
    """No tool parser here: "auto", "required" and named tools are refused as vLLM refuses them."""
    choice = chat.tool_choice
    if choice in (None, "none"):
        return
    if choice == "auto":
        raise BadRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    if isinstance(choice, dict):
        described = f'function "{(choice.get("function") or {}).get("name")}"'
    else:
        described = f'"{choice}"'
    raise BadRequestError(f"tool_choice={described} requires --tool-call-parser to be set")


def _tool_dicts(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as vLLM hands them to the template (``model_dump`` of its tool model)."""
    if tools is None:
        return None
    out = []
    for tool in msgspec.convert(tools, list[_Tool]):
        function: dict[str, Any] = {"name": tool.function.name, "description": tool.function.description,
                                    "parameters": tool.function.parameters}
        if tool.function.strict is not None:
            function["strict"] = tool.function.strict
        defer = tool.function.defer_loading if tool.function.defer_loading is not None else tool.defer_loading
        if defer is not None:
            function["defer_loading"] = defer
        entry: dict[str, Any] = {"type": tool.type, "function": function}
        if tool.defer_loading is not None:
            entry["defer_loading"] = tool.defer_loading
        out.append(entry)
    return out


def _completion_prompts(prompt: str | list[Any] | None) -> list[str | list[int]]:
    """The prompt field's prompts: a string, strings, token ids, or lists of token ids."""
    if prompt is None:
        raise BadRequestError("You must pass at least one prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("You must pass at least one prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_token(p) for p in prompt):
        _check_non_negative(prompt, "prompt")
        return [prompt]
    if all(isinstance(p, list) and all(_is_token(t) for t in p) for p in prompt):
        for index, ids in enumerate(prompt):
            _check_non_negative(ids, f"prompt.{index}")
        return list(prompt)
    raise field_error("prompt", "Input should be a valid string, a list of strings, a list of token ids or a "
                                "list of lists of token ids")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_non_negative(ids: Sequence[int], path: str) -> None:
    for index, token in enumerate(ids):
        if token < 0:
            raise field_error(f"{path}.{index}", f"Input should be greater than or equal to 0, got {token}")


def _has_media(messages: list[Message]) -> bool:
    for message in messages:
        if isinstance(message.content, list):
            for part in message.content:
                if isinstance(part, ContentPart) and (part.type in _MEDIA_TYPES or part.image_url is not None):
                    return True
    return False


def _conversation(messages: list[Message], content_format: str) -> list[dict[str, Any]]:
    """The messages as the template sees them (vLLM's ``ConversationMessage`` dicts)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.role
        entry: dict[str, Any] = {"role": role, "content": _content(message.content, content_format)}
        if role == "assistant":
            if message.tool_calls is not None:
                calls = _tool_calls(message.tool_calls)
                if calls:
                    entry["tool_calls"] = calls
            reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
            if reasoning is not None:
                entry["reasoning"] = reasoning
                entry["reasoning_content"] = reasoning
        elif role == "tool":
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            content = entry["content"]
            if isinstance(content, list) and all(p.get("type") == "text" for p in content):
                entry["content"] = "\n".join(p.get("text", "") for p in content)
        if message.name is not None:
            entry["name"] = message.name
        if message.task is not None:
            entry["task"] = message.task
        if role == "developer":
            entry["tools"] = message.tools
        out.append(entry)
    return out


def _content(content: str | list[ContentPart | str] | None, content_format: str) -> Any:
    wrap = content_format == OPENAI_FORMAT
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        return [{"type": "text", "text": content}] if wrap else content
    else:
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part} if wrap else part)
                continue
            kind = part.type
            if kind in _TEXT_KEYS:
                text = getattr(part, _TEXT_KEYS[kind])
                if text is None:
                    continue  # vLLM skips a text/refusal part without content
                parts.append({"type": "text", "text": text} if wrap else text)
            elif kind == "tool_reference":
                parts.append({"type": "tool_reference", "name": part.name} if wrap else part.name)
            elif kind in _MEDIA_TYPES or (kind is None and part.image_url is not None):
                raise validation_error(f"{kind or 'image_url'} content is not supported: this model takes text "
                                       "only.", parameter="type", value=kind or "image_url")
            elif kind is None:
                raise validation_error("Invalid 'type' field in multimodal part.", parameter="type")
            else:
                raise validation_error(f"Unsupported chat content part type: {kind!r}. Supported types: "
                                       f"{_SUPPORTED_PART_TYPES}.", parameter="type", value=kind)
    if wrap:
        return parts
    return "\n".join(parts)


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects (what templates expect, as vLLM makes them)."""
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise validation_error("assistant tool_calls entries must be objects.", parameter="tool_calls")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise validation_error("chat completions only support assistant tool_calls of type 'function'.",
                                   parameter="tool_calls")
        arguments = function.get("arguments")
        parsed: Any = {}
        if isinstance(arguments, dict):
            parsed = arguments
        elif arguments:
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:  # malformed history must not fail every later turn: {} as vLLM
                parsed = {}
            if not isinstance(parsed, dict):
                parsed = {}
        out.append({**call, "function": {**function, "arguments": parsed}})
    return out


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    return converted


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system messages merged into one at the front (after developer -> system), as vLLM does."""
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        if index > 0 or texts:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def _cut_after_final_message(text: str, conversation: list[dict[str, Any]]) -> str:
    """``continue_final_message``: the prompt ends where the final message's content ends (transformers)."""
    final = conversation[-1]["content"]
    if isinstance(final, list):
        texts = [p["text"] for p in final if isinstance(p, dict) and p.get("type") == "text"]
        final = texts[-1] if texts else ""
    stripped = final.strip()
    if stripped not in text:
        raise BadRequestError("continue_final_message is set but the final message does not appear in the chat "
                              "after applying the chat template! This can happen if the chat template deletes "
                              "portions of the final message. Please verify the chat template and final message "
                              "in your chat to ensure they are compatible.")
    if final in text:
        return text[: text.rindex(final) + len(final)]
    return text[: text.rindex(stripped) + len(stripped)]
