"""String lengths (``maxLength`` / ``minLength``) and the compile cliff: while the installed xgrammar
compiles a bounded string slowly (0.2.8: 10-33 s at a 150K vocabulary), every tool's grammar leaves
its lengths out, ``strict`` tools' too, and the output guard holds a ``strict`` tool to them: a call
past a bound never leaves the server. With a fast xgrammar a ``strict`` tool keeps them in its
grammar. ``benchmarks/compile_cliff.py`` measures the compile."""

from __future__ import annotations

import functools
import json

import pytest
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.asgi.turn_plan import output_contract
from vllm_allowed_tools.decode import argument_schemas
from vllm_allowed_tools.decode.argument_slots import clear_slot_cache
from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag, clear_tag_cache
from vllm_allowed_tools.request.rewrite import rewrite_request

#: Slack's post_message as MCP servers publish it: a 40,000-character text, a channel pattern
SLACK = {"type": "object", "additionalProperties": False, "required": ["channel_id", "text"],
         "properties": {"channel_id": {"type": "string", "pattern": "^[CDG][A-Z0-9]{8,}$"},
                        "text": {"type": "string", "maxLength": 40000},
                        "blocks": {"type": "array", "items": {"type": "string", "maxLength": 3000}}}}
QUERY = {"type": "object", "additionalProperties": False, "required": ["q"],
         "properties": {"q": {"type": "string", "minLength": 2, "maxLength": 5}}}


@pytest.fixture
def lengths_fast():
    """Set whether xgrammar compiles lengths fast (what the installed version decides)."""
    def set_to(value: bool) -> None:
        argument_schemas._FAST_LENGTHS = value
        clear_tag_cache()
        clear_slot_cache()
    yield set_to
    argument_schemas._FAST_LENGTHS = None
    clear_tag_cache()
    clear_slot_cache()


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def accepts(tag, text: str) -> bool:
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    return xgrammar.testing._is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("text, fast", [("0.2.8", False), ("0.2.9", True), ("0.2.10", True),
                                         ("0.3.0.dev2", True), ("0.2.9rc1", True), ("0.1.33", False),
                                         ("1.0", True), ("0.2", False)])
def test_which_xgrammar_compiles_lengths_fast(text, fast):
    assert argument_schemas._version_at_least(text, (0, 2, 9)) is fast


def test_the_installed_xgrammar_decides():
    argument_schemas._FAST_LENGTHS = None
    try:
        installed = argument_schemas._installed_xgrammar()
        expected = argument_schemas._version_at_least(installed, (0, 2, 9))
        assert argument_schemas.lengths_compile_fast() is expected
    finally:
        argument_schemas._FAST_LENGTHS = None


@pytest.mark.parametrize("every_tool", [True, False])
def test_a_slow_xgrammar_gets_no_length_in_any_tools_grammar(lengths_fast, every_tool):
    lengths_fast(False)
    strict = AllowedFunction("slack__post_message", SLACK, True)
    loose = AllowedFunction("search", QUERY, None)
    held = argument_schemas.held_to_schema([strict, loose], every_tool=every_tool)
    assert [f.strict for f in held] == [True, True if every_tool else None]   # flags as before
    for function in held:
        assert "Length" not in json.dumps(function.parameters)
    assert held[0].parameters["properties"]["channel_id"]["pattern"] == "^[CDG][A-Z0-9]{8,}$"
    tag = build_structural_tag("hermes", [strict], "required", every_tool=every_tool)
    assert "40000" not in tag.model_dump_json() and "3000" not in tag.model_dump_json()
    assert accepts(tag, call(strict.name, {"channel_id": "C12345678", "text": "x" * 50}))
    assert not accepts(tag, call(strict.name, {"channel_id": "c1", "text": "x"}))   # the pattern holds


def test_a_fast_xgrammar_keeps_a_strict_tools_lengths_in_its_grammar(lengths_fast):
    lengths_fast(True)
    strict = AllowedFunction("search", QUERY, True)
    assert argument_schemas.held_to_schema([strict], every_tool=True) == [strict]
    tag = build_structural_tag("hermes", [strict], "required")
    assert accepts(tag, call("search", {"q": "abcde"}))
    assert not accepts(tag, call("search", {"q": "abcdef"}))
    assert not accepts(tag, call("search", {"q": "a"}))
    # the bounded string is JSON text: no raw control character, an escape one character of the value
    assert not accepts(tag, call("search", {"q": "ab"}).replace("ab", "a\tb"))
    assert not accepts(tag, call("search", {"q": "ab"}).replace("ab", "a\x01b"))
    assert accepts(tag, call("search", {"q": "a\tb\"c"}))   # written \t and \": five characters
    assert not accepts(tag, call("search", {"q": "a\tb\"cd"}))
    loose = AllowedFunction("search", QUERY, None)   # a non-strict tool promised no bound
    assert accepts(build_structural_tag("hermes", [loose], "required"), call("search", {"q": "abcdef"}))


@functools.lru_cache(maxsize=2)
def _contract(strict: bool):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "search", "parameters": QUERY,
                                                        "strict": strict}}],
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": "search"}}]}}}
    rewritten = rewrite_request(json.loads(json.dumps(body)), "chat")
    return output_contract(rewritten, body, "chat", strict_all=False)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=9))
def test_the_guard_holds_a_strict_call_to_its_lengths(text):
    """What the grammar admits past a bound, the guard refuses (``strict`` only): a strict call
    that breaks its schema never leaves the server."""
    arguments = json.dumps({"q": text})
    refusal = _contract(True).arguments_refusal("search", arguments)
    within = 2 <= len(text) <= 5
    assert (refusal is None) is within
    if not within:
        assert refusal.reason == "strict_arguments_invalid" and "q" in refusal.detail
    assert _contract(False).arguments_refusal("search", arguments) is None
