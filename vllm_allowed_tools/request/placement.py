"""Where the per-turn policy block enters the prompt, and the catalog's canonical form.

The catalog is the stable part of an agent's prompt and the allowed subset the changing part, so
the subset must be rendered after the whole history: then turn N+1's prompt begins with all of turn
N's history and vLLM's prefix cache reuses it. A model's own chat template knows nothing of our
policy, so the policy enters in one of the ways below, each rendered by the template itself in the
model's own markup; which one a template supports is found by :mod:`.template_probe`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .catalog import Api

#: the template reads the ``allowed_tools_policy`` variable (our bundled templates do)
TEMPLATE_VARIABLE = "template-variable"
#: a trailing system message after the history, rendered by the template
SYSTEM_MESSAGE = "system-message"
#: the policy text appended to the last message of the history
LAST_MESSAGE = "last-message"
#: the opt-in compatibility fallback: the model sees only the allowed tools (no policy block)
FILTER_CATALOG = "filter-catalog"

#: the order a start-up probe tries the placements in: the template's own block first, then the
#: ones that add nothing to an existing message
PROBE_ORDER = (TEMPLATE_VARIABLE, SYSTEM_MESSAGE, LAST_MESSAGE)
PLACEMENTS = (*PROBE_ORDER, FILTER_CATALOG)

TEMPLATE_KWARG = "allowed_tools_policy"


def policy_text(mode: str, names: Iterable[str]) -> str:
    """The policy block, worded as our bundled templates word it."""
    return f"Allowed tools this turn ({mode}): {', '.join(sorted(names))}"


def place_policy(body: dict[str, Any], api: Api, placement: str, mode: str,
                 names: Iterable[str]) -> dict[str, Any]:
    """``body`` with the policy block where ``placement`` puts it (a new dict; the client's
    messages are never mutated). The template-variable placement travels in
    ``chat_template_kwargs`` and the filter fallback has no block: both return ``body``."""
    text = policy_text(mode, names)
    history_field = body.get("messages" if api == "chat" else "input")
    if not isinstance(history_field, list) and not (api == "responses" and isinstance(history_field, str)):
        return body   # not a history vLLM accepts: it answers with its own 400, naming the field
    if placement == SYSTEM_MESSAGE:
        return _with_history(body, api, [*_history(body, api), _system(api, text)])
    if placement == LAST_MESSAGE:
        history = _history(body, api)
        last = _appended(history[-1], api, text) if history else None
        if last is None or last is history[-1]:   # nothing to extend: a message of its own
            return _with_history(body, api, [*history, _system(api, text)])
        return _with_history(body, api, [*history[:-1], last])
    return body


def _history(body: Mapping[str, Any], api: Api) -> list[Any]:
    if api == "chat":
        return list(body.get("messages") or [])
    items = body.get("input")
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": items}]
    return list(items or [])


def _with_history(body: dict[str, Any], api: Api, history: list[Any]) -> dict[str, Any]:
    return {**body, ("messages" if api == "chat" else "input"): history}


def _system(api: Api, text: str) -> dict[str, Any]:
    if api == "chat":
        return {"role": "system", "content": text}
    return {"type": "message", "role": "system", "content": text}


def _appended(message: Any, api: Api, text: str) -> Any:
    """The last history entry with ``text`` after its own content; an entry with no text to
    extend (e.g. an assistant call without content) gets the policy as a system message after it."""
    if not isinstance(message, Mapping):
        return message
    field = "output" if api == "responses" and message.get("type") == "function_call_output" \
        else "content"
    value = message.get(field)
    if isinstance(value, str):
        return {**message, field: f"{value}\n\n{text}"}
    if isinstance(value, list) and value and all(isinstance(part, Mapping) for part in value):
        kind = "text" if api == "chat" else \
            "output_text" if message.get("role") == "assistant" else "input_text"
        return {**message, field: [*value, {"type": kind, "text": f"\n\n{text}"}]}
    return message


def canonical_tools(tools: Sequence[Any], api: Api) -> list[Any]:
    """The catalog in canonical order: tools sorted by name (then type), object keys sorted at
    every level, except that a schema's ``properties`` keep the client's order: that is the
    argument order the grammar enforces and the model writes, so sorting it would change what the
    model is asked to produce, not only how the prompt is spelled."""
    return sorted((_canonical_value(tool) for tool in tools), key=lambda tool: _tool_key(tool, api))


def _tool_key(tool: Any, api: Api) -> tuple[str, str]:
    if not isinstance(tool, Mapping):
        return ("", "")
    kind = str(tool.get("type") or "")
    source = tool.get("function") if api == "chat" and isinstance(tool.get("function"), Mapping) \
        else tool
    return (str(source.get("name") or ""), kind)


def _canonical_value(value: Any, *, keep_order: bool = False) -> Any:
    if isinstance(value, Mapping):
        keys = list(value) if keep_order else sorted(value, key=str)
        return {key: _canonical_value(value[key], keep_order=(key == "properties" and not keep_order
                                                               and isinstance(value[key], Mapping)))
                for key in keys}
    if isinstance(value, list):
        return [_canonical_value(item) for item in value]
    return value
