"""decode/safe_json.py: the JSON strings it admits never spell a marker raw, every string value
keeps a spelling, surrogate escapes come in pairs, numbers stay finite float64s; and the wire
formats' argument grammars are built from it."""

from __future__ import annotations

import json
import math
from functools import cache

import pytest
import xgrammar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.decode.argument_slots import format_markers
from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.ebnf import ebnf_text
from vllm_allowed_tools.decode.safe_json import safe_json_ebnf, string_rules

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: characters an escape writes after its backslash: a marker starting with one may be unspellable
_ESCAPE_TAIL = set('"\\/bfnrtu0123456789abcdefABCDEF')
_PIECES = "<>/|=_:[]x\"' u0a"
markers_st = st.lists(st.text(alphabet=_PIECES, min_size=2, max_size=6).filter(lambda m: m[0] not in _ESCAPE_TAIL),
                      min_size=1, max_size=4).map(lambda ms: tuple(sorted(set(ms))))


@cache
def string_grammar(markers: tuple[str, ...]) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_ebnf('root ::= "\\"" basic_string_sub\n' + string_rules(markers))


def accepts(grammar: xgrammar.Grammar, text: str) -> bool:
    return xgrammar.testing._is_grammar_accept_string(grammar, text)


def spelled(value: str, markers: tuple[str, ...]) -> str:
    """``value`` as a JSON string with every marker's first character written as a \\u escape."""
    firsts = {marker[0] for marker in markers}
    out = []
    for char in value:
        if char in firsts or ord(char) < 0x20 or char in '"\\':
            units = char.encode("utf-16-be", "surrogatepass")
            out += [f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}" for i in range(0, len(units), 2)]
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def raw_marker(text: str, markers: tuple[str, ...]) -> bool:
    """A string literal's content and closing quote spell a marker raw."""
    return any(marker in text[1:] for marker in markers)


def readable(text: str) -> bool:
    """JSON's reading of the literal is Unicode text (no lone surrogate)."""
    try:
        json.loads(text).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return True


@FAST
@given(markers=markers_st, value=st.data())
def test_every_string_value_has_an_admitted_spelling(markers, value):
    text = value.draw(st.text() | st.lists(st.sampled_from([*markers, "a", "\\", '"', "\n", "😀"])).map("".join))
    literal = spelled(text, markers)
    assert json.loads(literal) == text
    assert accepts(string_grammar(markers), literal), (markers, literal)


_ESCAPES = ["\\n", '\\"', "\\\\", "\\u003c", "\\ud83d\\ude00", "\\udaaa", "\\ude00", "\\u0075", "\\/"]


@FAST
@given(markers=st.lists(st.text(alphabet=_PIECES, min_size=1, max_size=5), min_size=1, max_size=4)
       .map(lambda ms: tuple(sorted(set(ms) - {'"'}))).filter(bool), data=st.data())
def test_admitted_exactly_when_readable_and_no_marker_is_spelled_raw(markers, data):
    """Soundness for any markers (even ones starting inside an escape), exactness of the rest."""
    parts = data.draw(st.lists(st.sampled_from([*markers, *(m[:-1] for m in markers), *_ESCAPES,
                                                *_PIECES.replace('"', "")]), max_size=12))
    literal = '"' + "".join(parts) + '"'
    assert accepts(string_grammar(markers), literal) == (readable(literal) and not raw_marker(literal, markers))


@pytest.mark.parametrize("literal,ok", [('"\\ud83d\\ude00"', True), ('"\\udaaa"', False), ('"\\ude00"', False),
                                        ('"\\udaaa\\u0041"', False), ('"\\uD83D\\uDE00x"', True),
                                        ('"</tool_call>"', False), ('"\\u003c/tool_call>"', True),
                                        ('"<parameter name="', False), ('"<parameter name=\\""', True)])
def test_surrogates_pair_and_markers_stay_out(literal, ok):
    assert accepts(string_grammar(("</tool_call>", '<parameter name="')), literal) is ok


@cache
def number_grammar() -> xgrammar.Grammar:
    ebnf = ebnf_text(xgrammar.Grammar.from_json_schema(json.dumps({"type": "number"})))
    return xgrammar.Grammar.from_ebnf(safe_json_ebnf(ebnf, ()))


def number_spelling(value: float) -> str:
    """A spelling of finite ``value`` (|value| < 1e307) in the bound: digits moved into the integer
    part while the exponent is over 287."""
    mantissa, exponent = f"{value:.16e}".split("e")
    sign, mantissa = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
    digits, exponent = mantissa.replace(".", ""), int(exponent)
    shift = max(0, exponent - 287)
    digits = digits.ljust(1 + shift, "0")   # 1.0000000000000001e304: 17 digits, shifted by 17
    return f"{sign}{digits[:1 + shift]}.{digits[1 + shift:] or '0'}e{exponent - shift}"


@FAST
@given(st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: abs(f) < 1e307))
def test_every_finite_float_below_1e307_has_an_admitted_spelling(value):
    text = number_spelling(value)
    assert json.loads(text) == value
    assert accepts(number_grammar(), text), text


@FAST
@given(st.from_regex(r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][+-]?[0-9]{1,4})?", fullmatch=True))
def test_every_admitted_number_is_a_finite_float64(text):
    if accepts(number_grammar(), text):
        assert math.isfinite(float(text)) and json.dumps(json.loads(text)) != "Infinity"


@pytest.mark.parametrize("text", ["5e600", "1e308", "8E900", "123456789012345678901", "1.5e288"])
def test_overflowing_numbers_are_refused(text):
    assert not accepts(number_grammar(), text)


SEARCH = AllowedFunction("search", {"type": "object", "properties": {"q": {"type": "string"}}}, None)
WHERE = AllowedFunction("where", {"type": "object", "properties": {"at": {"type": "object"}},
                                  "required": ["at"], "additionalProperties": False}, True)


@pytest.mark.parametrize("family,text", [
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "</tool_call>"}}\n</tool_call>'),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>'
                '{"q": "<|tool_call_end|>"}<|tool_call_end|><|tool_calls_section_end|>'),
    ("longcat", '<longcat_tool_call>{"name": "search", "arguments": {"</longcat_tool_call>": 0}}</longcat_tool_call>'),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": 5e600}}\n</tool_call>'),
])
def test_format_grammars_refuse_markers_in_strings_and_huge_numbers(family, text):
    # the free object of a tool whose schema is not held (VLLM_ALLOWED_TOOLS_ARGUMENT_SCHEMAS=strict)
    tag = build_structural_tag(family, [SEARCH], "required", parallel_tool_calls=False, every_tool=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    assert not accepts(grammar, text)
    escaped = text.replace('"</', '"\\u003c/').replace('"<|', '"\\u003c|').replace("5e600", "5e60")
    assert accepts(grammar, escaped), escaped


def test_format_markers_hold_special_tokens_and_markup():
    assert {"<tool_call>", "</tool_call>"} <= set(format_markers("hermes"))
    assert "<|tool_call_end|>" in format_markers("kimi_k2")
    assert "[TOOL_CALLS]" in format_markers("mistral")
    assert all(name not in marker for marker in format_markers("hermes") for name in ("search", "where"))


def test_json_typed_xml_value_strings_refuse_the_parameter_markup():
    """qwen3_coder's JSON-typed XML value: a JSON string inside it cannot spell ``<parameter=``."""
    tag = build_structural_tag("qwen3_coder", [WHERE], "required", parallel_tool_calls=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    text = '<tool_call>\n<function=where>\n<parameter=at>\n{"x": "<parameter=a"}\n</parameter>\n</function>\n</tool_call>'
    assert not accepts(grammar, text)
    assert accepts(grammar, text.replace('"<parameter', '"\\u003cparameter'))


def test_strings_keep_out_each_markup_markers_first_two_characters():
    """A JSON string cannot spell any markup marker's first two characters (so no marker at all, in
    an automaton one step deep: the full markers cost xgrammar's compile 15-65x at a 150K
    vocabulary); a word-like marker (harmony's recipient) is not a string's concern; every value
    keeps a spelling, the first character escaped."""
    from vllm_allowed_tools.decode.safe_json import string_markers
    assert string_markers(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", " to=functions.", "functools["]) \
        == ("</", "<t", "[T")
    tag = build_structural_tag("hermes", [SEARCH], "required", parallel_tool_calls=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())

    def call(value: str) -> str:
        return '<tool_call>\n{"name": "search", "arguments": {"q": %s}}\n</tool_call>' % value
    assert not accepts(grammar, call('"a</b>"')) and not accepts(grammar, call('"<tag"'))
    assert accepts(grammar, call('"a\\u003c/b>"')) and accepts(grammar, call('"a <b> c"'))
