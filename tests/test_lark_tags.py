"""The llguidance translation of a structural tag (decode/lark_tags.py) admits exactly what the tag
admits, on every registered format's grammars (auto and required, parallel calls or not).

Both directions, over a synthetic vocabulary that holds each format's markers as one token and in
pieces (support/grammar_walk.py): walks of xgrammar's matcher are written token by token into
llguidance's matcher, which must take every token and end; walks of llguidance's matcher (a
random allowed token a step, the end once allowed after a while) must be admitted whole by
xgrammar's. A translation that narrowed the language fails the first, one that widened it the
second. The walks were 40 a direction a grammar when the translation was written (every format,
no difference); CI runs fewer."""

from __future__ import annotations

import json
import random
from functools import cache

import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.decode.lark_tags import UntranslatableTag, lark_grammar
from vllm_allowed_tools.formats import wire_format, wire_formats

from support.grammar_reads import ALLOWED, CATALOG
from support.grammar_walk import GrammarWalker, format_tokens, marker_texts
from support.lark_walks import WALKS, allowed_tokens, compare_both_ways, translated


@cache
def _walker(family: str, mode: str, parallel: bool) -> GrammarWalker | None:
    if wire_format(family).grammar.kind == "vllm":
        import vllm.parser.harmony  # noqa: F401  (registers vLLM's harmony builder)

        from vllm_allowed_tools.vllm_glue.plugin import register_tag_builder
        register_tag_builder()
    functions = [AllowedFunction(name, CATALOG[name][0], CATALOG[name][1]) for name in ALLOWED]
    tag = build_structural_tag(family, functions, mode, parallel_tool_calls=parallel)
    if tag is None:
        return None
    return GrammarWalker(tag, format_tokens(family, tag), token_texts=marker_texts(family))


CASES = [(entry.name, mode, parallel) for entry in wire_formats()
         for mode in ("auto", "required") for parallel in (True, False)]


@pytest.mark.parametrize("family,mode,parallel", CASES)
def test_the_translation_admits_what_the_tag_admits(family, mode, parallel):
    walker = _walker(family, mode, parallel)
    if walker is None:
        pytest.skip(f"{family} has no {mode} grammar")
    walked, ended = compare_both_ways(walker, random.Random(f"{family}-{mode}-{parallel}"))
    assert walked >= WALKS // 2 and ended >= WALKS // 2


def test_what_is_not_translated_is_said():
    """A tag shape the translation does not cover raises UntranslatableTag (the row then waits for
    xgrammar's compile), never a wrong grammar."""
    text_then_more = {"type": "sequence", "elements": [{"type": "any_text"},
                                                       {"type": "const_string", "value": "x"}]}
    for node in ({"type": "qwen_xml_parameter", "json_schema": {}},
                 {"type": "token", "token": "<|end|>"},
                 text_then_more,
                 {"type": "grammar", "grammar": "root ::= other"},
                 {"type": "grammar", "grammar": 'root ::= "a" (= "b")  "c" ^'}):
        with pytest.raises(UntranslatableTag):
            lark_grammar(json.dumps({"type": "structural_tag", "format": node}))


def test_ebnf_escapes_and_repeats_translate():
    """xgrammar's EBNF spellings the argument grammars use: ``\\uXXXX`` in classes and strings,
    ``{m, -1}`` for an unbounded repeat, lookaheads dropped."""
    import llguidance
    lark = lark_grammar(json.dumps({"type": "grammar", "grammar":
                                    'root ::= "\\u0041" [^\\u0000-\\u001f"]{1, -1} (="!") "!"'}))
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    for text, admitted in (("Ab!", True), ("Abcd!", True), ("A!", False), ("A\x01!", False)):
        matcher = llguidance.LLMatcher(tokenizer, lark)
        ok = all(matcher.consume_token(byte) for byte in text.encode())
        assert (ok and matcher.is_accepting()) == admitted, text


class _Bytes:
    """A vocabulary of the 128 ASCII bytes and an end token."""
    eos_token_id, bos_token_id = 128, None
    tokens = [bytes([i]) for i in range(128)] + [b"\xff<eos>"]
    special_token_ids = [128]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


@pytest.mark.parametrize("family,prefix,suffix", [
    ("hermes", '<tool_call>\n{"name": "search_docs", "arguments": {"query": "', '"}}\n</tool_call>'),
    ("qwen3_xml", "<tool_call>\n<function=search_docs>\n<parameter=query>\n",
     "\n</parameter>\n</function>\n</tool_call>"),
])
def test_a_long_string_argument_keeps_the_matcher_going(family, prefix, suffix):
    """A 3,000-character string written a character a token: llguidance's parser stops a row whose
    open right recursions pass 2,000 items, so a string spelled by right-recursive rules (JSON
    strings, one rule a character) is one lexeme in the translation, and XML text left-recursive."""
    import llguidance
    walker = _walker(family, "required", False)
    tokenizer, lark = translated(walker)
    matcher = llguidance.LLMatcher(tokenizer, lark)
    text = prefix + "ab c" * 750 + suffix
    for char in text:
        assert matcher.consume_token(walker.index[char]), matcher.get_error()[:300]
    assert matcher.consume_token(walker.eos_id) and not matcher.is_error()


def test_a_schema_pattern_translates_as_xgrammar_reads_it():
    """xgrammar writes a string ``pattern`` as ``Regex("...", json_string=true)``: the string's value
    matches the whole pattern (anchored, as xgrammar holds it)."""
    import llguidance
    import xgrammar as xgr
    schema = {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[CDG][A-Z0-9]{2,}$"},
                                               "d": {"type": "string", "pattern": "ab+"}},
              "required": ["c", "d"]}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    assert 'json_string=true' in ebnf
    lark = lark_grammar(json.dumps({"type": "grammar", "grammar": ebnf}))
    vocab = [chr(c) for c in range(0x20, 0x7F)]
    info = xgr.TokenizerInfo([*vocab, "<eos>"], stop_token_ids=[len(vocab)])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    for c, d in (("CAB", "ab"), ("CA", "ab"), ("xCAB", "abb"), ("GA9Z", "abbb"), ("CAB", "xab"),
                 ("C\"B", "ab")):
        text = json.dumps({"c": c, "d": d})
        xm = xgr.GrammarMatcher(compiled)
        by_xgrammar = all(xm.accept_token(vocab.index(ch)) for ch in text) and xm.accept_token(len(vocab))
        lm = llguidance.LLMatcher(tokenizer, lark)
        by_llguidance = all(lm.consume_token(ord(ch)) for ch in text) and lm.is_accepting()
        assert by_llguidance == by_xgrammar, text
        assert by_xgrammar == (c in ("CAB", "GA9Z") and d != "xab"), text


#: schema shapes MCP servers publish: a string format, patterns, an ``anyOf`` tree, a long enum,
#: nested arrays of objects, bounds (what the grammar keeps of them: decode/argument_schemas.py)
RICH = {
    "post_message": {"type": "object", "properties": {
        "channel": {"type": "string", "pattern": "^[CDG][A-Z0-9]{8,}$"},
        "text": {"type": "string", "maxLength": 40000},
        "notify": {"type": "string", "format": "email"}}, "required": ["channel", "text"]},
    "query": {"type": "object", "properties": {"filter": {"anyOf": [
        {"type": "object", "properties": {"property": {"type": "string"},
                                          "equals": {"type": ["string", "number", "boolean"]}},
         "required": ["property", "equals"]},
        {"type": "object", "properties": {"and": {"type": "array", "items": {"type": "object"}}},
         "required": ["and"]}]},
        "zone": {"type": "string", "enum": [f"Zone/{i:03d}" for i in range(60)]},
        "rows": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["id"]}, "maxItems": 5}}, "required": ["filter"]},
}


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_rich_schemas_translate_as_the_tag_admits(mode):
    import llguidance
    functions = [AllowedFunction(name, schema, True) for name, schema in RICH.items()]
    tag = build_structural_tag("hermes", functions, mode, parallel_tool_calls=True)
    walker = GrammarWalker(tag, format_tokens("hermes", tag))
    tokenizer, lark = translated(walker)
    rng = random.Random(mode)
    walked = 0
    for _ in range(2 * WALKS):
        try:
            tokens = walker.walk_tokens(rng, prefix=("<tool_call>",) if mode == "auto" else ())
        except WalkError:
            continue
        matcher = llguidance.LLMatcher(tokenizer, lark)
        assert all(matcher.consume_token(walker.index[t]) for t in tokens), matcher.get_error()[:300]
        assert matcher.consume_token(walker.eos_id), "".join(tokens)
        walked += 1
    assert walked >= WALKS
    for _ in range(2 * WALKS):
        matcher = llguidance.LLMatcher(tokenizer, lark)
        written: list[str] = []
        for step in range(800):
            allowed = allowed_tokens(matcher, len(walker.vocab))
            token = walker.eos_id if step > 60 and walker.eos_id in allowed else rng.choice(allowed)
            if token == walker.eos_id:
                assert walker.accepts(written), f"xgrammar refused llguidance's {''.join(written)!r}"
                break
            assert matcher.consume_token(token)
            written.append(walker.vocab[token])


def test_rule_names_that_lowercase_alike_stay_apart():
    """Lark rule names are lowercase; a client's custom grammar may name ``aB`` and ``Ab``."""
    import llguidance
    lark = lark_grammar(json.dumps({"type": "grammar", "grammar":
                                    'root ::= aB Ab\naB ::= "x"\nAb ::= "y"'}))
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    for text, admitted in (("xy", True), ("xx", False), ("yy", False)):
        matcher = llguidance.LLMatcher(tokenizer, lark)
        ok = all(matcher.consume_token(byte) for byte in text.encode())
        assert (ok and matcher.is_accepting()) == admitted, text
