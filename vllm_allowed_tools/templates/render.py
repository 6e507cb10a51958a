"""Render our chat templates without vLLM or transformers.

The environment mirrors the one Hugging Face tokenizers (and therefore vLLM) use for chat
templates (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls, a ``tojson`` that does not
escape HTML), so what we render here for training data and prefix checks is byte-identical to what
the server renders.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import template_path


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def load_template(name_or_path: str = "hermes") -> str:
    """Template source from a bundled short name or a file path."""
    if name_or_path.endswith(".jinja") or "/" in name_or_path:
        with open(name_or_path, encoding="utf-8") as handle:
            return handle.read()
    return template_path(name_or_path).read_text(encoding="utf-8")


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                *, template: str = "hermes", add_generation_prompt: bool = True,
                **template_kwargs: Any) -> str:
    """Render a conversation the way the server will (tools in Chat shape)."""
    return _compile(load_template(template)).render(
        messages=list(messages), tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, **template_kwargs)
