"""``custom`` tools (Codex's ``apply_patch``), on Responses and Chat Completions: read, compiled, served.

vLLM 0.32 refuses a ``custom`` tool whose ``format`` is a grammar (a 400 on the whole request, so a
client that sends one, as Codex does for its own models, cannot run a turn); a free-form (``text``)
custom tool it serves, shown to the model as a function with one string field ``input`` and
answered as a ``custom_tool_call``. :func:`read_custom_tools` checks every grammar tool, compiles
its grammar once per digest (a grammar that does not compile is a 400 naming its
``tools[i].format.definition``, before generation) and gives the tools as vLLM accepts them: the
grammar tool as a text tool whose description carries the grammar, so the model sees it. The
grammars then constrain and check that tool's input (:class:`CustomTools`).

Chat Completions' ``custom`` tools (``{"type": "custom", "custom": {"name", "description",
"format"}}``) vLLM 0.32 refuses at validation whatever their format (its Chat ``tools`` take
functions only): every one reaches vLLM as the function vLLM's Responses path shows a custom tool
as (one string field ``input``, :func:`.identity.custom_parameters`), the grammar in its
description; the response side gives the client its custom calls back (:mod:`..response.chat_custom`).
No vLLM imports.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..ebnf import ebnf_text
from ..errors import AllowedToolsError

__all__ = ["CODE_INVALID_CUSTOM_TOOL", "CustomGrammar", "CustomTools", "input_grammar", "is_grammar_tool",
           "read_custom_tools", "served_messages"]

#: the 400 ``code`` of a custom tool this server cannot take as sent
CODE_INVALID_CUSTOM_TOOL = "invalid_custom_tool"
SYNTAXES = ("lark", "regex")
#: the longest grammar definition read (Codex's apply_patch is ~2 KB; compiling is linear or worse)
MAX_DEFINITION_CHARS = 100_000
#: compiled grammars kept (catalogs repeat every turn; bounded: definitions are client input)
CACHE_ENTRIES = 256


@dataclass(frozen=True)
class CustomGrammar:
    """One custom tool's grammar: as the client wrote it, and as xgrammar's EBNF (``root`` is the
    whole input)."""
    name: str
    syntax: Literal["lark", "regex"]
    definition: str
    digest: str
    ebnf: str

    def admits(self, text: str) -> bool:
        """Whether ``text`` (a call's whole input) is a string the grammar admits."""
        from xgrammar.testing import _is_grammar_accept_string
        return bool(_is_grammar_accept_string(_grammar(self.ebnf), text))


@dataclass(frozen=True)
class CustomTools:
    """The request's grammar custom tools (by name) and its ``tools`` as vLLM takes them (None:
    nothing to change)."""
    grammars: Mapping[str, CustomGrammar]
    served_tools: list[Any] | None
    #: every custom tool's name (free-form ones too): on Chat Completions the functions whose
    #: calls go back to the client as custom calls
    names: frozenset[str] = frozenset()

    def grammar_for(self, name: str | None) -> CustomGrammar | None:
        return self.grammars.get(name) if name is not None else None


NO_CUSTOM_TOOLS = CustomTools({}, None)


def _error(message: str, param: str) -> AllowedToolsError:
    return AllowedToolsError(message, param=param, code=CODE_INVALID_CUSTOM_TOOL)


def read_custom_tools(tools: Any, api: Literal["chat", "responses"]) -> CustomTools:
    """The request's custom tools, checked and their grammars compiled; raises AllowedToolsError
    (a 400 naming the field) for one this server cannot take. On Responses only grammar tools
    change (to text tools); on Chat Completions every custom tool becomes a function."""
    if api not in ("chat", "responses") or not isinstance(tools, list):
        return NO_CUSTOM_TOOLS
    grammars: dict[str, CustomGrammar] = {}
    names: dict[str, str] = {}
    served: list[Any] = []
    changed = False
    for index, tool in enumerate(tools):
        if not (isinstance(tool, Mapping) and tool.get("type") == "custom"):
            served.append(tool)
            continue
        param = f"tools[{index}]"
        if api == "chat":
            inner = tool.get("custom")
            if not isinstance(inner, Mapping):
                raise _error("a Chat Completions custom tool is {\"type\": \"custom\", \"custom\": "
                             "{\"name\": ..., \"description\": ..., \"format\": ...}}; `custom` must "
                             "be an object", f"{param}.custom")
            tool, param = inner, f"{param}.custom"
        grammar = _read_one(tool, param)
        name = tool["name"]
        if name in names and (api == "chat" or grammar is not None or names[name] == "grammar"):
            raise _error(f"two custom tools are named {name!r}; give each tool its own name",
                         f"{param}.name")
        names[name] = "grammar" if grammar is not None else "text"
        if grammar is not None:
            grammars[grammar.name] = grammar
        if api == "chat":
            served.append(_as_chat_function(tool, grammar))
            changed = True
        elif grammar is not None:
            served.append(_as_text_tool(tool, grammar))
            changed = True
        else:
            served.append(tool)
    return CustomTools(grammars, served if changed else None, frozenset(names))


def served_messages(messages: Any) -> list[Any] | None:
    """A Chat Completions history with each assistant ``custom`` tool call (``{"id", "type":
    "custom", "custom": {"name", "input"}}``, as the client got it back) in the function shape
    vLLM and the chat template take (``arguments`` the JSON object ``{"input": ...}``, what the
    model wrote); None when no message has one."""
    if not isinstance(messages, list):
        return None
    served: list[Any] = []
    changed = False
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if isinstance(calls, list) and any(_is_custom_call(call) for call in calls):
            message = {**message, "tool_calls": [_as_function_call(call) if _is_custom_call(call)
                                                 else call for call in calls]}
            changed = True
        served.append(message)
    return served if changed else None


def _is_custom_call(call: Any) -> bool:
    return isinstance(call, Mapping) and call.get("type") == "custom" \
        and isinstance(call.get("custom"), Mapping)


def _as_function_call(call: Mapping[str, Any]) -> dict[str, Any]:
    import json
    custom = call["custom"]
    text = custom.get("input")
    served = {key: value for key, value in call.items() if key not in ("type", "custom")}
    return {**served, "type": "function", "function": {
        "name": custom.get("name"),
        "arguments": json.dumps({"input": text if isinstance(text, str) else ""}, ensure_ascii=False)}}


def _read_one(tool: Mapping[str, Any], param: str) -> CustomGrammar | None:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _error("a custom tool needs a non-empty string `name`", f"{param}.name")
    fmt = tool.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise _error("`format` of a custom tool is an object: {\"type\": \"text\"} or "
                     "{\"type\": \"grammar\", \"syntax\": \"lark\" | \"regex\", \"definition\": ...}",
                     f"{param}.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind != "grammar":
        raise _error(f"`format.type` of a custom tool is \"text\" or \"grammar\", not {kind!r}",
                     f"{param}.format.type")
    syntax = fmt.get("syntax")
    if syntax not in SYNTAXES:
        raise _error(f"`format.syntax` is \"lark\" or \"regex\", not {syntax!r}", f"{param}.format.syntax")
    definition = fmt.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise _error("`format.definition` is the grammar's text: a non-empty string",
                     f"{param}.format.definition")
    if len(definition) > MAX_DEFINITION_CHARS:
        raise _error(f"`format.definition` is {len(definition)} characters; this server reads grammars "
                     f"of up to {MAX_DEFINITION_CHARS}", f"{param}.format.definition")
    return compile_custom_grammar(name, syntax, definition, f"{param}.format.definition")


def _as_text_tool(tool: Mapping[str, Any], grammar: CustomGrammar) -> dict[str, Any]:
    """The tool as vLLM serves it: free-form input, the grammar told to the model in the
    description (the constraint itself travels with the decode-time grammar)."""
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    return {**tool, "description": _told(description, grammar), "format": {"type": "text"}}


def _as_chat_function(tool: Mapping[str, Any], grammar: CustomGrammar | None) -> dict[str, Any]:
    """A Chat Completions custom tool as vLLM's Chat validation takes it: the function vLLM's
    Responses path shows a custom tool as (one string field ``input``), the grammar told to the
    model in the description."""
    from .identity import custom_parameters
    description = tool.get("description") if isinstance(tool.get("description"), str) else None
    if grammar is not None:
        description = _told(description or "", grammar)
    function: dict[str, Any] = {"name": tool["name"]}
    if description is not None:
        function["description"] = description
    function["parameters"] = custom_parameters()
    return {"type": "function", "function": function}


def _told(description: str, grammar: CustomGrammar) -> str:
    return (f"{description}\n\n" if description else "") + \
        f"The input must match this {grammar.syntax} grammar:\n{grammar.definition}"


# ------------------------------------------------------------------------------------ compiling

class _Compiled:
    """Grammars by digest (LRU, thread-safe): the same tool arrives every turn."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            return None

    def put(self, key: str, ebnf: str) -> None:
        with self._lock:
            self._items[key] = ebnf
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


_EBNF = _Compiled(CACHE_ENTRIES)
_GRAMMARS: dict[str, Any] = {}


def grammar_digest(syntax: str, definition: str) -> str:
    return hashlib.sha256(f"{syntax}\0{definition}".encode()).hexdigest()


def compile_custom_grammar(name: str, syntax: str, definition: str,
                           param: str = "format.definition") -> CustomGrammar:
    """``definition`` compiled to xgrammar's EBNF (cached by digest); AllowedToolsError naming
    ``param`` with the compiler's reason when it does not compile."""
    digest = grammar_digest(syntax, definition)
    ebnf = _EBNF.get(digest)
    if ebnf is None:
        import xgrammar

        try:
            grammar = xgrammar.Grammar.from_lark(definition) if syntax == "lark" \
                else xgrammar.Grammar.from_regex(definition)
        except Exception as exc:   # xgrammar raises RuntimeError/ValueError with the reason
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", " ".join(str(exc).split()))[:500]
            raise _error(f"the {syntax} grammar of custom tool {name!r} does not compile: {reason}. "
                         "Lookarounds, backreferences and inline flags are not supported; send a "
                         "grammar without them", param) from None
        ebnf = ebnf_text(grammar)
        _EBNF.put(digest, ebnf)
    return CustomGrammar(name=name, syntax=syntax, definition=definition, digest=digest,  # type: ignore[arg-type]
                         ebnf=ebnf)


def input_grammar(grammar: tuple[str, str] | None, name: str = "custom") -> str | None:
    """The EBNF that constrains a custom tool's input, from the ``(syntax, definition)`` its catalog
    spec holds (compiled once per digest); None for a free-form tool."""
    if grammar is None:
        return None
    return compile_custom_grammar(name, grammar[0], grammar[1]).ebnf


def _grammar(ebnf: str) -> Any:
    grammar = _GRAMMARS.get(ebnf)
    if grammar is None:
        import xgrammar
        grammar = xgrammar.Grammar.from_ebnf(ebnf)
        if len(_GRAMMARS) >= CACHE_ENTRIES:
            _GRAMMARS.clear()
        _GRAMMARS[ebnf] = grammar
    return grammar


def is_grammar_tool(tool: Any) -> bool:
    """A ``custom`` tool (Responses' flat shape or Chat's nested one) whose ``format`` is a grammar."""
    if not (isinstance(tool, Mapping) and tool.get("type") == "custom"):
        return False
    inner = tool.get("custom")
    fmt = (inner if isinstance(inner, Mapping) else tool).get("format")
    return isinstance(fmt, Mapping) and fmt.get("type") == "grammar"

