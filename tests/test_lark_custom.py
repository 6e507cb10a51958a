"""The llguidance translation (decode/lark_tags.py) of a turn whose custom tools carry the client's
own grammars: a first-seen ``required`` or ``auto`` turn starts on it (decode/lazy_grammars.py), so
a client grammar reaches corners of the EBNF translation (decode/lark_ebnf.py) the builders'
grammars never do (rule names that differ only in case once did: a wider language).

Client grammars, Lark and regex, as clients send them (Codex's ``apply_patch``, character classes
with escapes, bounded repeats, alternation inside repeats, non-ASCII text, rule names in every
case), each compiled as the server compiles it (``compile_custom_grammar``), placed in a turn of a
JSON-argument format (the input a JSON string) and an XML one (the input raw), and walked both
ways as tests/test_lark_tags.py walks the builders' grammars: xgrammar's walks must be taken whole
by llguidance (no narrowing), llguidance's by xgrammar (no widening)."""

from __future__ import annotations

import json
import random

import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.request.custom_tools import compile_custom_grammar

from support.custom_tools import CODEX_APPLY_PATCH
from support.grammar_walk import GrammarWalker, format_tokens, marker_texts
from support.lark_walks import WALKS, compare_both_ways, translated


#: name -> (syntax, definition)
GRAMMARS = {
    "apply_patch": ("lark", CODEX_APPLY_PATCH),
    "cased_rules": ("lark", 'start: aB Ab | ab AB\naB: "x" Ab?\nab: "w"\nAb: "y" | "z"\nAB: "v"'),
    "bounded": ("lark", 'start: item ("," item)~0..3\nitem: /[a-c]{1,2}/ | "\\"q\\""'),
    "escapes": ("lark", 'start: /[\\t\\\\\\]\\-^]+/ "\\n" /[^\\n"]{0,4}/'),
    "non_ascii": ("lark", 'start: ("é" | "日本" | /[α-γ]/)+ " ✓"?'),
    "sql_ish": ("lark", 'start: "SELECT " COL (", " COL)* " FROM " NAME (" WHERE " COND)?\n'
                        'COL: NAME | "*"\nNAME: /[a-z_][a-z0-9_]*/\nCOND: NAME " = " /[0-9]+/'),
    "regex_date": ("regex", r"\d{4}-(0[1-9]|1[0-2])-\d{2}( [A-Z]{3})?"),
    "regex_alternation": ("regex", r"(yes|no|maybe\??)+\n?"),
}

FORMATS = ("hermes", "qwen3_coder")   # the input as a JSON string; the input raw in XML markup


def _walker(family: str, name: str, mode: str) -> GrammarWalker:
    syntax, definition = GRAMMARS[name]
    ebnf = compile_custom_grammar(name, syntax, definition).ebnf
    functions = [AllowedFunction(name, None, None, input_grammar=ebnf)]
    tag = build_structural_tag(family, functions, mode, parallel_tool_calls=mode == "auto")
    return GrammarWalker(tag, [*format_tokens(family, tag), "é", "日本", "✓", "α", "β", "γ"],
                         token_texts=marker_texts(family))


#: (grammar, format, mode) whose walks are left to the patches below: random walks of Codex's
#: patch in a JSON string rarely end within their budget (a line ends on the two characters \\n,
#: which a walk heading for the end avoids), and the few that do take a minute
UNENDING = {("apply_patch", "hermes", "required"), ("apply_patch", "hermes", "auto")}


@pytest.mark.parametrize("name,family,mode", [
    (name, family, mode) for name in sorted(GRAMMARS) for family in FORMATS
    for mode in ("required", "auto") if (name, family, mode) not in UNENDING])
def test_a_client_grammar_is_translated_to_the_same_language(name, family, mode):
    walked, ended = compare_both_ways(_walker(family, name, mode), random.Random(f"{name}-{family}-{mode}"))
    assert walked >= WALKS // 2 and ended >= WALKS // 2


#: one call of ``apply_patch`` with ``patch`` as its input, as each format's model writes it
PATCH_CALLS = {
    "hermes": lambda patch: '<tool_call>\n{"name": "apply_patch", "arguments": '
                            + json.dumps({"input": patch}) + "}\n</tool_call>",
    "qwen3_coder": lambda patch: "<tool_call>\n<function=apply_patch>\n<parameter=input>\n" + patch
                                 + "\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("mode", ["required", "auto"])
@pytest.mark.parametrize("family", FORMATS)
def test_codexs_patches_are_read_alike_long_lines_included(family, mode):
    """Patches xgrammar admits, lines of 8,000 characters among them (a rule a character would
    stop llguidance's parser past 2,000 open items), are taken by the translation; a malformed one
    by neither (in an ``auto`` turn, after a line of text)."""
    import llguidance
    walker = _walker(family, "apply_patch", mode)
    lead = "On it.\n" if mode == "auto" else ""
    tokenizer, lark = translated(walker)
    long_line = '+' + 'x y"z\\ \t' * 1000 + '\n'
    patches = ["*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n",
               "*** Begin Patch\n*** Update File: src/a.py\n*** Move to: b.py\n@@ def f():\n-    x\n"
               "+    y\n *** End of File\n*** End Patch",
               "*** Begin Patch\n*** Add File: big.txt\n" + long_line * 2 + "*** End Patch\n"]
    for patch in [*patches, patches[0].replace("+hi", "hi")]:
        call = list(lead + PATCH_CALLS[family](patch))
        matcher = llguidance.LLMatcher(tokenizer, lark)
        taken = all(matcher.consume_token(walker.index[char]) for char in call) \
            and matcher.consume_token(walker.eos_id) and matcher.is_stopped()
        assert taken == walker.accepts(call) == (patch != patches[0].replace("+hi", "hi")), \
            (patch[:60], matcher.get_error()[:200])
