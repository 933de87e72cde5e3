"""The chat template environment (transformers' ``apply_chat_template``) and the conversation the
template sees (vLLM's ``ConversationMessage`` dicts)."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any

import pytest

from contract.errors import BadRequestError
from rendering.model import RenderModel
from rendering.render import Renderer
from rendering.requests import decode_chat_request
from rendering.template import OPENAI_FORMAT, STRING_FORMAT, ChatTemplate


def _renderer(model: RenderModel, template: str) -> Renderer:
    return Renderer(dataclasses.replace(model, chat_template=template))


def _text(renderer: Renderer, messages: list[dict[str, Any]] | None = None, **fields: Any) -> str:
    body = {"model": "tiny-llama", "messages": messages or [{"role": "user", "content": "hi"}], **fields}
    return renderer.chat_text(decode_chat_request(json.dumps(body).encode()))


def test_blocks_are_trimmed_and_lstripped(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "  {% if true %}\nX\n  {% endif %}\nY")
    assert _text(renderer) == "X\nY"  # plain jinja2 would give "  \nX\n  \nY"


def test_loop_controls(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                                     "{{ m.content }}{% endfor %}")
    assert _text(renderer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_tojson_keeps_text_as_it_is(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{{ messages[0]['content'] | tojson }}|{{ {'k': [1]} | tojson(indent=2) }}")
    content = 'café <b> "q" 😀'
    assert _text(renderer, [{"role": "user", "content": content}]) == (
        json.dumps(content, ensure_ascii=False) + "|" + json.dumps({"k": [1]}, indent=2))


def test_raise_exception_is_a_400_with_the_templates_message(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{% if messages[0]['role'] != 'user' %}"
                                     "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                                     "{% endif %}ok")
    assert _text(renderer) == "ok"
    body = json.dumps({"model": "tiny-llama", "messages": [{"role": "system", "content": "s"}]}).encode()
    with pytest.raises(BadRequestError) as caught:
        renderer.render_chat(body)
    assert caught.value.status == 400
    assert json.loads(caught.value.body()) == {"error": {
        "message": "Conversation roles must alternate user/assistant", "type": "BadRequestError",
        "param": None, "code": 400}}


def test_strftime_now(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{{ strftime_now('%Y') }}")
    assert _text(renderer) in {str(datetime.now().year), str(datetime.now().year - 1)}


def test_the_sandbox_is_immutable(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(BadRequestError, match="unsafe"):
        _text(renderer)


def test_the_generation_block_renders_its_body(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{% for m in messages %}{% generation %}[{{ m.content }}]"
                                     "{% endgeneration %}{% endfor %}")
    assert _text(renderer) == "[hi]"


def test_special_tokens_and_the_generation_prompt(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}")
    assert _text(renderer) == "<s>|</s>|<pad>|True"
    assert _text(renderer, add_generation_prompt=False) == "<s>|</s>|<pad>|False"


def test_chat_template_kwargs_reach_the_template(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{{ custom }}|{{ enable_thinking }}|{{ add_generation_prompt }}")
    text = _text(renderer, chat_template_kwargs={"custom": "C", "enable_thinking": False,
                                                 "add_generation_prompt": False, "unused": 1})
    # the request's own add_generation_prompt (default true) wins over the kwargs', as vLLM merges them
    assert text == "C|False|True"
    # reasoning_effort switches enable_thinking unless the kwargs name it
    assert _text(renderer, reasoning_effort="none") == "|False|True"
    assert _text(renderer, reasoning_effort="high") == "|True|True"
    assert _text(renderer, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == "|False|True"


def test_content_parts_joined_for_a_string_template(tiny_model: RenderModel, renderer: Renderer) -> None:
    parts = [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"},
             {"type": "thinking", "thinking": "t"}, {"type": "text", "text": None}]
    assert ChatTemplate(tiny_model.chat_template or "", special_tokens={}).content_format == STRING_FORMAT
    assert _text(renderer, [{"role": "user", "content": parts}]) == "<s><|user|>\na\nb\nc\nt\n<|assistant|>\n"
    assert _text(renderer, [{"role": "user", "content": None}]) == "<s><|user|>\n\n<|assistant|>\n"


def test_content_parts_as_a_list_for_an_openai_template(tiny_model: RenderModel) -> None:
    template = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    renderer = _renderer(tiny_model, template)
    assert ChatTemplate(template, special_tokens={}).content_format == OPENAI_FORMAT
    assert _text(renderer, [{"role": "user", "content": "x"}]) == "[x]"
    assert _text(renderer, [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]) == "[a][b]"


def test_media_and_unknown_parts_are_refused(renderer: Renderer) -> None:
    with pytest.raises(BadRequestError) as caught:
        _text(renderer, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert caught.value.param == "type"
    with pytest.raises(BadRequestError) as caught:
        _text(renderer, [{"role": "user", "content": [{"type": "weird", "text": "x"}]}])
    assert caught.value.message.startswith("Unsupported chat content part type: 'weird'. Supported types: ")
    assert caught.value.message.endswith("(parameter=type, value=weird)")


def test_tools_reach_the_template_as_vllm_dumps_them(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{{ tools | tojson }}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}, "extra": 1}
    body = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                       "tools": [tool], "tool_choice": "none"}).encode()
    ids = renderer.render_chat(body).request.token_ids
    expected = [{"type": "function", "function": {"name": "f", "description": None,
                                                  "parameters": {"type": "object"}}}]
    assert tiny_model.tokenizer.decode(ids) == json.dumps(expected, ensure_ascii=False)


def test_tool_call_arguments_become_objects(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{% for m in messages %}{% for c in m.tool_calls or [] %}"
                                     "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}")
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 5}'}},
             {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
             {"id": "3", "type": "function", "function": {"name": "h", "arguments": "[1]"}}]
    assert _text(renderer, [{"role": "assistant", "content": None, "tool_calls": calls}]) == '{"x": 5};{};{};'


def test_reasoning_content_is_carried_under_both_names(tiny_model: RenderModel) -> None:
    renderer = _renderer(tiny_model, "{{ messages[0].reasoning }}|{{ messages[0].reasoning_content }}")
    assert _text(renderer, [{"role": "assistant", "content": "a", "reasoning_content": "r"}]) == "r|r"


def test_developer_messages_become_system_for_a_template_without_the_role(renderer: Renderer) -> None:
    messages = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"},
                {"role": "system", "content": "s"}]
    assert _text(renderer, messages) == "<s><|system|>\nd\n\ns\n<|user|>\nu\n<|assistant|>\n"


def test_continue_final_message_ends_the_prompt_inside_the_last_message(renderer: Renderer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello wor"}]
    text = _text(renderer, messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<s><|user|>\nhi\n<|assistant|>\nHello wor"


def test_the_template_is_compiled_once(renderer: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    import jinja2

    def no_compiling(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("compiled per request")

    monkeypatch.setattr(jinja2.Environment, "from_string", no_compiling)
    monkeypatch.setattr(jinja2.Environment, "parse", no_compiling)
    body = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert renderer.render_chat(body).request.token_ids
