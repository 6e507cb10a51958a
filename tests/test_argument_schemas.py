"""Every tool's arguments are held to its schema (not only ``strict`` tools'), with a fallback to an
object where xgrammar cannot compile the schema; ``VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS=strict``
restores vLLM's default. Grammar-level: what the built tag admits, read with xgrammar's matcher."""

from __future__ import annotations

import logging

import pytest
import xgrammar

from vllm_allowed_tools.decode import argument_schemas
from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, turn_tag
from vllm_allowed_tools.settings import reset_for_tests

DENSITY = AllowedFunction("calculate_density", {
    "type": "object", "properties": {"mass": {"type": "number"}, "volume": {"type": "number"}},
    "required": ["mass", "volume"]}, None)
WEATHER = AllowedFunction("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, False)
#: a schema xgrammar refuses (a reference to nothing)
BROKEN = AllowedFunction("broken", {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}, None)

GOOD = '<tool_call>\n{"name": "calculate_density", "arguments": {"mass": 45, "volume": 15}}\n</tool_call>'
#: what SmolLM2-135M wrote when only an object was asked of it
RESTATED = ('<tool_call>\n{"name": "calculate_density", "arguments": {"title": "Calculate Density", '
            '"type": "function"}}\n</tool_call>')


def accepts(tag, text: str) -> bool:
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    return xgrammar.testing._is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_non_strict_tool_is_held_to_its_schema(mode):
    tag = build_structural_tag("hermes", [DENSITY, WEATHER], mode)
    prefix = "Let me check. " if mode == "auto" else ""
    assert accepts(tag, prefix + GOOD)
    assert not accepts(tag, prefix + RESTATED)
    assert not accepts(tag, prefix + GOOD.replace("45", '"45"'))   # a number, not a string
    assert not accepts(tag, prefix + GOOD.replace(', "volume": 15', ""))   # required key missing


def test_strict_only_leaves_a_non_strict_tool_an_object():
    tag = build_structural_tag("hermes", [DENSITY], "required", every_tool=False)
    assert accepts(tag, GOOD) and accepts(tag, RESTATED)
    strict = build_structural_tag("hermes", [AllowedFunction(DENSITY.name, DENSITY.parameters, True)],
                                  "required", every_tool=False)
    assert not accepts(strict, RESTATED)


def test_the_operator_setting_chooses(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS", "strict")
    reset_for_tests()
    assert accepts(build_structural_tag("hermes", [DENSITY], "required"), RESTATED)
    held_off = turn_tag("hermes", [DENSITY], catalog_digest="c", allowlist_digest="a", mode="required",
                        parallel_tool_calls=True)
    monkeypatch.delenv("VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS")
    reset_for_tests()
    held_on = turn_tag("hermes", [DENSITY], catalog_digest="c", allowlist_digest="a", mode="required",
                       parallel_tool_calls=True)
    # the cached tag follows the setting (it is part of the cache key)
    assert held_off.digest != held_on.digest
    assert accepts(held_off.tag, RESTATED) and not accepts(held_on.tag, RESTATED)


def test_a_schema_that_does_not_compile_falls_back_to_an_object_and_says_so(caplog):
    caplog.set_level(logging.WARNING, logger=argument_schemas.__name__)
    tag = build_structural_tag("hermes", [BROKEN, DENSITY], "required")
    anything = '<tool_call>\n{"name": "broken", "arguments": {"y": [1, 2]}}\n</tool_call>'
    assert accepts(tag, anything)          # the broken tool: an object
    assert not accepts(tag, RESTATED)      # the others still held
    warned = [r.getMessage() for r in caplog.records if "'broken'" in r.getMessage()]
    assert warned and "nowhere" in warned[0] and "/project/" not in warned[0]
    caplog.clear()
    build_structural_tag("hermes", [BROKEN], "required")
    assert not [r for r in caplog.records if "'broken'" in r.getMessage()]   # once


def test_schema_problem_reads_open_schemas_as_fine():
    for open_schema in (None, {}, True):
        assert argument_schemas.schema_problem(open_schema) is None
    assert argument_schemas.schema_problem(DENSITY.parameters) is None
    assert argument_schemas.schema_problem(BROKEN.parameters)


def test_plain_requests_hand_vllm_a_held_copy_and_leave_the_clients_request_alone():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_allowed_tools.vllm_glue.turn_read import tools_held_to_schema
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": DENSITY.name, "parameters": DENSITY.parameters}},
        {"type": "function", "function": {"name": BROKEN.name, "parameters": BROKEN.parameters}}],
        tool_choice="required")
    held = tools_held_to_schema(request)
    assert [tool.function.strict for tool in held.tools] == [True, None]
    assert [tool.function.strict for tool in request.tools] == [None, None]


def test_a_non_strict_tool_is_held_to_its_structure_not_its_string_lengths():
    """String lengths make xgrammar's compile slow at a large vocabulary and a non-strict tool
    promised none: they go, at every level that is a schema, never inside a value."""
    schema = {"type": "object", "required": ["q"], "properties": {
        "q": {"type": "string", "maxLength": 3, "minLength": 1},
        "maxLength": {"type": "integer", "enum": [1, 2]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
        "pick": {"anyOf": [{"type": "string", "maxLength": 1}, {"type": "null"}]},
        "mode": {"const": {"maxLength": 5}, "default": {"maxLength": 5}}}}
    held = argument_schemas.held_schema(schema)
    assert held["properties"]["q"] == {"type": "string"}
    assert held["properties"]["maxLength"] == {"type": "integer", "enum": [1, 2]}   # a property
    assert held["properties"]["tags"] == {"type": "array", "items": {"type": "string"}, "maxItems": 2}
    assert held["properties"]["pick"]["anyOf"][0] == {"type": "string"}
    assert held["properties"]["mode"] == schema["properties"]["mode"]   # values untouched
    search = AllowedFunction("search", {"type": "object", "properties": {
        "q": {"type": "string", "maxLength": 3}}, "required": ["q"]}, None)
    long = '<tool_call>\n{"name": "search", "arguments": {"q": "a longer query"}}\n</tool_call>'
    assert accepts(build_structural_tag("hermes", [search], "required"), long)
    strict = AllowedFunction(search.name, search.parameters, True)
    # a strict tool's lengths: in its grammar where xgrammar compiles them fast, else the guard's
    # (tests/test_string_lengths.py)
    held = accepts(build_structural_tag("hermes", [strict], "required"), long)
    assert held is not argument_schemas.lengths_compile_fast()
