"""OpenAI request bodies -> ``GenerateRequest``s, as vLLM 0.32's render server makes them.

``Renderer`` holds one model's compiled template and tokenizer (built once, shared read-only) and
renders ``/v1/chat/completions`` bodies (the template, then the tokenizer without adding special
tokens again) and ``/v1/completions`` bodies (each prompt encoded with special tokens, or taken as
token ids), checks them as vLLM does (model name, tool choice, empty conversation, context length,
sampling values) and answers ``/tokenize`` and ``/detokenize``. Every refusal is a ``ClientError``
whose ``.status``/``.body()`` are vLLM's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from contract.errors import BadRequestError, NotFoundError
from rendering.generate_request import GenerateRequest, SamplingParams
from rendering.incremental import PromptEncoder, PromptState
from rendering.model import RenderModel
from rendering.requests import (
    ChatRequest,
    CompletionRequest,
    Message,
    decode_chat_request,
    decode_completion_request,
)
from rendering.sampling import chat_sampling_params, completion_sampling_params, validation_error
from rendering.template import OPENAI_FORMAT, ChatTemplate

#: vLLM's VLLM_MAX_CHARS_PER_TOKEN: a text prompt longer than this many characters per allowed
#: token is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 128

#: names ``apply_chat_template`` takes itself; request kwargs with these names always reach the template
_APPLY_KWARGS = frozenset({"add_generation_prompt", "continue_final_message", "documents", "tools",
                           "reasoning_effort", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


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


_tokenize_decoder = msgspec.json.Decoder(_TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(_DetokenizeRequest)
_encoder = msgspec.json.Encoder()


def new_request_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` with 16 hex digits, the form vLLM 0.32's render answers carry."""
    return f"{prefix}-{uuid.uuid4().hex[16:]}"


class Renderer:
    """One model's render: compiled template, tokenizer, limits. Thread-safe, no per-request state."""

    def __init__(self, model: RenderModel) -> None:
        self.model = model
        self._tokenizer = model.tokenizer
        self._prompts = PromptEncoder(model.tokenizer)  # incremental encode (rendering.incremental)
        specials = {"bos_token": model.bos_token, "eos_token": model.eos_token}
        self._template = ChatTemplate(model.chat_template, special_tokens=specials) if model.chat_template else None
        self._defaults = dict(model.default_sampling)
        self._default_max_tokens: int | None = self._defaults.pop("max_tokens", None)

    # --- chat ------------------------------------------------------------------------------------
    def render_chat(
        self, body: bytes, *, request_id: str | None = None, previous: PromptState | None = None
    ) -> RenderedChat:
        """A ``/v1/chat/completions`` body -> its ``GenerateRequest`` (+ what derender needs)."""
        chat = decode_chat_request(body)
        tools = _check_chat_fields(chat)
        self.check_model(chat.model)
        if chat.use_beam_search:
            raise BadRequestError("Beam search is not supported by the render endpoint")
        if tools is not None and chat.tool_choice not in (None, "none"):
            _refuse_tool_choice(chat.tool_choice)
        text = self.chat_text(chat, tools=tools)

        if chat.max_completion_tokens is not None:
            requested, param = chat.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = chat.max_tokens, "max_tokens"
        max_input = self._check_output_budget(requested, param)
        self._check_text_length(text, max_input, requested)
        if chat.add_special_tokens:
            prompt = PromptState(text=text, token_ids=self._tokenizer.encode(text, add_special_tokens=True).ids)
        else:
            prompt = self._prompts.encode(text, previous)
        token_ids = list(prompt.token_ids)
        self._check_prompt_length(len(token_ids), max_input, requested)
        if not token_ids:
            raise BadRequestError("No token_ids rendered")

        params = chat_sampling_params(chat, max_tokens=self._max_tokens(len(token_ids), requested),
                                      defaults=self._defaults)
        request = GenerateRequest(
            request_id=request_id or new_request_id("chatcmpl"),
            token_ids=token_ids,
            sampling_params=params,
            model=chat.model,
            stream=bool(chat.stream),
            stream_options=chat.stream_options if chat.stream else None,
            cache_salt=chat.cache_salt,
            priority=chat.priority,
        )
        return RenderedChat(request=request, chat=chat, prompt=prompt)

    def chat_text(self, chat: ChatRequest, *, tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to ``chat``'s conversation (the text render tokenizes)."""
        if chat.chat_template is not None or (chat.chat_template_kwargs or {}).get("chat_template") is not None:
            raise BadRequestError("Chat template is passed with request, but --trust-request-chat-template "
                                  "is not set. Refused request with untrusted chat template.")
        if not chat.messages:
            raise BadRequestError("Cannot apply chat template to an empty conversation. "
                                  "Provide at least one message.")
        template = self._require_template()
        return self._apply_template(template, chat.messages, chat_template_kwargs=chat.chat_template_kwargs,
                                    add_generation_prompt=chat.add_generation_prompt,
                                    continue_final_message=chat.continue_final_message,
                                    documents=chat.documents, reasoning_effort=chat.reasoning_effort, tools=tools)

    # --- completions -----------------------------------------------------------------------------
    def render_completions(self, body: bytes, *, request_id: str | None = None) -> list[GenerateRequest]:
        """A ``/v1/completions`` body -> one ``GenerateRequest`` per prompt (ids ``<id>-<i>`` if several)."""
        req = decode_completion_request(body)
        _check_common_fields(req)
        self.check_model(req.model)
        if req.suffix is not None:
            raise BadRequestError("suffix is not currently supported")
        if req.prompt_embeds is not None:
            raise BadRequestError("prompt_embeds are not supported by this renderer", param="prompt_embeds")
        if req.use_beam_search:
            raise BadRequestError("Beam search is not supported by the render endpoint")
        prompts = _completion_prompts(req.prompt)
        max_input = self._check_output_budget(req.max_tokens, "max_tokens")

        base = request_id or new_request_id("cmpl")
        out: list[GenerateRequest] = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self._check_text_length(prompt, max_input, req.max_tokens)
                token_ids = self._tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens).ids
            else:
                token_ids = self._check_token_ids(prompt)
            self._check_prompt_length(len(token_ids), max_input, req.max_tokens)
            if not token_ids:
                raise BadRequestError("No token_ids rendered")
            params = completion_sampling_params(req, max_tokens=self._max_tokens(len(token_ids), req.max_tokens),
                                                defaults=self._defaults)
            out.append(self._completion_request(req, f"{base}-{index}" if len(prompts) > 1 else base,
                                                token_ids, params))
        return out

    def _completion_request(self, req: CompletionRequest, request_id: str, token_ids: list[int],
                            params: SamplingParams) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id,
            token_ids=token_ids,
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
        self.check_model(req.model)
        if req.messages is not None:
            if req.chat_template is not None:
                raise BadRequestError("Chat template is passed with request, but --trust-request-chat-template "
                                      "is not set. Refused request with untrusted chat template.")
            if not req.messages:
                raise BadRequestError("Cannot apply chat template to an empty conversation. "
                                      "Provide at least one message.")
            text = self._apply_template(self._require_template(), req.messages,
                                        chat_template_kwargs=req.chat_template_kwargs,
                                        add_generation_prompt=req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message,
                                        documents=None, reasoning_effort=None, tools=req.tools)
            special = bool(req.add_special_tokens)
        elif req.prompt is not None:
            text = req.prompt
            special = True if req.add_special_tokens is None else req.add_special_tokens
        else:
            raise BadRequestError("Either `prompt` or `messages` must be given", param="prompt")
        encoding = self._tokenizer.encode(text, add_special_tokens=special)
        strs = list(encoding.tokens) if req.return_token_strs else None
        return _encoder.encode(_TokenizeResponse(count=len(encoding.ids), max_model_len=self.model.max_model_len,
                                                 tokens=encoding.ids, token_strs=strs))

    def detokenize(self, body: bytes) -> bytes:
        """``POST /detokenize`` ``{tokens}`` -> ``{prompt}`` (special tokens kept, as vLLM's)."""
        req = _decode_json(_detokenize_decoder, body)
        self.check_model(req.model)
        ids = self._check_token_ids(req.tokens)
        return _encoder.encode(_DetokenizeResponse(prompt=self._tokenizer.decode(ids, skip_special_tokens=False)))

    # --- checks -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """404 as vLLM for a model name this renderer does not serve (none given is fine)."""
        if name and name != self.model.name:
            raise NotFoundError(f"The model `{name}` does not exist. Valid aliases: {self.model.name}.",
                                param="model")

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise BadRequestError("As of transformers v4.44, default chat template is no longer allowed, so "
                                  "you must provide a chat template if the tokenizer does not define one.")
        return self._template

    def _check_output_budget(self, requested: int | None, param: str) -> int:
        """The prompt's token budget (context - requested output); 400 if the output alone exceeds it."""
        limit = self.model.max_model_len
        output = requested or 0
        if output > limit:
            raise validation_error(f"{param}={output} cannot be greater than max_model_len={limit}. "
                                   "Please request fewer output tokens.", parameter=param, value=output)
        return limit - output

    def _check_text_length(self, text: str, max_input: int, requested: int | None) -> None:
        max_chars = max_input * MAX_CHARS_PER_TOKEN
        if len(text) > max_chars:
            raise validation_error(
                f"You passed {len(text)} input characters and requested {requested or 0} output tokens. "
                f"However, the model's context length is only {self.model.max_model_len} tokens, resulting in "
                f"a maximum input length of {max_input} tokens (at most {max_chars} characters). "
                "Please reduce the length of the input prompt.", parameter="input_text", value=len(text))

    def _check_prompt_length(self, count: int, max_input: int, requested: int | None) -> None:
        if count > max_input:
            raise validation_error(
                f"You passed {count} input tokens and requested {requested or 0} output tokens. "
                f"However, the model's context length is only {self.model.max_model_len} tokens, resulting in "
                f"a maximum input length of {max_input} tokens. Please reduce the length of the input prompt.",
                parameter="input_tokens", value=count)

    def _check_token_ids(self, ids: Sequence[Any]) -> list[int]:
        out = list(ids)
        for token in out:
            if not isinstance(token, int) or isinstance(token, bool):
                raise BadRequestError(f"Token ids must be integers, got {token!r}", param="prompt")
            if token < 0 or token >= self.model.vocab_size:
                raise BadRequestError(f"Token id {token} is out of vocabulary", param="prompt")
        return out

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """vLLM's ``get_max_tokens``: the smallest of the remaining context, the request, the default."""
        value = self.model.max_model_len - prompt_len
        if requested is not None:
            value = min(value, requested)
        if self._default_max_tokens is not None:
            value = min(value, self._default_max_tokens)
        return value

    # --- the template -------------------------------------------------------------------------
    def _apply_template(
        self,
        template: ChatTemplate,
        messages: list[Message],
        *,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        documents: list[dict[str, Any]] | None,
        reasoning_effort: str | None,
        tools: list[dict[str, Any]] | None,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise BadRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        conversation = _conversation(messages, template.content_format)
        extra: dict[str, Any] = {}
        if chat_template_kwargs:
            unexpected = {"chat_template", "tokenize"} & chat_template_kwargs.keys()
            if unexpected:
                raise BadRequestError(f"Found unexpected chat template kwargs from request: {unexpected}")
            accepted = template.variables | _APPLY_KWARGS
            extra = {k: v for k, v in chat_template_kwargs.items() if k in accepted}
        # the request's own fields win over chat_template_kwargs (vLLM's merge_kwargs)
        overrides = {"continue_final_message": continue_final_message, "reasoning_effort": reasoning_effort}
        extra.update({k: v for k, v in overrides.items() if v is not None})
        add_prompt = add_generation_prompt
        if documents is None:
            documents = extra.pop("documents", None)
        else:
            extra.pop("documents", None)
        tools = tools if tools is not None else extra.pop("tools", None)
        extra.pop("tools", None)
        extra.pop("add_generation_prompt", None)
        text = template.render(conversation, add_generation_prompt=add_prompt, tools=tools,
                               documents=documents, extra=extra)
        if continue_final_message:
            text = _cut_after_final_message(text, conversation)
        return text


def _decode_json(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"1 validation error: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from exc


def _check_common_fields(req: ChatRequest | CompletionRequest) -> None:
    """The request model's own validators vLLM runs while parsing the body."""
    if req.stream_options is not None and not req.stream:
        raise validation_error("Stream options can only be defined when `stream=True`.", parameter="stream_options")
    if req.prompt_logprobs is not None:
        if req.stream and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1):
            raise validation_error("`prompt_logprobs` are not available when `stream=True`.",
                                   parameter="prompt_logprobs")
        if req.prompt_logprobs < 0 and req.prompt_logprobs != -1:
            raise validation_error("`prompt_logprobs` must be a positive value or -1.",
                                   parameter="prompt_logprobs", value=req.prompt_logprobs)
    if req.cache_salt is not None and not req.cache_salt:
        raise BadRequestError("Parameter 'cache_salt' must be a non-empty string if provided.")


def _check_chat_fields(chat: ChatRequest) -> list[dict[str, Any]] | None:
    """Chat's validators (logprobs, tool choice); the tools the template sees (None: none)."""
    _check_common_fields(chat)
    top = chat.top_logprobs
    if top is not None:
        if top < 0 and top != -1:
            raise validation_error("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs",
                                   value=top)
        if (top == -1 or top > 0) and not chat.logprobs:
            raise validation_error("when using `top_logprobs`, `logprobs` must be set to true.",
                                   parameter="top_logprobs")
    choice = chat.tool_choice
    if choice is msgspec.UNSET:
        chat.tool_choice = choice = "auto" if chat.tools else "none"
    if choice == "none" or choice is None:
        return chat.tools
    if chat.tools is None:
        raise BadRequestError("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise BadRequestError(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", "
                              "\"auto\" or \"required\" are supported.")
    if choice == "required" and not chat.tools:
        chat.tool_choice = "none"
        chat.tools = None
        return None
    return chat.tools


def _refuse_tool_choice(choice: Any) -> None:
    """No tool parser here: "auto", "required" and named tools are refused as vLLM refuses them."""
    if choice == "auto":
        raise BadRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    raise BadRequestError(f'tool_choice="{choice}" requires --tool-call-parser to be set')


def _completion_prompts(prompt: str | list[Any] | None) -> list[str | list[int]]:
    """The prompt field's prompts: a string, strings, token ids, or lists of token ids."""
    if prompt is None:
        raise BadRequestError("At least one of `prompt` or `prompt_embeds` must be set.", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("You must pass at least one prompt", param="prompt")
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise BadRequestError("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of lists of token ids", param="prompt")
        return list(prompt)
    if isinstance(first, int) and not isinstance(first, bool):
        return [prompt]
    if isinstance(first, list):
        if not all(isinstance(p, list) for p in prompt):
            raise BadRequestError("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of lists of token ids", param="prompt")
        return list(prompt)
    raise BadRequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                          "of token ids", param="prompt")


def _conversation(messages: list[Message], content_format: str) -> list[dict[str, Any]]:
    """The messages as the template sees them (vLLM's ``ConversationMessage`` dicts)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": _content(message, content_format)}
        if message.role == "assistant":
            if message.tool_calls is not None:
                entry["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
            reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
            if reasoning is not None:
                entry["reasoning"] = reasoning
                entry["reasoning_content"] = reasoning
        elif message.role == "tool" and message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        if message.role == "developer":
            entry["tools"] = message.tools
        out.append(entry)
    return out


def _content(message: Message, content_format: str) -> Any:
    content = message.content
    if content is None:
        texts: list[str] = []
    elif isinstance(content, str):
        if content_format != OPENAI_FORMAT:
            return content
        texts = [content]
    else:
        texts = []
        for part in content:
            if part.type in _TEXT_PART_TYPES:
                texts.append(part.text or "")
            elif part.type == "refusal":
                texts.append(part.refusal or "")
            else:
                raise BadRequestError(f"Content part type {part.type!r} is not supported by this model "
                                      "(text only)", param="messages")
    if content_format == OPENAI_FORMAT:
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(texts)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """Assistant tool calls with JSON-string arguments as dicts (what templates expect, as vLLM does)."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        return call
    parsed: Any = {}
    if arguments:
        try:
            parsed = json.loads(arguments)
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"tool call arguments are not valid JSON: {exc}", param="messages") from exc
    return {**call, "function": {**function, "arguments": parsed}}


def _cut_after_final_message(text: str, conversation: list[dict[str, Any]]) -> str:
    """``continue_final_message``: the prompt ends where the final message's content ends."""
    final = conversation[-1]["content"]
    if isinstance(final, list):
        final = final[-1]["text"] if final else ""
    stripped = final.strip()
    if stripped not in text:
        raise BadRequestError("continue_final_message is set but the final message does not appear in the chat "
                              "after applying the chat template! This can happen if the chat template deletes "
                              "portions of the final message. Please verify the chat template and final message "
                              "in your chat to ensure they are compatible.")
    if final in text:
        return text[: text.rindex(final) + len(final)]
    return text[: text.rindex(stripped) + len(stripped)]
