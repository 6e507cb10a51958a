"""No call markup as text (the parser wrappers, no server): a call cut off by the token limit is
never handed out as message text, unary or streamed, in any wire format or mode.

Every wrapped parser gets the output of a whole allowed call (auto mode: after a line of prose) cut
after every token, as vLLM hands it over when ``max_tokens`` / ``max_output_tokens`` is hit: the
text the server would send is at most the prose, never a piece of the call (trigger, name,
arguments), and the whole output still parses to the call. The parsers run inside vLLM's own
``DelegatingParser`` (``parse`` / ``parse_delta``, what the serving layer calls), because that layer
decides which text goes out: without a call it sends the raw model output, whatever the tool parser
said. ``pythonic`` has no trigger in auto mode (its text is left as is, see vllm_glue/parsers.py),
so only its required mode is covered.
"""

from __future__ import annotations

import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME

from support.parsers import TWO_TOOLS, glue, policy_request, served, unary  # noqa: F401 (glue: a fixture)

PROSE = "Sure. "
CALLS = {
    "allowed_hermes": '<tool_call>\n{"name": "get_ticket", "arguments": {"priority": "high"}}\n</tool_call>',
    "allowed_qwen3_coder": ("<tool_call>\n<function=get_ticket>\n<parameter=priority>\nhigh\n</parameter>\n"
                            "</function>\n</tool_call>"),
    "allowed_llama3_json": '{"name": "get_ticket", "parameters": {"priority": "high"}}',
    "allowed_mistral": '[{"name": "get_ticket", "arguments": {"priority": "high"}}]',
    "allowed_pythonic": '[get_ticket(priority="high")]',
}
AUTO_CALLS = {**CALLS, "allowed_mistral": "[TOOL_CALLS]" + CALLS["allowed_mistral"]}
# pythonic's required mode is vLLM's JSON-schema path ([{"name", "parameters"}], parsed by the
# serving layer itself, which never sends text there)
CALLS["allowed_pythonic"] = '[{"name": "get_ticket", "parameters": {"priority": "high"}}]'

CASES = [(parser, mode) for parser in CALLS for mode in ("required", "auto")
         if (parser, mode) != ("allowed_pythonic", "auto")]


def wrapper(tokenizer, parser: str):
    from vllm.tool_parsers import ToolParserManager
    return ToolParserManager.get_tool_parser(parser)(tokenizer)


def stream(tokenizer, parser: str, ids: list[int], request) -> tuple[str, list[str]]:
    """(the content streamed, the call names streamed) for output token ids fed one at a time."""
    parser_obj = served(tokenizer, parser, request)
    previous_text, content, names = "", [], []
    for n in range(len(ids)):
        current = tokenizer.decode(ids[:n + 1])
        delta = parser_obj.parse_delta(current[len(previous_text):], ids[n:n + 1], request,
                                       prompt_token_ids=[0], finished=n == len(ids) - 1)
        if delta is not None:
            content.append(delta.content or "")
            names += [call.function.name for call in delta.tool_calls or ()
                      if call.function is not None and call.function.name]
        previous_text = current
    return "".join(content), names


def assert_no_markup(text: str | None, mode: str, call: str) -> None:
    """At most the prose before the call: no trigger, name or argument of it."""
    text = text or ""
    expected = PROSE if mode == "auto" else ""
    assert expected.startswith(text) or expected.strip().startswith(text.strip()), text
    assert "get_ticket" not in text and "priority" not in text


@pytest.mark.parametrize("parser,mode", CASES)
def test_a_cut_off_call_is_never_text(glue, parser, mode):
    tokenizer = glue(parser)
    call = (AUTO_CALLS if mode == "auto" else CALLS)[parser]
    output = (PROSE if mode == "auto" else "") + call
    ids = tokenizer.encode(output, add_special_tokens=False)
    request, _ = policy_request(mode, ["get_ticket"], TWO_TOOLS)
    for cut in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:cut])
        content, calls = unary(tokenizer, parser, text, request)
        # a cut-off call may come back as a call (hermes once its JSON is whole; qwen3_coder as
        # soon as the name is, with the arguments it has): a call, the guard's business, not text
        assert all(parsed.name == "get_ticket" for parsed in calls), text
        assert_no_markup(content, mode, call)
        streamed, names = stream(tokenizer, parser, ids[:cut], request)
        assert_no_markup(streamed, mode, call)
        assert set(names) <= {"get_ticket"}
    # the whole output is still the call
    content, calls = unary(tokenizer, parser, tokenizer.decode(ids), request)
    assert [c.name for c in calls] == ["get_ticket"], (content, calls)
    assert POOL_BY_NAME["get_ticket"].arguments_valid(calls[0].arguments)
    assert_no_markup(content, mode, call)


@pytest.mark.parametrize("parser", ["allowed_hermes", "allowed_qwen3_coder"])
def test_complete_calls_before_a_cut_off_one_are_kept(glue, parser):
    tokenizer = glue(parser)
    request, _ = policy_request("required", ["get_ticket", "delete_note"], TWO_TOOLS, parallel=True)
    first = CALLS[parser]
    second = first.replace("get_ticket", "delete_note")
    for cut in range(1, len(second)):
        content, calls = unary(tokenizer, parser, first + "\n" + second[:cut], request)
        names = [c.name for c in calls]
        assert names in (["get_ticket"], ["get_ticket", "delete_note"]), (cut, content, calls)
        assert content is None


@pytest.mark.parametrize("parser,mode", [case for case in CASES
                                         if case != ("allowed_pythonic", "required")])
def test_a_refused_call_is_not_sent_as_text_either(glue, parser, mode):
    """A whole call outside the allowlist, dropped by the wrapper: nothing of it goes out, and the
    text is not the raw output (vLLM's serving layer sends that when the parse has no call).
    (pythonic's required mode is parsed by vLLM's serving layer, not by a tool parser: there the
    grammar and the output guard keep such calls out.)"""
    tokenizer = glue(parser)
    request, _ = policy_request(mode, ["delete_note"], TWO_TOOLS)   # get_ticket: catalog only
    call = (AUTO_CALLS if mode == "auto" else CALLS)[parser]
    output = (PROSE if mode == "auto" else "") + call
    content, calls = unary(tokenizer, parser, output, request)
    assert calls == []
    assert_no_markup(content, mode, call)
    ids = tokenizer.encode(output, add_special_tokens=False)
    streamed, names = stream(tokenizer, parser, ids, request)
    assert names == []
    assert_no_markup(streamed, mode, call)


def test_without_a_policy_the_base_parser_answers(glue):
    """Plain requests keep vanilla vLLM's behaviour (the policy is what this is about)."""
    tokenizer = glue("allowed_hermes")
    _, plain = policy_request("required", ["get_ticket"], TWO_TOOLS)
    cut = CALLS["allowed_hermes"][:30]
    info = wrapper(tokenizer, "allowed_hermes").extract_tool_calls(cut, plain)
    base = wrapper(tokenizer, "hermes").extract_tool_calls(cut, plain)
    assert (info.tools_called, info.content) == (base.tools_called, base.content)
    assert unary(tokenizer, "allowed_hermes", cut, plain) == unary(tokenizer, "hermes", cut, plain)


def test_the_triggers_are_where_the_grammar_starts_a_call():
    from vllm_allowed_tools.vllm_glue.parsers import CALL_TRIGGERS
    functions = [AllowedFunction("get_ticket", POOL_BY_NAME["get_ticket"].parameters, True)]
    for wire_format in ("hermes", "llama3_json", "qwen3_coder"):
        tag = build_structural_tag(wire_format, functions, "auto")
        for trigger in tag.format.triggers:
            assert any(trigger.startswith(ours) for ours in CALL_TRIGGERS[wire_format]), trigger


def test_every_call_trigger_opens_a_call_or_is_kept_out_of_the_free_text():
    """The wrapper returns no text from the first call trigger on (a call starts there), which only
    holds if the auto grammar never writes a call trigger as text: each is one of the grammar's
    triggers (after it, only an allowed call), or the free text excludes it (decode/free_text.py).
    Qwen3-Coder's grammar triggered on ``<tool_call>\n<function=`` and let a bare ``<tool_call>``
    be text; Llama's let ``<|python_tag|>`` be text."""
    import vllm.parser.harmony  # noqa: F401  (registers vLLM's harmony builder)

    from vllm_allowed_tools.formats import wire_formats
    functions = [AllowedFunction("get_ticket", POOL_BY_NAME["get_ticket"].parameters, True)]
    for entry in wire_formats():
        tag = build_structural_tag(entry.name, functions, "auto") if entry.grammar.holds_auto else None
        node = tag.format if tag is not None else None
        if getattr(node, "type", None) != "triggered_tags":
            continue
        for trigger in entry.call_triggers:
            assert trigger in node.triggers or trigger in node.excludes or \
                any(ours in trigger for ours in node.triggers), (entry.name, trigger)


def test_call_start():
    from vllm_allowed_tools.vllm_glue.parsers import call_start
    triggers = ("<tool_call>",)
    assert call_start("hello", triggers) is None
    assert call_start("hi <tool_call>{", triggers) == 3
    assert call_start("hi <tool_c", triggers) == 3          # a trigger cut off by the token limit
    assert call_start("a < b", triggers) is None
    assert call_start("x <", triggers) == 2
    assert call_start("<tool_call> then <tool_call>", triggers) == 0
    assert call_start("anything", ()) is None
