"""The chat template, compiled once and applied as transformers' ``apply_chat_template`` does.

The environment is the one transformers builds: jinja2's ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``break``/``continue``), the
``{% generation %}`` block (rendered as its body), a ``tojson`` filter that keeps non-ASCII text as
it is (``ensure_ascii=False``), and the globals ``raise_exception`` and ``strftime_now``. The template
sees ``messages``, ``add_generation_prompt``, ``tools``/``documents`` when given, the model's
special tokens (``bos_token``, ``eos_token``, ...) and the request's ``chat_template_kwargs``.

A template that calls ``raise_exception(msg)`` (or fails otherwise while rendering) gives a
``BadRequestError`` with the template's message, as vLLM answers 400 for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.runtime import new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from contract.errors import BadRequestError, ConfigError

#: content formats as vLLM names them: "string" templates read message["content"] as text,
#: "openai" templates iterate over a list of typed parts
STRING_FORMAT = "string"
OPENAI_FORMAT = "openai"


class TemplateRaised(Exception):
    """``raise_exception(message)`` called by a template."""


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # the same arguments and defaults as transformers' tojson filter (no HTML escaping, unlike jinja's)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}`` (transformers' assistant-mask marker): the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's chat template, compiled at start-up; ``render`` is all a request pays for."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None]) -> None:
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.content_format = _detect_content_format(ast)
        #: the names the template reads (kwargs it cannot see are not passed, as vLLM filters them)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self._specials = {k: v for k, v in special_tokens.items() if v is not None}
        #: the template's globals (a ChainMap over the environment's) flattened once, and the base of
        #: every render's variables: globals, then the special tokens (``Template.render`` would merge
        #: the ChainMap into a new dict and iterate it again per request)
        self._globals = dict(self._template.globals)
        self._base = {**self._globals, **self._specials}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; ``BadRequestError`` when the template raises."""
        context: dict[str, Any] = dict(self._base)
        if extra:
            context.update(extra)
        context["messages"] = messages
        context["tools"] = tools
        context["documents"] = documents
        context["add_generation_prompt"] = add_generation_prompt
        template = self._template
        try:
            # ``Template.render`` without its per-call merge of the globals: ``context`` has them already
            return "".join(template.root_render_func(
                new_context(template.environment, template.name, template.blocks, context, True, self._globals)))
        except Exception as exc:  # noqa: BLE001 - a template failing on a request is the request's 400
            raise BadRequestError(_reason(exc)) from exc


def _reason(exc: BaseException) -> str:
    """The most specific message in the error's chain (a template error's own), as vLLM reports it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (jinja2.TemplateError, TemplateRaised)):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


def _detect_content_format(ast: jinja2.nodes.Template) -> str:
    """"openai" when the template loops over a message's content (a list of parts), else "string".

    vLLM decides the same way (``--chat-template-content-format auto``): it looks for a ``for``
    loop whose iterable is ``<something>["content"]`` / ``<something>.content`` (or a variable
    named ``content``).
    """
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter):
            return OPENAI_FORMAT
        if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            return OPENAI_FORMAT
    return STRING_FORMAT


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        return _is_content_access(node.node)
    return False
