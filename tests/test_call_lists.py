"""decode/call_lists.py: the pythonic call grammar admits Python literals the parser reads as the
JSON they mean, and refuses what Python would read otherwise; the auto dispatch's text branch."""

from __future__ import annotations

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from vllm_allowed_tools.decode.call_lists import pythonic_calls_ebnf, python_name
from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.errors import CapabilityError

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "alert": {"type": "boolean"}, "note": {"type": ["string", "null"]},
    "tags": {"type": "array", "items": {"type": "integer"}}, "first-name": {"type": "string"}},
    "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammar():
    return xgrammar.Grammar.from_ebnf(pythonic_calls_ebnf([("get_weather", SCHEMA)], parallel=True))


@pytest.mark.parametrize("text", [
    '[get_weather(city="Paris")]', '[get_weather(city="a\\"b\\u00e9", alert=True, note=None)]',
    '[get_weather(city="x", tags=[1, -2]), get_weather(city="y")]', '[get_weather(city="\\\\n")]'])
def test_admits_python_literals(grammar, text):
    assert _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("text", [
    '[get_weather(city="a\\/b")]',            # Python keeps \\/ as two characters
    '[get_weather(city="\\ud83d\\ude00")]',   # Python reads two lone surrogates
    '[get_weather(city="x", alert=true)]', '[get_weather(city="x", note=null)]',
    '[get_weather(alert=True)]',              # the required keyword is missing
    '[get_weather(city="x", first-name="y")]', '[get_weather(city="x", extra=1)]',
    '[send_email(city="x")]', '[get_weather(city="x") ]'])
def test_refuses_what_python_reads_otherwise(grammar, text):
    assert not _is_grammar_accept_string(grammar, text)


def test_names_python_cannot_call_are_refused():
    assert python_name("get_weather") and not python_name("class") and not python_name("_x")
    with pytest.raises(CapabilityError):
        pythonic_calls_ebnf([("get-weather", SCHEMA)], parallel=False)


@pytest.mark.parametrize("family,text,admitted", [
    ("pythonic", "It is sunny.", True), ("pythonic", "[not a call", False),
    ("pythonic", '[get_weather(city="x")]', True), ("pythonic", '[send_email(city="x")]', False),
    ("llama4_pythonic", "<|python_start|>[send_email()]", False),
    ("xlam", ' [{"name": "send_email", "arguments": {}}]', False),
    ("xlam", 'See ```[{"name": "send_email", "arguments": {}}]```', False),
    ("xlam", '[{"name": "get_weather", "arguments": {"city": "x"}}]', True),
    ("mistral", 'Hi [TOOL_CALLS][{"name": "send_email", "arguments": {}}]', False),
    ("mistral", 'Hi [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "x"}}]', True),
    ("granite", 'ok <tool_call>[{"name": "send_email", "arguments": {}}]', False)])
def test_auto_admits_text_or_allowed_calls(family, text, admitted):
    tag = build_structural_tag(family, [AllowedFunction("get_weather", SCHEMA, True)], "auto",
                               parallel_tool_calls=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag)
    assert _is_grammar_accept_string(grammar, text) == admitted


def test_phi4_auto_arguments_hold_no_bracket():
    """Phi-4-mini's parser reads ``functools[`` up to the first ``]``: arguments hold no array
    (an optional array property is left out, a tool that needs one is not callable in auto), no
    free value is an array, and a string spells ``]`` only escaped."""
    tools = [AllowedFunction("get_weather", SCHEMA, True), AllowedFunction("free", None, None),
             AllowedFunction("needs_list", {"type": "object", "properties": {"xs": {"type": "array"}},
                                            "required": ["xs"]}, True)]
    tag = build_structural_tag("phi4_mini_json", tools, "auto", parallel_tool_calls=True)
    grammar = xgrammar.Grammar.from_structural_tag(tag)

    def call(name: str, arguments: str) -> str:
        return 'ok functools[{"name": "%s", "arguments": %s}]' % (name, arguments)
    assert _is_grammar_accept_string(grammar, call("get_weather", '{"city": "a\\u005db"}'))
    assert _is_grammar_accept_string(grammar, call("free", '{"k": {"v": null}}'))
    for refused in (call("get_weather", '{"city": "a]b"}'), call("get_weather", '{"city": "x", "tags": [1]}'),
                    call("free", '{"k": [1]}'), call("needs_list", '{"xs": {}}'),
                    'functools is a word'):
        assert not _is_grammar_accept_string(grammar, refused), refused
    assert build_structural_tag("phi4_mini_json", tools[2:], "auto") is None   # the guard holds it
