"""A model's chat template, rendered the way transformers renders it, with jinja2 alone.

Chat templates are Jinja code shipped with the model (``chat_template.jinja``,
``chat_template.json`` or ``tokenizer_config.json``). transformers renders them in an
immutable sandbox with ``trim_blocks`` / ``lstrip_blocks``, loop controls, a ``tojson``
that does not escape HTML, and ``raise_exception`` / ``strftime_now``; the special tokens
(``bos_token``, ``eos_token``, ...) are variables. The same environment is built here so
the gateway renders a prompt to the same text as ``AutoTokenizer.apply_chat_template``
without importing transformers (and, through it, torch). ``{% generation %}`` blocks
(assistant-mask markers) render their body.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.errors import InvalidRequestError, ModelLoadError


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers tracks assistant tokens there; we render it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached); ModelLoadError if the model's template is not valid Jinja."""
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template is not valid Jinja: {exc}") from exc


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def find_chat_template(directory: Path, tokenizer_config: dict) -> str | None:
    """The default chat template, where transformers looks for it first to last."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        try:
            return json.loads(json_file.read_text())["chat_template"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"bad {json_file}: {exc}") from exc
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates; the one called "default" applies
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def render(source: str, messages: list[dict[str, Any]], special_tokens: dict[str, str],
           add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The prompt text; a template that rejects the conversation is the request's fault (400)."""
    try:
        return compile_template(source).render(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequestError(f"the model's chat template rejected the messages: {exc}",
                                  param="messages") from exc
