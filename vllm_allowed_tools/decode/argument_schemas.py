"""Which calls' arguments the grammar holds to the tool's schema: every tool's, ``strict`` or not.

Most clients send tools without ``strict`` (BFCL's, Codex's, the Agents SDK's). Where only
``strict`` tools are pinned, a small model writes "any object" in a non-strict call: SmolLM2-135M
restated the schema inside the arguments (``{"title": "Calculate Density", "type": "function",
...}``) until the token limit, where the same model held to the schema wrote ``{"mass": 45,
"volume": 15}``. So by default (``VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS=all``) every allowed tool is
built as if it were ``strict``, as vLLM's ``--tool-strict-level parameter`` does; a schema xgrammar
cannot compile keeps the arguments an object (said once in the log) instead of failing the turn.

A non-strict tool is held to its schema's structure (keys, types, enums, required keys, nesting),
not to its string lengths. String lengths (``maxLength`` / ``minLength``) are left out of every
tool's grammar, ``strict`` or not, while the installed xgrammar compiles them slowly: 0.2.8 (vLLM
0.32's pin) compiles a bounded repeat of a string's characters for 10-33 s at a 150K vocabulary
whatever the bound (a Slack message's 40,000 or a query's 400; 0.9 s for a bound of 20), where the
string without its bound takes milliseconds and 0.2.9 takes 40 ms with it
(``benchmarks/compile_cliff.py``). A ``strict`` tool's lengths are then held by the output guard,
which re-validates every final call against the client's full schema and refuses one past a bound
(a ``strict`` call that breaks its schema never leaves the server); a non-strict tool promised no
bound, and its lengths are never held. With xgrammar 0.2.9 or newer, and on a server whose native
stage runs vLLM's guidance backend (:func:`hold_lengths_in_grammar`), a ``strict`` tool keeps every
keyword in its grammar. Only the grammar changes: the guard reads the client's own tools. No vLLM
imports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from .lru import LRU

logger = logging.getLogger(__name__)

Function = TypeVar("Function")


def _limits() -> tuple[int, int | None]:
    return 4096, None


#: schema digest -> "" (compiles) or why not; a catalog's schemas recur every turn
_VERDICTS = LRU(limits=_limits)


#: "[16:58:02] /project/cpp/json_schema_converter.cc:4950: " before xgrammar's own words
_COMPILER_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def schema_problem(schema: Mapping[str, Any] | bool | None) -> str | None:
    """Why xgrammar cannot hold arguments to ``schema`` (None: it can); an open schema (missing,
    ``{}``, ``true``) has nothing to hold and is fine."""
    if not isinstance(schema, Mapping) or not schema:
        return None
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as exc:
        return f"not JSON ({exc})"
    key = hashlib.sha256(text.encode()).hexdigest()
    verdict = _VERDICTS.get(key)
    if verdict is not None:
        return verdict or None
    from xgrammar import Grammar
    from .argument_slots import object_schema
    try:
        Grammar.from_json_schema(json.dumps(object_schema(schema)))
        verdict = ""
    except Exception as exc:   # xgrammar raises RuntimeError / ValueError / its own types
        said = _COMPILER_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        verdict = said[:300] or type(exc).__name__
    _VERDICTS.put(key, verdict, 1)
    return verdict or None


#: keywords whose values are subschemas, as a dict of them, a list of them, or one
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
#: what the grammar leaves to the guard, or out (see the module docstring)
_UNHELD = ("maxLength", "minLength")


def held_schema(schema: Any) -> Any:
    """``schema`` without its string-length keywords, at every level that is a schema (never
    inside ``enum``, ``const``, ``default`` or ``examples``, which are values)."""
    if isinstance(schema, list):
        return [held_schema(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    held: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _UNHELD and isinstance(value, int):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            held[key] = {name: held_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            held[key] = [held_schema(sub) for sub in value]
        elif key in _SCHEMA_ONES:
            held[key] = held_schema(value)
        else:
            held[key] = value
    return held


def lengths_compile_fast() -> bool:
    """Whether the installed xgrammar compiles a string's ``maxLength`` / ``minLength`` without
    the cliff (0.2.9 and newer; see the module docstring)."""
    global _FAST_LENGTHS
    if _FAST_LENGTHS is None:
        _FAST_LENGTHS = _version_at_least(_installed_xgrammar(), (0, 2, 9))
    return _FAST_LENGTHS


_FAST_LENGTHS: bool | None = None


def hold_lengths_in_grammar(held: bool) -> None:
    """Decided by the server this process serves (``vllm_glue/capabilities.py``): True where no
    grammar is compiled ahead (the native stage on vLLM's guidance backend, which makes each tag's
    llguidance matcher in milliseconds, lengths included: docs/benchmarks.md), so a ``strict``
    tool's lengths are held by the grammar whatever the installed xgrammar; False: the installed
    xgrammar's version decides, as by default. Tags built before the call keep what they hold."""
    global _FAST_LENGTHS
    _FAST_LENGTHS = True if held else None


def _installed_xgrammar() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("xgrammar")
    except PackageNotFoundError:   # pragma: no cover - xgrammar is a dependency
        return "0"


def _version_at_least(text: str, floor: tuple[int, ...]) -> bool:
    """``text`` (``0.2.10``, ``0.2.9rc1``, ``0.3.0.dev2``) read as numbers, compared to ``floor``."""
    parts = [int(match.group()) for match in (re.match(r"\d+", piece) for piece in text.split(".")[:3])
             if match]
    return tuple(parts) >= floor


def held_to_schema(functions: Sequence[Function], *, every_tool: bool,
                   name=lambda f: f.name, parameters=lambda f: f.parameters,
                   strict=lambda f: f.strict, pinned=None) -> list[Function]:
    """``functions`` as the grammar should see them: with ``every_tool``, each non-strict one whose
    schema compiles marked ``strict``, its schema :func:`held_schema`'s (its arguments then follow
    it in every builder; one that does not compile is logged once and left an object); and every
    other schema without its string lengths while they compile slowly
    (:func:`lengths_compile_fast`), its ``strict`` flag kept. The accessors
    (``pinned(function, schema, strict)`` makes the held copy) let vLLM's tool objects go through
    the same rule as :class:`.grammar.AllowedFunction`."""
    pin = pinned or (lambda f, schema, strict: dataclasses.replace(f, parameters=schema, strict=strict))
    lengths_held = lengths_compile_fast()
    held = []
    for function in functions:
        if strict(function) is True or not every_tool:
            schema = parameters(function)
            lengthless = schema if lengths_held else held_schema(schema)
            held.append(function if lengthless == schema else pin(function, lengthless, strict(function)))
            continue
        schema = held_schema(parameters(function))
        problem = schema_problem(schema)
        if problem is None:
            held.append(pin(function, schema, True))
        else:
            _log_once(name(function), problem)
            held.append(function)
    return held


_LOGGED = LRU(limits=_limits)


def _log_once(tool: str, problem: str) -> None:
    key = (tool, problem)
    if _LOGGED.get(key) is None:
        _LOGGED.put(key, True, 1)
        logger.warning("vllm-allowed-tools: the arguments of tool %r are held to an object only: "
                       "xgrammar cannot compile its parameters schema (%s); mark the schema simpler "
                       "or set VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS=strict to silence this", tool, problem)


def every_tool_held() -> bool:
    """The operator's choice (``VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS``)."""
    from ..settings import SCHEMAS_ALL, current
    return current().argument_schemas == SCHEMAS_ALL
