"""The conversation a chat template sees, built as vLLM builds its ``ConversationMessage`` dicts.

Text parts are joined with newlines for a template that reads ``message['content']`` as a string and
kept as ``[{"type": "text", ...}]`` lists for one that loops over it (``rendering.template`` tells
which); assistant tool-call arguments become objects (malformed JSON in history becomes ``{}`` so a
conversation stays usable); ``reasoning_content`` is carried as ``reasoning`` too; developer
messages become system ones for templates that do not know the role; tools are the dicts vLLM
dumps from its tool model. Text only: media parts are refused.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from contract.errors import BadRequestError
from rendering.requests import ContentPart, Message
from rendering.sampling import validation_error
from rendering.template import OPENAI_FORMAT

_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
_MEDIA_TYPES = frozenset({"input_image", "image_url", "image_embeds", "audio_embeds", "video_embeds",
                          "prompt_embeds", "image_pil", "audio_url", "input_audio", "video_url"})
_SUPPORTED_PART_TYPES = ", ".join(sorted(_MEDIA_TYPES | set(_TEXT_KEYS) | {"tool_reference"}))


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A chat request's tool function (vLLM's ``FunctionDefinition``: other keys are dropped)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """One entry of a chat request's ``tools``."""

    type: str = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None


def tool_dicts(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as vLLM hands them to the template (``model_dump`` of its tool model)."""
    if tools is None:
        return None
    out = []
    for tool in msgspec.convert(tools, list[Tool]):
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


def has_media(messages: list[Message]) -> bool:
    """Whether any message carries a media part (image, audio, video, embeddings)."""
    for message in messages:
        if isinstance(message.content, list):
            for part in message.content:
                if isinstance(part, ContentPart) and (part.type in _MEDIA_TYPES or part.image_url is not None):
                    return True
    return False


def build_conversation(messages: list[Message], content_format: str) -> list[dict[str, Any]]:
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


def developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    return converted


def consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def cut_after_final_message(text: str, conversation: list[dict[str, Any]]) -> str:
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
