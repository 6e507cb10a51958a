"""The JSON-array formats' ``auto`` grammars admit only what their parsers read as the calls written,
every one allowed (decode/call_lists.py): random walks of each format's auto tag (the one the
wrapper hands vLLM), read unary and streamed through vLLM's own parser, as
``test_grammar_reads.py`` does for the required grammars.

What a walk wrote is read without any tool parser: after the first trigger (Mistral's
``[TOOL_CALLS]``, Granite's ``<|tool_call|>`` / ``<tool_call>``) the JSON array ``json`` reads
there; for a format whose calls open the message (xLAM's JSON array, the pythonic formats' list),
the whole text when it starts with ``[`` (``json.loads``; ``ast`` for Python calls); otherwise no
call. The parser must read exactly those calls (none for text), each allowed, its arguments equal
as JSON. Half the walks start with the format's opening, so every test sees calls (a floor: a walk
set with no call proves nothing); the other half walk from the message's start, mostly text.
"""

from __future__ import annotations

import json
import random
from functools import cache

import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.formats import wire_format, wire_formats

from support.calls import chat_selection
from support.grammar_read import python_calls
from support.grammar_reads import (
    ALLOWED,
    CATALOG,
    SPELLINGS,
    WALKS,
    Setup,
    chat_tools,
    chunkings,
    json_equal,
    streamed_calls,
    unary_calls,
)
from support.grammar_walk import GrammarWalker, format_tokens
from support.parsers import tokenizer_for  # noqa: F401 (a fixture: a tokenizer with the format's markers)


@cache
def auto_tag(family: str):
    functions = [AllowedFunction(name, CATALOG[name][0], CATALOG[name][1]) for name in ALLOWED]
    return build_structural_tag(family, functions, "auto", parallel_tool_calls=False)


FORMATS = [entry.name for entry in wire_formats() if entry.grammar.kind == "json_array"
           and auto_tag(entry.name) is not None]


def auto_request():
    """A ChatCompletionRequest as vLLM sees it after our middleware: auto mode over ALLOWED."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_allowed_tools.request.rewrite import rewrite_request
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": chat_tools(),
            "parallel_tool_calls": False, "tool_choice": chat_selection("auto", ALLOWED)}
    return ChatCompletionRequest(**rewrite_request(body, "chat").body)


_SETUPS: dict[str, Setup] = {}


def setup_for(family: str, tokenizer_for) -> Setup:
    if family not in _SETUPS:
        from vllm.parser.parser_manager import ParserManager
        tag = auto_tag(family)
        tokenizer = tokenizer_for(family)
        parser_cls = ParserManager.get_parser(tool_parser_name=f"allowed_{family}", enable_auto_tools=True)
        request = parser_cls(tokenizer, auto_request().tools).adjust_request(auto_request())
        walker = GrammarWalker(tag, [*format_tokens(family, tag), "```"])
        _SETUPS[family] = Setup(family, tag.model_dump(), walker, parser_cls, tokenizer, request,
                                tokenizer.eos_token_id, {})
    return _SETUPS[family]


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


def problem(setup: Setup, tokens: tuple[str, ...], seed: int) -> str | None:
    expected = written_calls(setup.family, "".join(tokens))
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
    rng, walks, with_calls = random.Random(f"auto/{family}/{spelling}"), max(WALKS // 2, 10), 0
    for number in range(walks):
        seed = rng.randrange(2 ** 32)
        prefix = (opening(family),) if number % 2 == 0 else ()
        tokens = setup.walker.walk_tokens(random.Random(seed), prefix=prefix, **SPELLINGS[spelling])
        with_calls += bool(written_calls(family, "".join(tokens)))
        found = problem(setup, tokens, seed)
        if found is not None:
            smallest = setup.walker.shrink(tokens, lambda c, s=seed: _fails(setup, c, s))
            pytest.fail(f"{family} ({spelling}): the auto grammar admits {''.join(smallest)!r}; "
                        f"{problem(setup, smallest, seed)}\n  (the walk: {''.join(tokens)!r})")
    assert with_calls >= walks // 2, f"{family}: only {with_calls} of {walks} walks wrote a call"


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
