"""Which JSON schemas vLLM's native outlines backend compiles exactly (every keyword enforced).

A server whose structured-output backend cannot compile structural tags (outlines) serves them on
our logits processor; a required turn of a JSON-array format is a plain JSON schema, which outlines
does compile, and such a schema stays on vLLM's native path when outlines enforces every keyword of
it (docs/decode-path.md, "Backends without structural tags"): the turn's grammar
(:mod:`.turn_grammar`) asks here, with the backend the server kept for JSON schemas. No vLLM import.
"""

from __future__ import annotations

import json

#: Checked against vLLM 0.32's outlines backend (outlines_core 0.2.14 builds a regex from the
#: schema): one keyword of a schema decides its regex (``properties``, then ``anyOf``, ``enum``,
#: ``const``, ``$ref``, else ``type``), and what outlines_core would drop beside it, or refuse, keeps
#: the schema on our processor. Refused: ``not``, ``if``/``then``/``else``, boolean subschemas,
#: ``additionalProperties: false`` without ``properties``, formats not listed below. Dropped
#: (a looser grammar): ``minimum``/``maximum``/``exclusive*``/``multipleOf``, ``uniqueItems``,
#: ``patternProperties``, ``min``/``maxProperties``, ``oneOf``'s exclusivity, ``pattern`` or
#: ``format`` beside ``min``/``maxLength``, anything beside ``anyOf``/``enum``/``$ref``; and
#: ``allOf`` of two or more parts concatenates their regexes (not JSON).
_OUTLINES_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                                   "$comment", "$defs", "definitions", "strict"})
_OUTLINES_STRUCTURES = {"properties": frozenset({"type", "required", "additionalProperties"}),
                        "anyOf": frozenset({"type"}), "enum": frozenset({"type"}),
                        "const": frozenset({"type"}), "$ref": frozenset()}
#: per type, the groups of keywords outlines_core applies together (a schema may use one group)
_OUTLINES_TYPE_GROUPS = {
    "string": (frozenset({"minLength", "maxLength"}), frozenset({"pattern"}), frozenset({"format"})),
    "array": (frozenset({"items", "minItems", "maxItems"}),),
    "object": (frozenset({"additionalProperties"}),),
    "integer": (), "number": (), "boolean": (), "null": ()}
_OUTLINES_FORMATS = frozenset({"date", "date-time", "time", "uuid", "email", "uri"})


def backend_compiles_json_schema(backend: str | None, schema: object) -> bool:
    """Whether vLLM's native ``backend`` compiles this JSON-schema grammar exactly (every keyword
    enforced), so it can stay on the native path while structural tags go to our processor.
    Only outlines is checked (guidance and lm-format-enforcer answer False: not measured here)."""
    if backend != "outlines":
        return False
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return False
    return _outlines_exact(schema)


def _outlines_exact(schema: object) -> bool:
    if not isinstance(schema, dict):
        return False
    keys = set(schema) - _OUTLINES_ANNOTATIONS
    defs = [*(schema.get("$defs") or {}).values(), *(schema.get("definitions") or {}).values()]
    structures = keys & set(_OUTLINES_STRUCTURES)
    if len(structures) > 1:
        return False
    if structures:
        (structure,) = structures
        children = _outlines_structure_children(structure, schema)
        if children is None or not keys - {structure} <= _OUTLINES_STRUCTURES[structure]:
            return False
    else:
        children = _outlines_typed_children(schema, keys)
        if children is None:
            return False
    return all(_outlines_exact(child) for child in [*children, *defs])


def _outlines_structure_children(structure: str, schema: dict) -> list | None:
    value = schema[structure]
    if structure == "properties":
        extra = schema.get("additionalProperties", False)
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
            return None   # a required name without a property is dropped, not enforced
        return [*value.values(), *([extra] if isinstance(extra, dict) else [])]
    if structure == "anyOf":
        return value if isinstance(value, list) and value else None
    if structure == "$ref":
        return [] if isinstance(value, str) and value.startswith(("#/$defs/", "#/definitions/")) else None
    return []   # enum, const: data


def _outlines_typed_children(schema: dict, keys: set[str]) -> list | None:
    kind = schema.get("type")
    if kind is None:
        return [] if not keys else None   # {}: any JSON value
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or any(k not in _OUTLINES_TYPE_GROUPS for k in kinds):
        return None
    rest = keys - {"type"}
    if len(kinds) > 1 or not rest:
        return [] if not rest else None
    if not any(rest <= group for group in _OUTLINES_TYPE_GROUPS[kinds[0]]):
        return None
    if "format" in rest and schema["format"] not in _OUTLINES_FORMATS:
        return None
    extra = schema.get("additionalProperties")
    if extra is False or ("items" in rest and not isinstance(schema["items"], dict)):
        return None
    return [child for child in (schema.get("items"), extra) if isinstance(child, dict)]
