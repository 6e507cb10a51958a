"""Every ``auto`` grammar admits only what its parser reads as the calls written, every one allowed:
random walks of each format's auto tag (the one the wrapper hands vLLM), read unary and streamed
through vLLM's own parser, as ``test_grammar_reads.py`` does for the required grammars.

The JSON-array formats (decode/call_lists.py): what a walk wrote is read without any tool parser:
after the first trigger (Mistral's ``[TOOL_CALLS]``, Granite's ``<|tool_call|>`` / ``<tool_call>``)
the JSON array ``json`` reads there; for a format whose calls open the message (xLAM's JSON array,
the pythonic formats' list), the whole text when it starts with ``[`` (``json.loads``; ``ast`` for
Python calls); otherwise no call. Half the walks start with the format's opening, so every test
sees calls (a floor: a walk set with no call proves nothing); the other half walk from the
message's start, mostly text.

Every other format (free text, an allowed call after each trigger, text between and after the
calls): what a walk wrote is what the tag's own structure reads (support/grammar_read.py
``read_calls``), with and without parallel calls, half the walks starting with the trigger
(a floor on the calls seen as above). The ``markup-in-values`` spelling writes the
format's markers into the free text wherever the grammar admits them: a marker its parser reads
in text (a stray ``<｜tool▁call▁begin｜>`` before DeepSeek's calls, an ``<invoke`` in MiniMax's text,
a ``</tool_call>`` before Granite 4's) lost or made calls until the free text excluded them
(decode/free_text.py).

The parser must read exactly the calls written (none for text), each allowed, its arguments equal
as JSON.
"""

from __future__ import annotations

import json
import random
from functools import cache

import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.formats import wire_format, wire_formats

from support.calls import chat_selection
from support.grammar_read import python_calls, read_calls, tag_nodes
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


@cache
def auto_tag(family: str, parallel: bool = False):
    if wire_format(family).grammar.kind == "vllm":
        import vllm.parser.harmony  # noqa: F401  (registers vLLM's harmony builder)
    functions = [AllowedFunction(name, CATALOG[name][0], CATALOG[name][1]) for name in ALLOWED]
    return build_structural_tag(family, functions, "auto", parallel_tool_calls=parallel)


FORMATS = [entry.name for entry in wire_formats() if entry.grammar.kind == "json_array"
           and auto_tag(entry.name) is not None]
#: the formats whose auto grammar is free text with calls after triggers (every other kind)
TAG_FORMATS = [entry.name for entry in wire_formats() if entry.grammar.kind != "json_array"]
#: (format, parallel) -> why its auto grammar admits a string its parser misreads; strict: a pair
#: that starts passing must be taken off
TAG_XFAIL: dict[tuple[str, bool], str] = {}


def auto_request(parallel: bool = False):
    """A ChatCompletionRequest as vLLM sees it after our middleware: auto mode over ALLOWED."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_allowed_tools.request.rewrite import rewrite_request
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": chat_tools(),
            "parallel_tool_calls": parallel, "tool_choice": chat_selection("auto", ALLOWED)}
    return ChatCompletionRequest(**rewrite_request(body, "chat").body)


_SETUPS: dict[tuple[str, bool], Setup] = {}


def setup_for(family: str, tokenizer_for, parallel: bool = False) -> Setup:
    if (family, parallel) not in _SETUPS:
        from vllm.parser.parser_manager import ParserManager

        from vllm_allowed_tools.devtools.models.format_model import HARMONY_FORMATS
        tag = auto_tag(family, parallel)
        tokenizer = tokenizer_for(family)
        harmony = family in HARMONY_FORMATS
        parser_cls = ParserManager.get_parser(tool_parser_name=f"allowed_{family}", enable_auto_tools=True,
                                              is_harmony=harmony)
        request = parser_cls(tokenizer, auto_request(parallel).tools).adjust_request(auto_request(parallel))
        # the walk reads a marker token's id as its text (the tag's ids are the model's vocabulary's)
        walker = GrammarWalker(tag, [*format_tokens(family, tag), "```"],
                               token_texts=marker_texts(family))
        stop_id = tokenizer.convert_tokens_to_ids("<|call|>") if harmony else tokenizer.eos_token_id
        _SETUPS[(family, parallel)] = Setup(family, json.loads(walker.tag_json), walker, parser_cls,
                                            tokenizer, request, stop_id, {})
    return _SETUPS[(family, parallel)]


def opening(family: str) -> str:
    spec = wire_format(family).grammar
    return spec.auto_triggers[0] if spec.auto_triggers else "["


def written_calls(family: str, text: str) -> list[tuple[str, dict]]:
    """The calls a walk of the auto grammar wrote, read by the format's call syntax alone."""
    spec = wire_format(family).grammar
    if spec.auto_triggers:
        starts = [(text.find(trigger), trigger) for trigger in spec.auto_triggers if trigger in text]
        if not starts:
            return []
        start, trigger = min(starts)
        items, _ = json.JSONDecoder().raw_decode(text[start + len(trigger):])
    elif not text.startswith("["):
        return []
    elif spec.call_syntax == "pythonic":
        return python_calls(text)
    else:
        items = json.loads(text)
    return [(item["name"], item[spec.auto_arguments_key]) for item in items]


def differs(read: list[tuple[str, str]], expected: list[tuple[str, dict]]) -> str | None:
    if len(read) != len(expected):
        return f"{len(read)} calls {read}, the walk wrote {expected}"
    for (name, arguments), (want, values) in zip(read, expected):
        if name != want or name not in ALLOWED:
            return f"name {name!r}, the walk wrote {want!r} (allowed: {ALLOWED})"
        if not json_equal(json.loads(arguments), values):
            return f"arguments {arguments!r}, the walk wrote {values!r}"
    return None


def tag_calls(setup: Setup, text: str) -> list[tuple[str, dict]]:
    """The calls a walk of a tag format's auto grammar wrote, as the tag's structure reads them."""
    return [written_values(setup.family, call) for call in read_calls(setup.tag, text, ARGUMENT_SCHEMAS)]


def problem(setup: Setup, tokens: tuple[str, ...], seed: int) -> str | None:
    expected = written_calls(setup.family, "".join(tokens)) if setup.family in FORMATS else \
        tag_calls(setup, "".join(tokens))
    calls, content = unary_calls(setup, tokens)
    wrong = differs(calls, expected)
    if wrong:
        return f"unary: {wrong} (content {content!r})"
    for name, sizes in chunkings(len(tokens), seed).items():
        calls, content = streamed_calls(setup, tokens, sizes)
        wrong = differs(calls, expected)
        if wrong:
            return f"streamed/{name}: {wrong} (content {content!r})"
    return None


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("family", FORMATS)
def test_every_string_the_auto_grammar_admits_reads_back_as_its_allowed_calls(tokenizer_for, family,
                                                                               spelling):
    setup = setup_for(family, tokenizer_for)
    walks = max(WALKS // 2, 10)
    with_calls = _walk_and_read_back(setup, f"auto/{family}/{spelling}", walks, spelling,
                                     opening(family), lambda text: written_calls(family, text),
                                     label=f"{family} ({spelling})")
    assert with_calls >= walks // 2, f"{family}: only {with_calls} of {walks} walks wrote a call"


def _walk_and_read_back(setup: Setup, name: str, walks: int, spelling: str, opening_text: str | None,
                        calls_of, *, label: str) -> int:
    """``walks`` random walks of the setup's auto grammar (every other one opening with
    ``opening_text``), each read back unary and streamed; the first that reads back wrong fails the
    test, shrunk; how many wrote a call (``calls_of``)."""
    rng, with_calls = random.Random(name), 0
    for number in range(walks):
        seed = rng.randrange(2 ** 32)
        prefix = (opening_text,) if opening_text and number % 2 == 0 else ()
        tokens = setup.walker.walk_tokens(random.Random(seed), prefix=prefix, **SPELLINGS[spelling])
        with_calls += bool(calls_of("".join(tokens)))
        if problem(setup, tokens, seed) is not None:
            smallest = setup.walker.shrink(tokens, lambda c, s=seed: _fails(setup, c, s))
            pytest.fail(f"{label}: the auto grammar admits {''.join(smallest)!r}; "
                        f"{problem(setup, smallest, seed)}\n  (the walk: {''.join(tokens)!r})")
    return with_calls


def _tag_params():
    for family in TAG_FORMATS:
        for parallel in (False, True):
            reason = TAG_XFAIL.get((family, parallel))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(family, parallel, marks=marks,
                               id=f"{family}-{'parallel' if parallel else 'one-call'}")


@pytest.mark.parametrize("family,parallel", list(_tag_params()))
def test_every_string_a_tag_formats_auto_grammar_admits_reads_back_as_its_calls(tokenizer_for, family,
                                                                                parallel):
    setup = setup_for(family, tokenizer_for, parallel)
    walks, with_calls = max(WALKS // 4, 10), 0
    triggers = [trigger for node in tag_nodes(setup.tag) if node.get("type") == "triggered_tags"
                for trigger in node["triggers"]]
    for spelling in SPELLINGS:
        with_calls += _walk_and_read_back(setup, f"auto/{family}/{spelling}/{parallel}", walks,
                                          spelling, triggers[0] if triggers else None,
                                          lambda text: tag_calls(setup, text),
                                          label=f"{family} ({spelling}, parallel {parallel})")
    assert with_calls >= walks, \
        f"{family}: only {with_calls} of {len(SPELLINGS) * walks} walks wrote a call"


def _fails(setup: Setup, tokens: tuple[str, ...], seed: int) -> bool:
    try:
        return problem(setup, tokens, seed) is not None
    except (ValueError, KeyError, SyntaxError):   # a candidate the readers cannot read
        return False


def test_every_json_array_format_holds_auto_by_grammar():
    """Phi-4-mini's too: its parser reads the call list up to the first ``]``, so its arguments
    hold no array and its strings no raw ``]`` (decode/call_lists.py ``without_arrays``)."""
    assert sorted(FORMATS) == sorted(entry.name for entry in wire_formats()
                                     if entry.grammar.kind == "json_array")
    assert all(wire_format(name).grammar.holds_auto for name in FORMATS)
