"""Grammars of the formats whose calls are one list (the ``json_array`` kind): Llama's pythonic
list in its own syntax, and every such format's ``auto`` turn.

* **Pythonic calls** (``pythonic``, ``llama4_pythonic``): ``[get_weather(city="Paris", days=3)]``,
  what vLLM's pythonic parsers read (a regex on the output's start, then ``ast.parse`` of the whole
  output). Each allowed function is one alternative, its schema's properties keyword arguments in
  declared order (required ones always, optional ones or not), each value xgrammar's JSON grammar
  for the property's schema made a Python literal: ``True``/``False``/``None`` for JSON's literals,
  strings without the escapes Python reads otherwise (``\\/`` stays two characters, a ``\\u`` escape
  of a surrogate stays a lone surrogate), and the :mod:`.safe_json` bounds. A name Python cannot
  take as a function or keyword (``get-weather``, ``class``, ``_x``: the parser's regex wants a
  letter first) is not written: an optional property is left out, a function that needs one is not
  callable in this syntax. A schema that names no properties takes no keyword arguments: free
  keyword names could repeat, which ``ast.parse`` refuses (the whole output then reads as text).
* **auto**: free text with the calls behind the format's own opening. After a trigger (Mistral's
  ``[TOOL_CALLS]``, Granite's ``<|tool_call|>``): only an array of allowed calls (xgrammar's
  ``triggered_tags``, one array: the parsers read the first). Where the opening cannot be told from
  text (xLAM's and the pythonic formats' ``[`` at the message's start): a dispatch at the start
  (an ``or``): the list of allowed calls, or text whose first character cannot open one and which
  holds none of the parser's other openings (xLAM's code fences, ``[TOOL_CALLS]``, ``<tool_call>``,
  ``</think>``).

No vLLM imports.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from xgrammar import StructuralTag

from ..errors import CapabilityError
from .argument_slots import json_ebnf
from .safe_json import reachable, safe_json_ebnf

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_RULE_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)
#: an EBNF literal, a character class or a name (names inside literals and classes are left alone)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')
_PYTHON_LITERALS = {'"true"': '"True"', '"false"': '"False"', '"null"': '"None"'}
#: JSON escapes Python reads alike (``\\/`` it keeps as two characters)
_JSON_ESCAPES = ('[\\"/\\\\bfnrt]', '[\\"\\\\/bfnrt]')
_PYTHON_ESCAPES = '[\\"\\\\bfnrt]'
#: a ``\\u`` escape of a UTF-16 surrogate pair (:mod:`.safe_json` admits them paired; Python reads
#: each as a lone surrogate) and xgrammar's own any-hex escape
_SURROGATE_PAIR = re.compile(r'\s*\|\s*"u" \[Dd\] \[8-9A-Ba-b\][^|\n]*')
_ANY_HEX_ESCAPE = '("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])'
_NO_SURROGATE_ESCAPE = '("u" ([0-9A-CE-Fa-ce-f] [0-9A-Fa-f] | [Dd] [0-7]) [0-9A-Fa-f] [0-9A-Fa-f])'
#: what may follow a string (xgrammar's lookahead), plus a keyword argument's closing parenthesis
_STRING_FOLLOW = ("[,}\\]:]", "[,}\\]:)]")


def python_name(name: str) -> bool:
    """A name the pythonic parsers read as a function or keyword argument."""
    return bool(_IDENTIFIER.match(name)) and not keyword.iskeyword(name)


def _renamed(ebnf: str, prefix: str) -> str:
    names = set(_RULE_NAME.findall(ebnf))

    def token(match: re.Match[str]) -> str:
        text = match.group(0)
        if text in _PYTHON_LITERALS:
            return _PYTHON_LITERALS[text]
        return prefix + text if text in names else text
    return _TOKEN.sub(token, ebnf)


@lru_cache(maxsize=2048)
def _python_value(schema_json: str, markers: tuple[str, ...], max_whitespace: int | None,
                  prefix: str) -> str:
    """Rules (entry ``<prefix>root``) for one value of ``schema_json`` as a Python literal."""
    node = {"type": "json_schema", "json_schema": json.loads(schema_json),
            "max_whitespace_cnt": max_whitespace}
    ebnf = _renamed(safe_json_ebnf(json_ebnf(node), markers), prefix)
    for escapes in _JSON_ESCAPES:
        ebnf = ebnf.replace(escapes, _PYTHON_ESCAPES)
    ebnf = _SURROGATE_PAIR.sub("", ebnf).replace(_ANY_HEX_ESCAPE, _NO_SURROGATE_ESCAPE)
    return ebnf.replace(*_STRING_FOLLOW)


def _literal(text: str) -> str:
    return json.dumps(text)


def _keyword_rules(index: int, schema: Mapping[str, Any], markers: tuple[str, ...],
                   max_whitespace: int | None) -> tuple[list[str], str] | None:
    """(rules, entry) for function ``index``'s keyword arguments; None when a required property
    has a name no keyword argument can have."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
    required = set(schema.get("required") or ())
    if any(name not in properties or not python_name(name) for name in required):
        return None
    defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    kept = [(name, prop) for name, prop in properties.items() if python_name(name) and prop is not False]
    rules: list[str] = []
    for number, (name, prop) in enumerate(kept):
        value = {} if prop is True else {**prop, **defs}
        rules.append(_python_value(json.dumps(value, sort_keys=True), markers, max_whitespace,
                                   f"v{index}_{number}_"))
    first, rest, count = f"k{index}_a", f"k{index}_r", len(kept)
    for number, (name, _) in enumerate(kept):
        argument = f"{_literal(name + '=')} v{index}_{number}_root"
        after = f"{rest}{number + 1}"
        if name in required:
            rules.append(f"{first}{number} ::= {argument} {after}")
            rules.append(f"{rest}{number} ::= \", \" {argument} {after}")
        else:
            rules.append(f"{first}{number} ::= {argument} {after} | {first}{number + 1}")
            rules.append(f"{rest}{number} ::= \", \" {argument} {after} | {after}")
    rules += [f'{first}{count} ::= ""', f'{rest}{count} ::= ""']
    return rules, f"{first}0"


def pythonic_calls_ebnf(functions: Sequence[tuple[str, Mapping[str, Any]]], *, parallel: bool,
                        markers: Sequence[str] = (), max_whitespace: int | None = None,
                        wire_format_name: str = "pythonic") -> str:
    """The EBNF (entry ``root``) of a list of calls to ``functions`` (name, arguments schema) in
    Python's call syntax: one call, or with ``parallel`` one or more."""
    rules, alternatives = [], []
    for index, (name, schema) in enumerate(functions):
        if not python_name(name):
            continue
        found = _keyword_rules(index, schema, tuple(markers), max_whitespace)
        if found is None:
            continue
        rules += found[0]
        alternatives.append(f"{_literal(name + '(')} {found[1]} \")\"")
    if not alternatives:
        raise CapabilityError(
            f"no allowed tool can be called in the {wire_format_name} format's Python call syntax: "
            "a function name or a required property is not a Python identifier starting with a "
            "letter (or is a Python keyword); rename them, or serve a format with JSON arguments",
            capability="pythonic_call")
    calls = 'call (", " call)*' if parallel else "call"
    head = [f'root ::= "[" {calls} "]"', "call ::= " + " | ".join(alternatives)]
    return "\n".join(head + rules) + "\n"


def text_or_calls(calls: Mapping[str, Any], first_excluded: str,
                  excludes: Sequence[str] = ()) -> dict[str, Any]:
    """The dispatch at a message's start: ``calls`` (a tag node), or text whose first character
    is none of ``first_excluded`` and which holds none of ``excludes``."""
    excluded = "".join("\\" + char if char in "\\]^-[" else char for char in first_excluded)
    excluded = excluded.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    text = {"type": "sequence", "elements": [{"type": "regex", "pattern": f"[^{excluded}]"},
                                             {"type": "any_text", "excludes": list(excludes)}]}
    return {"type": "or", "elements": [text, dict(calls)]}


def after_triggers(calls: Mapping[str, Any], triggers: Sequence[str]) -> dict[str, Any]:
    """Free text; after any of ``triggers``, ``calls`` (a tag node), once."""
    return {"type": "triggered_tags", "triggers": list(triggers), "stop_after_first": True,
            "tags": [{"type": "tag", "begin": trigger, "content": dict(calls), "end": ""}
                     for trigger in triggers]}


def _unmarked(functions: Sequence[Any], mode: str, wire_format_name: str) -> list[Any]:
    """``functions`` with each custom grammar tool's marked schema (:mod:`.custom_inputs`) made
    its plain one-string schema in auto mode (its input free, the output guard parses it), a
    refusal in required mode (no argument slot here takes a grammar)."""
    from .custom_inputs import MARKER_KEY, uncarried
    result = []
    for function in functions:
        schema = function.parameters
        if isinstance(schema, Mapping) and MARKER_KEY in schema:
            if mode != "auto":
                raise uncarried(wire_format_name, function.name)
            function = dataclasses.replace(function, parameters={
                key: value for key, value in schema.items() if key != MARKER_KEY})
        result.append(function)
    return result


def list_turn(spec: Any, turn: Any, arguments_schema: Callable[..., Mapping[str, Any]],
              call_array: Callable[..., dict[str, Any]]) -> StructuralTag | None:
    """A ``json_array`` format's turn whose calls are not required mode's JSON array: pythonic
    calls in either mode, and every auto turn; None where the format has no auto grammar."""
    from .argument_slots import format_markers
    if turn.mode == "auto" and not (spec.auto_triggers or spec.auto_text_first_excluded):
        return None
    functions = _unmarked(turn.functions, turn.mode, turn.wire_format)
    parallel = turn.parallel
    markers = (*format_markers(turn.wire_format), *spec.auto_text_excludes)
    if spec.call_syntax == "pythonic":
        ebnf = pythonic_calls_ebnf([(f.name, arguments_schema(f, turn.strict_level)) for f in functions],
                                   parallel=parallel, markers=markers,
                                   max_whitespace=turn.max_whitespace, wire_format_name=turn.wire_format)
    else:
        if spec.auto_no_arrays:
            functions = [dataclasses.replace(f, parameters=held, strict=True) for f in functions
                         if (held := without_arrays(arguments_schema(f, turn.strict_level))) is not None]
            if not functions:
                return None   # no allowed tool has arguments the list can hold: the guard does
        schema = call_array(spec, dataclasses.replace(turn, functions=functions), spec.auto_arguments_key)
        ebnf = safe_json_ebnf(json_ebnf({"type": "json_schema", "json_schema": schema,
                                         "max_whitespace_cnt": turn.max_whitespace}),
                              markers, spec.string_excludes)
        if spec.auto_no_arrays:
            ebnf = reachable(ebnf.replace(_ANY_ARRAY, ""))
    calls = {"type": "grammar", "grammar": ebnf}
    if turn.mode == "required":
        node: Mapping[str, Any] = calls
    elif spec.auto_triggers:
        node = after_triggers(calls, spec.auto_triggers)
    else:
        node = text_or_calls(calls, spec.auto_text_first_excluded, spec.auto_text_excludes)
    return StructuralTag.model_validate({"format": node})


#: the array alternative of xgrammar's any-JSON-value rule (Phi-4-mini's list holds no ``]``)
_ANY_ARRAY = " | (basic_array)"


def without_arrays(schema: Any) -> Any:
    """``schema`` without arrays, for a list its parser ends at the first ``]`` (Phi-4-mini's
    ``functools\\[(.*?)\\]``): array-typed branches and optional properties dropped, enum values
    spelling ``]`` dropped, ``pattern`` and ``format`` dropped (their strings could spell one; the
    guard still checks a strict tool's); None where nothing is left (an array the tool requires)."""
    if not isinstance(schema, Mapping):
        return schema
    if "$ref" in json.dumps(schema) and "array" in json.dumps(schema):
        return None   # a reference may reach an array: not followed here
    result = {key: value for key, value in schema.items() if key not in ("pattern", "format")}
    kind = schema.get("type")
    if kind == "array" or (isinstance(kind, list) and not [k for k in kind if k != "array"]):
        return None
    if isinstance(kind, list):
        result["type"] = [k for k in kind if k != "array"]
    for key in ("enum",):
        if key in schema:
            result[key] = [v for v in schema[key] if "]" not in json.dumps(v) and "[" not in json.dumps(v)]
            if not result[key]:
                return None
    if "const" in schema and "]" in json.dumps(schema["const"]):
        return None
    for key in ("anyOf", "oneOf"):
        if key in schema:
            result[key] = [b for b in (without_arrays(branch) for branch in schema[key]) if b is not None]
            if not result[key]:
                return None
    if isinstance(schema.get("properties"), Mapping):
        required, properties = set(schema.get("required") or ()), {}
        for name, prop in schema["properties"].items():
            held = without_arrays(prop)
            if held is None and name in required:
                return None
            if held is not None:
                properties[name] = held
        result["properties"] = properties
    if isinstance(schema.get("additionalProperties"), Mapping):
        held = without_arrays(schema["additionalProperties"])
        result["additionalProperties"] = held if held is not None else False
    return result
