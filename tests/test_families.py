"""The model families' wrappers without a server: each format's call, as the model writes it, is
what the allowed-subset grammar admits and what vLLM's parser reads back; a call to a tool outside
the subset is refused by both. Aliases are the same format under a second vLLM name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_allowed_tools.decode.grammar import AllowedFunction, build_structural_tag
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.formats import wire_format

from support.parsers import policy_request, tokenizer_for  # noqa: F401 (tokenizer_for: a fixture)

ARGS = '{"priority": "high"}'
#: one call to {name}(priority="high"), written as each format's model writes it
CALL_TEXT = {
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
                    + ARGS + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>" + ARGS
                     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0"
                "<|tool_call_argument_begin|>" + ARGS + "<|tool_call_end|><|tool_calls_section_end|>"),
    "glm47": "<tool_call>{name}<arg_key>priority</arg_key><arg_value>high</arg_value></tool_call>",
    "minimax_m2": ('\n<minimax:tool_call>\n<invoke name="{name}">\n<parameter name="priority">high'
                   '</parameter>\n</invoke>\n</minimax:tool_call>'),
    "seed_oss": ("<seed:tool_call>\n<function={name}>\n<parameter=priority>\nhigh\n</parameter>\n"
                 "</function>\n</seed:tool_call>"),
    "granite4": '<tool_call>\n{"name": "{name}", "arguments": ' + ARGS + '}\n</tool_call>',
    "qwen3_xml": ("<tool_call>\n<function={name}>\n<parameter=priority>\nhigh\n</parameter>\n</function>\n"
                  "</tool_call>"),
    "llama4_json": '{"name": "{name}", "parameters": ' + ARGS + "}",
}
CALL_TEXT["glm45"] = CALL_TEXT["glm47"]
ALIASES = {"glm45": "glm47", "llama4_json": "llama3_json", "qwen3_xml": "qwen3_coder"}
ALLOWED, OTHER = "get_ticket", "delete_note"   # both take one enum argument, `priority`


def call_text(family: str, name: str) -> str:
    return CALL_TEXT[family].replace("{name}", name)


def wrapper(tokenizer_for, family: str):
    from vllm.tool_parsers import ToolParserManager
    return ToolParserManager.get_tool_parser(f"allowed_{family}")(tokenizer_for(family))


@pytest.mark.parametrize("family", sorted(CALL_TEXT))
def test_the_grammar_admits_the_formats_call_to_an_allowed_tool_only(family):
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    functions = [AllowedFunction(ALLOWED, POOL_BY_NAME[ALLOWED].parameters, True)]
    tag = build_structural_tag(family, functions, "required", parallel_tool_calls=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    assert _is_grammar_accept_string(grammar, call_text(family, ALLOWED))
    assert not _is_grammar_accept_string(grammar, call_text(family, OTHER))


@pytest.mark.parametrize("family", sorted(CALL_TEXT))
def test_the_wrapper_reads_the_allowed_call_and_drops_the_other(tokenizer_for, family):
    parser = wrapper(tokenizer_for, family)
    request, _ = policy_request("required", [ALLOWED], [ALLOWED, OTHER])
    request = parser.adjust_request(request)
    kept = parser.extract_tool_calls(call_text(family, ALLOWED), request)
    assert [(call.function.name, json.loads(call.function.arguments)) for call in kept.tool_calls] == \
        [(ALLOWED, {"priority": "high"})], kept
    dropped = wrapper(tokenizer_for, family).extract_tool_calls(call_text(family, OTHER), request)
    assert dropped.tool_calls == [] and OTHER not in (dropped.content or ""), dropped


@pytest.mark.parametrize("family", ["granite4", "seed_oss"])
def test_a_format_whose_base_parser_has_no_tag_gets_ours_for_plain_requests(tokenizer_for, family):
    """vLLM builds no structural tag for these parsers; the wrapper names its own model, so vLLM asks
    it for every tag and parses required/named choices with the parser (not as a JSON array):
    plain ``required`` gets the format's grammar over the catalog, a named choice over that tool."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    parser = wrapper(tokenizer_for, family)
    assert type(parser).structural_tag_model == f"allowed_{family}"
    assert type(parser).supports_required_and_named is False
    tools = [POOL_BY_NAME[name].chat_tool() for name in (ALLOWED, OTHER)]
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    required = parser.get_structural_tag(ChatCompletionRequest(**base, tool_choice="required"))
    names = json.dumps(required.model_dump())
    assert ALLOWED in names and OTHER in names
    named = parser.get_structural_tag(ChatCompletionRequest(
        **base, tool_choice={"type": "function", "function": {"name": OTHER}}))
    assert OTHER in json.dumps(named.model_dump()) and f'"{ALLOWED}' not in json.dumps(named.model_dump())
    assert parser.get_structural_tag(ChatCompletionRequest(**base, tool_choice="auto")) is None


@pytest.mark.parametrize("alias,same", sorted(ALIASES.items()))
def test_an_alias_is_the_same_format_under_another_vllm_name(alias, same):
    from vllm.tool_parsers import ToolParserManager
    ours, theirs = wire_format(alias), wire_format(same)
    differs = {field.name for field in dataclasses.fields(ours)
               if getattr(ours, field.name) != getattr(theirs, field.name)}
    # llama4_json lists the same call triggers and tokens as llama3_json; only the name differs
    assert differs <= {"name"}, differs
    assert ToolParserManager.lazy_parsers[alias][1:] == ToolParserManager.lazy_parsers[same][1:]


@pytest.mark.parametrize("family", sorted(CALL_TEXT))
def test_the_auto_grammar_admits_text_then_an_allowed_call_only(family):
    """Auto mode: free text, and once the model writes the format's trigger only an allowed call
    (the e2e test can push a random model onto one-token triggers only; this covers every format)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    functions = [AllowedFunction(ALLOWED, POOL_BY_NAME[ALLOWED].parameters, True)]
    tag = build_structural_tag(family, functions, "auto", parallel_tool_calls=False)
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    assert _is_grammar_accept_string(grammar, "Let me check. ")
    assert _is_grammar_accept_string(grammar, "Let me check. " + call_text(family, ALLOWED))
    assert not _is_grammar_accept_string(grammar, "Let me check. " + call_text(family, OTHER))


def format_markers_in(family: str) -> list[str]:
    """The format's markers, read off the registry and its call as written (not the grammar's own
    list): special tokens, call triggers, every ``<...>`` piece of the call."""
    import re
    entry = wire_format(family)
    pieces = re.findall(r"<[^<>]*>", call_text(family, ALLOWED))
    return list(dict.fromkeys((*entry.special_tokens, *entry.call_triggers, *pieces)))


@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel"])
@pytest.mark.parametrize("family", sorted(CALL_TEXT))
def test_the_auto_grammars_free_text_holds_no_marker_of_the_format(family, parallel):
    """A marker in an auto turn's free text is read by the format's parser (decode/free_text.py):
    a stray ``<｜tool▁call▁begin｜>`` before DeepSeek's call made its parser fail and the call was
    lost; so no marker is admitted in the text before, between or after the calls but as the
    opening of a call (a call trigger that is followed by anything but a call is refused too)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    functions = [AllowedFunction(ALLOWED, POOL_BY_NAME[ALLOWED].parameters, True)]
    tag = build_structural_tag(family, functions, "auto", parallel_tool_calls=parallel)
    grammar = xgrammar.Grammar.from_structural_tag(tag.model_dump_json())
    call = call_text(family, ALLOWED)
    assert _is_grammar_accept_string(grammar, "Let me check. " + call)
    for marker in format_markers_in(family):
        assert not _is_grammar_accept_string(grammar, f"Let me check {marker} now."), marker
        assert not _is_grammar_accept_string(grammar, f"Let me check {marker} now. {call}"), marker
        if parallel:
            assert _is_grammar_accept_string(grammar, f"{call} Done.")
            assert not _is_grammar_accept_string(grammar, f"{call} Done {marker} now."), marker


#: a stray text before the call that the format's base parser misreads (decode/free_text.py keeps
#: the markers out of an auto turn's text; a '{' in Llama's text cannot be kept out)
MISREAD_TEXT = {"deepseek_v3": "<｜tool▁call▁begin｜>", "deepseek_v31": "<｜tool▁call▁begin｜>",
                "granite4": "</tool_call>", "llama4_json": "{x}"}


@pytest.mark.parametrize("family", sorted(MISREAD_TEXT))
def test_the_wrapper_reads_the_call_after_text_its_base_parser_misreads(tokenizer_for, family):
    """Where no grammar shaped the text, a stray marker before the call section still leaves the call
    read (vllm_glue/markup_reads.py: the calls are read from the first call trigger on) and the
    text before it as the message text, unary and streamed: no call made of the text, none lost."""
    from support.parsers import served
    tokenizer = tokenizer_for(family)
    request, _ = policy_request("auto", [ALLOWED], [ALLOWED, OTHER])
    request = wrapper(tokenizer_for, family).adjust_request(request)
    text = f"Let me check {MISREAD_TEXT[family]} now. "
    output = text + call_text(family, ALLOWED)
    read = wrapper(tokenizer_for, family).extract_tool_calls(output, request)
    assert [(call.function.name, json.loads(call.function.arguments)) for call in read.tool_calls] == \
        [(ALLOWED, {"priority": "high"})], read
    assert read.content == text, read
    parser, calls, content = served(tokenizer, f"allowed_{family}", request), {}, ""
    ids = tokenizer.encode(output, add_special_tokens=False)
    pieces = [(tokenizer.decode([i], skip_special_tokens=False), [i]) for i in ids]
    for number, (piece, piece_ids) in enumerate([*pieces, ("", [tokenizer.eos_token_id])]):
        delta = parser.parse_delta(piece, piece_ids, request, prompt_token_ids=[],
                                   finished=number == len(pieces))
        content += (delta.content or "") if delta else ""
        for call in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += (call.function.name or "") if call.function else ""
            entry[1] += (call.function.arguments or "") if call.function else ""
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == \
        [(ALLOWED, {"priority": "high"})], calls
    assert content == text


def test_call_markup_no_parser_reads_leaves_the_text_before_it_and_a_warning(tokenizer_for, caplog):
    """A complete call the base parser cannot read (DeepSeek-V3's with another type than
    ``function``: vLLM's parser raises) is no call and never text: the answer is the text before
    it, and the server log says so."""
    request, _ = policy_request("auto", [ALLOWED], [ALLOWED, OTHER])
    parser = wrapper(tokenizer_for, "deepseek_v3")
    request = parser.adjust_request(request)
    unreadable = call_text("deepseek_v3", ALLOWED).replace(">function<", ">method<")
    with caplog.at_level("WARNING", logger="vllm_allowed_tools.vllm_glue.markup_reads"):
        read = parser.extract_tool_calls("Sure. " + unreadable, request)
    assert read.tools_called and read.tool_calls == [] and read.content == "Sure. ", read
    assert any("read no call from the call markup" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("family", ["hermes", "seed_oss"])
def test_an_auto_selection_with_a_response_format_keeps_the_tag_vllm_built_beside_it(tokenizer_for, family):
    """vLLM's serving layer builds an auto turn's tag before the wrapper runs, with the client's
    response format beside the calls (the wrapper's tag of the allowed subset, or the format); the
    wrapper keeps that tag."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_allowed_tools.request.rewrite import rewrite_request

    from support.calls import chat_selection
    from support.parsers import served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "tools": [POOL_BY_NAME[name].chat_tool() for name in (ALLOWED, OTHER)],
            "tool_choice": chat_selection("auto", [ALLOWED]), "response_format": {"type": "json_object"}}
    request = ChatCompletionRequest(**rewrite_request(body, "chat").body)
    adjusted = served(tokenizer_for(family), f"allowed_{family}", request).adjust_request(request)
    tag = json.loads(adjusted.structured_outputs.structural_tag)
    assert tag["format"]["type"] == "or" and len(tag["format"]["elements"]) == 2, tag   # calls | format
    assert ALLOWED in json.dumps(tag) and OTHER not in json.dumps(tag)
