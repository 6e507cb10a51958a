"""The grammar admits only what the parser reads: strings sampled from every format's ``required``
grammar are read back by the format's parser as exactly one allowed call with the same arguments,
unary and streamed in random chunkings (issue 27, item 1).

Per format of the registry (aliases included) and per spelling (below), ``WALKS`` random walks of
the format's ``required`` grammar (``build_structural_tag(format, allowed, "required",
parallel_tool_calls=False)``, the tag the wrapper hands vLLM) over a synthetic vocabulary
(tests/support/grammar_walk.py): every printable ASCII character, whitespace, a few
non-ASCII characters, the format's markers and markup strings. Each walked string is read twice:

* what the walk wrote: :func:`~support.grammar_read.read_calls` reads it by the
  tag's own structure (which call tag, its function, the exact text of its arguments);
* what the server reads: vLLM's serving-layer parser (``ParserManager.get_parser`` over
  ``allowed_<format>``, as ``vllm serve`` composes it; for gpt-oss vLLM's ``HarmonyParser``), on a
  request carrying the policy as our middleware attaches it. Unary: ``parse(text, request,
  enable_auto_tools=True, model_output_token_ids=...)``, which calls the wrapper's
  ``extract_tool_calls`` wherever the server does (for the JSON-array formats whose base parser
  supports ``required``, vLLM's serving layer reads the array itself: that is what the server
  does). Streamed: ``parse_delta`` over the same tokens in three chunkings (one token a chunk, and
  two random ones), each chunk's token ids the tokenizer's ids for its walk tokens (a marker token is
  the format's single added token; a marker written in pieces is the pieces' ids), then the stop
  token alone (``<|call|>`` for gpt-oss, the tokenizer's EOS otherwise) with ``finished=True``.

Both must give exactly one call, named one of the allowed tools, whose arguments are a JSON object
equal (as JSON: ``true`` is not ``1``) to what the walk wrote, and valid against the schema for
strict tools. What "what the walk wrote" is, per argument style:

* JSON arguments (``json`` style, xgrammar's JSON EBNF, a JSON-array format's call under its
  ``arguments_key``): ``json.loads`` of the argument text;
* XML parameters (qwen3_coder, qwen3_xml, seed_oss: ``<parameter=k>v</parameter>``; glm45/glm47:
  ``<arg_key>k</arg_key><arg_value>v</arg_value>``; minimax_m2: ``<parameter name="k">v</parameter>``),
  for a strict tool the value the grammar pins: a string property's raw text (the grammar admits no
  framing there), less the format's markup newlines (qwen3/seed: one leading and one trailing
  ``\\n``, as vLLM's qwen3 parser strips them; glm and minimax: none, their parsers keep the value
  verbatim); an enum value, number, boolean or object: the text without the whitespace the grammar
  frames it with, as JSON (an enum value unquoted); for a non-strict tool (the grammar pins no
  types): the raw text less the markup newlines, converted as vLLM's engine converts it
  (``coerce_to_schema_type`` on the declared type), the parser's own conversion;
* repeated keys: the last one wins (as ``json.loads`` and every XML parser here do).

Spellings (``SPELLINGS``): ``markers``: every marker written as its one token, markup never inside a
value (what a trained model writes); ``pieces``: a marker may be spelled in pieces (its characters'
tokens), as a model can under a grammar that matches markers as text; ``markup-in-values``: marker
and markup strings may appear inside string values and free text, where the grammar admits them.

A format that fails is listed in ``XFAIL`` (strict), with the minimal failing string and the cause;
the failure message of a failing walk shows the walked string shrunk to a minimal one that still
fails the same way. ``VLLM_ALLOWED_TOOLS_WALKS`` sets the walks per test (default 100).
"""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import jsonschema
import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.devtools.models.format_model import HARMONY_FORMATS
from vllm_allowed_tools.formats import wire_format, wire_formats

from support.calls import chat_selection
from support.grammar_read import WrittenCall, python_calls, read_calls
from support.grammar_reads import (
    ALLOWED,
    ARGUMENT_SCHEMAS,
    CATALOG,
    SPELLINGS,
    WALKS,
    Setup,
    chat_tools,
    chunkings,
    json_equal,
    streamed_calls,
    unary_calls,
    written_values,
)
from support.grammar_walk import GrammarWalker, format_tokens, marker_texts
from support.parsers import tokenizer_for  # noqa: F401 (a fixture: a tokenizer with the format's markers)

FORMATS = [entry.name for entry in wire_formats()]

# The causes (grammar admits X, the parser reads Y), then the failing (format, spelling) pairs with
# the minimal string the default run shrinks its first failure to. (vLLM's streaming parsers' own
# misreads, of DeepSeek's multi-token deltas, Llama's partial JSON, Mistral's ': {', a marker spelled
# in pieces, are gone: under a policy the wrapper streams the unary parse's calls,
# vllm_glue/stream_calls.py; markers inside JSON strings, lone surrogate escapes, float overflows and
# GLM's repeated keys are not admitted, decode/safe_json.py, JSON-array formats' arrays too;
# harmony's markers are admitted only as their tokens, decode/marker_tokens.py; granite's required
# turns are read by the wrapper, not by vLLM's JSON-array reader, which an engine-based parser's
# stream starves, vllm_glue/parsers.py _reads_required_itself.)
def _why(cause: str, minimal: str) -> str:
    return f"{cause}. Minimal: {minimal}"


#: (format, spelling) -> why the format's required grammar admits a string its parser misreads;
#: strict: a pair that starts passing must be taken off
XFAIL: dict[tuple[str, str], str] = {}

def policy_request():
    """A ChatCompletionRequest as vLLM sees it after our middleware: required mode over ALLOWED,
    no parallel calls (support/parsers.py's policy_request, over this module's catalog)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_allowed_tools.request.rewrite import rewrite_request
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": chat_tools(),
            "parallel_tool_calls": False, "tool_choice": chat_selection("required", ALLOWED)}
    return ChatCompletionRequest(**rewrite_request(body, "chat").body)


@cache
def required_tag(family: str):
    if wire_format(family).grammar.kind == "vllm":
        import vllm.parser.harmony  # noqa: F401  (registers vLLM's harmony builder)
    functions = [AllowedFunction(name, CATALOG[name][0], CATALOG[name][1]) for name in ALLOWED]
    return build_structural_tag(family, functions, "required", parallel_tool_calls=False)


_SETUPS: dict[str, Setup] = {}


def setup_for(family: str, tokenizer_for) -> Setup:
    if family in _SETUPS:
        return _SETUPS[family]
    from vllm.parser.parser_manager import ParserManager
    tag = required_tag(family)
    assert tag is not None, f"{family}: no required grammar"
    tokenizer = tokenizer_for(family)
    parser_cls = ParserManager.get_parser(tool_parser_name=f"allowed_{family}", enable_auto_tools=True,
                                          is_harmony=family in HARMONY_FORMATS)
    request = parser_cls(tokenizer, policy_request().tools).adjust_request(policy_request())
    stop = "<|call|>" if family in HARMONY_FORMATS else None
    stop_id = tokenizer.convert_tokens_to_ids(stop) if stop else tokenizer.eos_token_id
    # the walk reads a marker token's id as its text (the tag's ids are the model's vocabulary's)
    walker = GrammarWalker(tag, format_tokens(family, tag), token_texts=marker_texts(family))
    setup = Setup(family, json.loads(walker.tag_json), walker, parser_cls, tokenizer, request, stop_id, {})
    _SETUPS[family] = setup
    return setup


# ------------------------------------------------------------------------- what the walk wrote
def written(setup: Setup, text: str) -> tuple[str, Any]:
    """(name, arguments) the walk wrote: exactly one call, as the tag reads it (Python calls, as
    ``ast`` reads them: the tag is one grammar node of them)."""
    if wire_format(setup.family).grammar.call_syntax == "pythonic":
        listed = python_calls(text)
        assert len(listed) == 1, f"the grammar admitted {len(listed)} calls in {text!r}"
        return listed[0]
    calls = read_calls(setup.tag, text, ARGUMENT_SCHEMAS)
    assert len(calls) == 1, f"the grammar admitted {len(calls)} calls in {text!r}: {calls}"
    call: WrittenCall = calls[0]
    if call.name is None:   # a bare JSON array of calls, arguments under the format's key
        items = json.loads(call.arguments)
        assert isinstance(items, list) and len(items) == 1, items
        return items[0]["name"], items[0][wire_format(setup.family).grammar.arguments_key]
    return written_values(setup.family, call)


# ------------------------------------------------------------------------- what the server reads
def judge(read: list[tuple[str, str]], expected: tuple[str, Any]) -> str | None:
    """None when ``read`` is exactly the one expected call; else what differs."""
    if len(read) != 1:
        return f"{len(read)} calls {read}"
    name, arguments = read[0]
    if name != expected[0] or name not in ALLOWED:
        return f"name {name!r}, expected {expected[0]!r}"
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return f"arguments {arguments!r} are not JSON"
    if not isinstance(parsed, dict):
        return f"arguments {arguments!r} are not a JSON object"
    if not json_equal(parsed, expected[1]):
        return f"arguments {parsed!r}, the walk wrote {expected[1]!r}"
    schema, strict = CATALOG[name]
    if strict:
        try:
            jsonschema.validate(parsed, schema)
        except jsonschema.ValidationError as exc:
            return f"arguments {parsed!r} invalid against the schema: {exc.message}"
    return None


def problem(setup: Setup, tokens: tuple[str, ...], seed: int) -> tuple[str, str] | None:
    """(kind, what went wrong) for the first check the walk fails, None when it passes all."""
    expected = written(setup, "".join(tokens))
    if not isinstance(expected[1], dict):
        return "written", f"the grammar admitted arguments {expected[1]!r}, not a JSON object"
    calls, content = unary_calls(setup, tokens)
    wrong = judge(calls, expected)
    if wrong:
        return "unary", f"{wrong} (content {content!r})"
    for name, sizes in chunkings(len(tokens), seed).items():
        calls, content = streamed_calls(setup, tokens, sizes)
        wrong = judge(calls, expected)
        if wrong:
            return f"streamed/{name}", f"{wrong} (content {content!r})"
    return None


# ----------------------------------------------------------------------------------------- tests
def _params():
    for family in FORMATS:
        for spelling in SPELLINGS:
            reason = XFAIL.get((family, spelling))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(family, spelling, marks=marks, id=f"{family}-{spelling}")


def test_the_walks_grammar_is_the_one_the_wrapper_hands_vllm(tokenizer_for):
    """The tag walked below is the wrapper's own for the request (so the walks explore what the
    server decodes with), for every format whose wrapper builds a tag."""
    from vllm.tool_parsers import ToolParserManager
    for family in FORMATS:
        wrapper = ToolParserManager.get_tool_parser(f"allowed_{family}")(tokenizer_for(family))
        if wire_format(family).grammar.kind == "json_array":   # no tag: the request's grammar
            handed = wrapper.adjust_request(policy_request()).structured_outputs.structural_tag
            assert json.loads(handed) == json.loads(json.dumps(required_tag(family).model_dump())), family
            continue
        ours = wrapper.get_structural_tag(policy_request())
        assert json.dumps(ours.model_dump(), sort_keys=True) == \
            json.dumps(required_tag(family).model_dump(), sort_keys=True), family


@pytest.mark.parametrize("family,spelling", list(_params()))
def test_every_string_the_required_grammar_admits_is_read_back(tokenizer_for, family, spelling):
    setup = setup_for(family, tokenizer_for)
    rng = random.Random(f"{family}/{spelling}")
    for _ in range(WALKS):
        seed = rng.randrange(2 ** 32)
        tokens = setup.walker.walk_tokens(random.Random(seed), **SPELLINGS[spelling])
        found = problem(setup, tokens, seed)
        if found is None:
            continue
        kind = found[0]

        def same_failure(candidate: tuple[str, ...], seed: int = seed, kind: str = kind) -> bool:
            try:
                again = problem(setup, candidate, seed)
            except (AssertionError, ValueError, KeyError):   # a candidate the reader cannot read
                return False
            return again is not None and again[0] == kind

        smallest = setup.walker.shrink(tokens, same_failure)
        pytest.fail(f"{family} ({spelling}): the required grammar admits {''.join(smallest)!r} "
                    f"(tokens {list(smallest)!r}); {kind}: {problem(setup, smallest, seed)[1]}\n"
                    f"  (the walk, seed {seed}: {''.join(tokens)!r})")
