"""decode/json_string: a grammar over text -> the grammar of that text inside a JSON string.

Property tests over generated regular grammars (literals and classes holding quotes, backslashes,
slashes, control and non-ASCII characters; negated classes; alternation and repetition): every string
the source admits, written by ``json.dumps``, is admitted; every string the rewrite admits is a valid
JSON string body whose decoded value the source admits (so never an unescaped quote or a raw control
character).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.decode.json_string import EBNFReadError, json_string_grammar

xgrammar = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

#: the characters the generated grammars are made of: the ones JSON escapes, and a few it does not
ALPHABET = ['a', 'b', 'u', '0', 'n', ' ', '"', '\\', '/', '\n', '\t', '\x01', '\x1f', 'é', '😀', ']', '-', '^']
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _regex_char(char: str, in_class: bool = False) -> str:
    if ord(char) < 0x20:
        return f"\\u{ord(char):04x}"   # \\x takes every hex digit that follows in xgrammar
    if in_class and char in "]\\-[":
        return "\\" + char
    if not in_class and char in "\\.^$*+?()[]{}|/-":
        return "\\" + char
    return char


@st.composite
def regexes(draw, depth: int = 0) -> str:
    kind = draw(st.sampled_from(["literal", "class", "negated"] + (["seq", "alt", "repeat"] if depth < 3 else [])))
    if kind == "literal":
        return "".join(_regex_char(c) for c in draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3)))
    if kind in ("class", "negated"):
        chars = draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4, unique=True))
        if chars[0] == "^":   # xgrammar's regex reader takes "[\\^" for a negated class
            if len(chars) == 1:
                return _regex_char("^")
            chars = chars[1:] + chars[:1]
        return "[" + ("^" if kind == "negated" else "") + "".join(_regex_char(c, True) for c in chars) + "]"
    if kind == "seq":
        return "".join(f"({draw(regexes(depth + 1))})" for _ in range(draw(st.integers(2, 3))))
    if kind == "alt":
        return "|".join(f"({draw(regexes(depth + 1))})" for _ in range(draw(st.integers(2, 3))))
    return f"({draw(regexes(depth + 1))}){draw(st.sampled_from(['*', '+', '?']))}"


def _json_grammar(regex: str):
    return xgrammar.Grammar.from_ebnf(json_string_grammar(str(xgrammar.Grammar.from_regex(regex))))


@SETTINGS
@given(st.data())
def test_every_admitted_text_is_admitted_written_as_json(data):
    regex = data.draw(regexes())
    text = data.draw(st.from_regex(re.compile(regex, re.DOTALL), fullmatch=True).filter(
        lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)))
    grammar = _json_grammar(regex)
    assert accepts(grammar, json.dumps(text, ensure_ascii=False)[1:-1]), (regex, text)
    # ensure_ascii writes DEL and non-ASCII as \\u escapes, which the rewrite leaves out
    assert accepts(grammar, json.dumps(text)[1:-1]) or any(ord(c) >= 0x7F for c in text), (regex, text)


#: what a model may write inside the JSON string: escapes, quotes, raw controls
BODY_PIECES = ['a', 'b', 'u', '0', '1', 'f', 'F', 'n', '"', '\\', '\\"', '\\\\', '\\/', '/', '\\n', '\\t',
               '\\u0001', '\\u001f', '\\u001F', '\\u0022', '\n', '\t', '\x01', 'é', ']', '-', '^', ' ']


@SETTINGS
@given(st.data())
def test_every_string_the_rewrite_admits_is_json_the_source_admits(data):
    regex = data.draw(regexes())
    grammar = _json_grammar(regex)
    source = re.compile(regex, re.DOTALL)
    for _ in range(20):
        body = "".join(data.draw(st.lists(st.sampled_from(BODY_PIECES), max_size=6)))
        if not accepts(grammar, body):
            continue
        decoded = json.loads(f'"{body}"')   # raises on a raw quote, a raw control, a bad escape
        assert source.fullmatch(decoded), (regex, body, decoded)


def test_codex_style_patch_grammar_round_trips():
    """A Lark grammar shaped like Codex's ``apply_patch`` (literals with spaces and ``*``, free
    lines): a patch holding quotes, backslashes and tabs, written as JSON, is admitted; the raw
    patch (line breaks unescaped) is not."""
    lark = r'''
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
update_hunk: "*** Update File: " filename LF change+
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: ("@@" /(.*)/ LF) | (/[ +-]/ /(.*)/ LF)
%import common.LF
'''
    grammar = xgrammar.Grammar.from_ebnf(json_string_grammar(str(xgrammar.Grammar.from_lark(lark))))
    patch = '*** Begin Patch\n*** Add File: a "b".txt\n+say "hi"\\n\tnow\n*** End Patch\n'
    assert accepts(grammar, json.dumps(patch)[1:-1])
    assert not accepts(grammar, patch)
    assert not accepts(grammar, json.dumps(patch.replace("+say", "say"))[1:-1])


def test_a_tag_dispatch_rule_is_refused_not_guessed():
    with pytest.raises(EBNFReadError):
        json_string_grammar('root ::= TagDispatch(("a", b))')
