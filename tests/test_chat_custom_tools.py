"""Chat Completions ``custom`` tools (``{"type": "custom", "custom": {"name", "description",
"format"}}``), which vLLM 0.32 refuses at validation: read and compiled like Responses' ones, served
to vLLM as the one-string-input function, selected and named, their calls given back in OpenAI's
Chat shape (unary and streamed) and judged against their grammar; and the custom input's grammar
in the decode of plain ``required`` turns and named custom choices on both APIs.
"""

from __future__ import annotations

import json

import pytest

from vllm_allowed_tools.asgi.turn_plan import output_contract, output_filter
from vllm_allowed_tools.decode.custom_capability import refuse_uncarried_custom_tools
from vllm_allowed_tools.errors import AllowedToolsError, CapabilityError, InvalidSelectionError
from vllm_allowed_tools.request.custom_tools import CODE_INVALID_CUSTOM_TOOL, read_custom_tools
from vllm_allowed_tools.request.identity import custom_parameters
from vllm_allowed_tools.request.rewrite import rewrite_request
from vllm_allowed_tools.response import ChatStreamGuard
from vllm_allowed_tools.response.chat_custom import (
    ChatCustomStream,
    InputDecoder,
    custom_input,
    restore_completion,
)
from vllm_allowed_tools.response.unary import check_chat_completion
from vllm_allowed_tools.response.violations import AllowedToolsViolation
from vllm_allowed_tools.wire import ALLOWLIST_KEY, WireAllowlist

from support.grammar_read import tag_nodes
from support.guard import run_guard


def _for(parser: str):
    """What the middleware lends rewrite_request for a server on ``parser``."""
    return lambda turn: refuse_uncarried_custom_tools(turn, parser)


DIGITS = r"[0-9]{4}"
PIN = {"type": "custom", "custom": {"name": "pin", "description": "A four-digit pin.",
                                    "format": {"type": "grammar", "syntax": "regex", "definition": DIGITS}}}
NOTE = {"type": "custom", "custom": {"name": "note"}}   # no format: free text, as OpenAI reads it
EXEC = {"type": "function", "function": {"name": "exec_command", "parameters": {"type": "object"}}}
META = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chat(*tools, **extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": list(tools), **extra}


def select(mode, *entries):
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": list(entries)}}


def custom(name):
    return {"type": "custom", "custom": {"name": name}}


# ------------------------------------------------------------------------------------- request

def test_every_chat_custom_tool_reaches_vllm_as_the_one_string_input_function():
    served = {tool["function"]["name"]: tool
              for tool in rewrite_request(chat(EXEC, PIN, NOTE), "chat").body["tools"]}
    assert all(tool["type"] == "function" for tool in served.values())
    assert served["pin"]["function"]["parameters"] == custom_parameters()
    assert served["pin"]["function"]["description"].startswith("A four-digit pin.\n\n")
    assert DIGITS in served["pin"]["function"]["description"]   # the model is shown the grammar
    assert served["note"]["function"] == {"name": "note", "parameters": custom_parameters()}
    assert served["exec_command"] == EXEC


def test_vllm_validates_the_served_request():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    for choice in ("auto", "required", custom("pin"), select("required", custom("pin"))):
        rewritten = rewrite_request(chat(EXEC, PIN, NOTE, tool_choice=choice), "chat").body
        served = ChatCompletionRequest(**rewritten)
        # vLLM reads the served catalog whole: every tool, the custom ones as functions
        assert {tool.function.name for tool in served.tools} == {"exec_command", "pin", "note"}


@pytest.mark.parametrize("tool,param,words", [
    ({"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": "start: (?=a)"}}},
     "tools[1].custom.format.definition", "does not compile"),
    ({"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "syntax": "ebnf",
                                                         "definition": "a"}}},
     "tools[1].custom.format.syntax", "\"lark\" or \"regex\""),
    ({"type": "custom", "custom": {"name": "x", "format": {"type": "json"}}},
     "tools[1].custom.format.type", "\"text\" or \"grammar\""),
    ({"type": "custom", "custom": {"format": {"type": "text"}}}, "tools[1].custom.name", "name"),
    ({"type": "custom", "name": "x"}, "tools[1].custom", "\"custom\": {\"name\""),
])
def test_a_chat_custom_tool_this_server_cannot_take_is_a_400_naming_the_field(tool, param, words):
    with pytest.raises(AllowedToolsError) as caught:
        rewrite_request(chat(EXEC, tool), "chat")
    assert caught.value.param == param and caught.value.code == CODE_INVALID_CUSTOM_TOOL
    assert words in caught.value.message


def test_two_chat_custom_tools_of_one_name_are_refused():
    with pytest.raises(AllowedToolsError) as caught:
        read_custom_tools([NOTE, NOTE], "chat")
    assert caught.value.param == "tools[1].custom.name"


@pytest.mark.parametrize("entry", [custom("pin"), {"type": "custom", "name": "pin"}])
def test_allowed_tools_selects_chat_custom_tools_in_both_shapes(entry):
    rewritten = rewrite_request(chat(EXEC, PIN, NOTE, tool_choice=select("required", entry)), "chat",
                                check_turn=_for("hermes"))
    assert rewritten.allowlist.allowed_flat_names == ("pin",)
    assert rewritten.allowlist.allows("custom", "pin") and not rewritten.allowlist.allows("function", "pin")
    assert rewritten.body["tool_choice"] == "required"
    assert rewritten.body[ALLOWLIST_KEY]["custom"] == {"note": None, "pin": ["regex", DIGITS]}


@pytest.mark.parametrize("choice,param,reason,words", [
    (select("auto", custom("exec_command")), "tool_choice.allowed_tools.tools[0].custom.name",
     "tool_type_mismatch", "is a function tool, not a custom tool"),
    (select("auto", {"type": "function", "function": {"name": "pin"}}),
     "tool_choice.allowed_tools.tools[0].function.name", "tool_type_mismatch",
     'select it as {"type": "custom", "custom": {"name": "pin"}}'),
    (select("auto", custom("pn")), "tool_choice.allowed_tools.tools[0].custom.name",
     "unknown_function", "the custom tools are: note, pin"),
    (custom("exec_command"), "tool_choice.custom.name", "tool_type_mismatch",
     "is a function tool, not a custom tool"),
    (custom("pn"), "tool_choice.custom.name", "unknown_function", "Did you mean 'pin'?"),
    ({"type": "custom"}, "tool_choice.custom", "malformed", '{"type": "custom", "custom": {"name"'),
    ({"type": "custom", "custom": {"name": ""}}, "tool_choice.custom.name", "malformed", "non-empty"),
])
def test_a_chat_custom_choice_that_names_no_custom_tool_is_a_400_naming_it(choice, param, reason, words):
    with pytest.raises(InvalidSelectionError) as caught:
        rewrite_request(chat(EXEC, PIN, NOTE, tool_choice=choice), "chat")
    assert (caught.value.param, caught.value.reason) == (param, reason), caught.value.message
    assert words in caught.value.message


def test_a_chat_custom_tool_and_a_function_of_one_name_are_ambiguous():
    twin = {"type": "custom", "custom": {"name": "exec_command"}}
    with pytest.raises(InvalidSelectionError) as caught:
        rewrite_request(chat(EXEC, twin, tool_choice=custom("exec_command")), "chat")
    assert caught.value.reason == "ambiguous_name" and caught.value.param == "tools[1].custom.name"


def test_a_named_chat_custom_choice_reaches_vllm_as_that_named_function():
    rewritten = rewrite_request(chat(EXEC, PIN, NOTE, tool_choice=custom("pin")), "chat", check_turn=_for("hermes"))
    assert rewritten.allowlist.choice == "named" and rewritten.allowlist.allowed_flat_names == ("pin",)
    assert rewritten.body["tool_choice"] == {"type": "function", "function": {"name": "pin"}}
    wire = WireAllowlist.from_wire(rewritten.body[ALLOWLIST_KEY])   # decoded with its grammar
    assert wire.allowed == {"pin"} and wire.mode == "required" and not wire.parallel_tool_calls


def test_custom_calls_in_the_history_reach_vllm_as_function_calls():
    history = [{"role": "user", "content": "pin?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "custom", "custom": {"name": "pin", "input": "1234"}},
                   {"id": "call_2", "type": "function", "function": {"name": "exec_command", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    body = rewrite_request({**chat(EXEC, PIN), "messages": history}, "chat").body
    first, second = body["messages"][1]["tool_calls"]
    assert first == {"id": "call_1", "type": "function",
                     "function": {"name": "pin", "arguments": '{"input": "1234"}'}}
    assert second == history[1]["tool_calls"][1]


# ------------------------------------------------- the grammar in every constrained mode (item 2)

def plain_choice_body(api: str, choice: str) -> dict:
    """A function and the grammar tool ``pin`` under plain ``required`` or the named ``pin``."""
    if api == "chat":
        return chat(EXEC, PIN, tool_choice=custom("pin") if choice == "named" else "required")
    return {"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
        {"type": "custom", "name": "pin", "format": PIN["custom"]["format"]}],
        "tool_choice": {"type": "custom", "name": "pin"} if choice == "named" else "required"}


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_plain_required_and_named_custom_choices_carry_the_custom_grammar_to_the_wrapper(api, choice):
    body = plain_choice_body(api, choice)
    rewritten = rewrite_request(body, api, check_turn=_for("hermes"))
    wire = WireAllowlist.from_wire(rewritten.body[ALLOWLIST_KEY])
    assert wire.mode == "required" and wire.custom["pin"] == ("regex", DIGITS)
    assert wire.allowed == ({"pin"} if choice == "named" else {"pin", "exec_command"})
    assert rewritten.allowlist.choice == choice   # the guard still judges the client's choice


def test_a_plain_turn_without_a_grammar_tool_keeps_vllms_own_grammar():
    for choice in ("required", custom("note")):
        assert ALLOWLIST_KEY not in rewrite_request(chat(EXEC, NOTE, tool_choice=choice), "chat",
                                                    check_turn=_for("hermes")).body


@pytest.mark.parametrize("choice", ["required", "named", "allowed"])
def test_a_format_that_cannot_carry_the_grammar_in_the_mode_is_a_400_before_generation(choice):
    tool_choice = {"required": "required", "named": custom("pin"),
                   "allowed": select("required", custom("pin"))}[choice]
    with pytest.raises(CapabilityError) as caught:
        rewrite_request(chat(EXEC, PIN, tool_choice=tool_choice), "chat", check_turn=_for("mistral"))
    assert "'pin'" in caught.value.message and "(mistral)" in caught.value.message
    rewrite_request(chat(EXEC, PIN, tool_choice="auto"), "chat", check_turn=_for("mistral"))   # no grammar there


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_wrapper_builds_the_custom_input_grammar_for_required_and_named(monkeypatch, api, choice):
    """What vLLM gets to decode with: the turn's structural tag holds the custom input's grammar."""
    from transformers import AutoTokenizer
    from vllm.tool_parsers import ToolParserManager

    from vllm_allowed_tools.settings import STAGE_NATIVE
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    from vllm_allowed_tools.vllm_glue import parsers
    from vllm_allowed_tools.vllm_glue.plugin import register

    register()
    monkeypatch.setattr(parsers, "active_constraint_stage", lambda: STAGE_NATIVE)
    if api == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Request
    else:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as Request
    request = Request(**rewrite_request(plain_choice_body(api, choice), api, check_turn=_for("hermes")).body)
    wrapper = ToolParserManager.get_tool_parser("allowed_hermes")(
        AutoTokenizer.from_pretrained(str(ensure_model("random"))))
    tag = json.loads(wrapper.adjust_request(request).structured_outputs.structural_tag)
    grammars = [node["grammar"] for node in tag_nodes(tag) if node.get("type") == "grammar"]
    assert grammars and all("[0-9]" in grammar or "0" in grammar for grammar in grammars), grammars
    assert any(node.get("value") == '{"input": "' for node in tag_nodes(tag))   # the JSON string's frame


# ------------------------------------------------------------------------------------ response

def function_call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def completion(*calls, finish="tool_calls"):
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": finish,
         "message": {"role": "assistant", "content": None, "tool_calls": list(calls)}}]}


def test_unary_custom_calls_go_back_in_the_client_shape():
    body = completion(function_call("pin", '{"input": "1234"}'),
                      function_call("exec_command", '{"cmd": "ls"}', "call_2"))
    restore_completion(body, {"pin", "note"})
    assert body["choices"][0]["message"]["tool_calls"] == [
        {"id": "call_1", "type": "custom", "custom": {"name": "pin", "input": "1234"}},
        function_call("exec_command", '{"cmd": "ls"}', "call_2")]


@pytest.mark.parametrize("arguments,cut,expected", [
    ('{"input": "a\\"b\\n"}', False, 'a"b\n'),
    ("bare text", False, "bare text"),               # as vLLM's Responses path reads it
    ('{"input": "12', True, "12"),                   # the token limit cut it: what was decoded
    ('{"input": 3}', False, '{"input": 3}'),
])
def test_the_input_is_read_as_vllm_reads_a_custom_calls(arguments, cut, expected):
    assert custom_input(arguments, cut=cut) == expected


def test_the_decoder_streams_every_spelling_of_the_input_in_any_chunking():
    text = 'he said "hi"\n\t\\ é \U0001F600 </parameter>'
    for arguments in (json.dumps({"input": text}), json.dumps({"input": text}, ensure_ascii=False),
                      '{ "input" :"' + json.dumps(text)[1:] + " }"):
        for size in (1, 2, 5, 7):
            decoder = InputDecoder()
            streamed = "".join(decoder.feed(arguments[i:i + size]) for i in range(0, len(arguments), size))
            assert streamed == text, (arguments, size)


def chunk(*calls, finish=None, content=None, index=0):
    delta = {"tool_calls": list(calls)} if calls else {}
    if content is not None:
        delta["content"] = content
    return {**META, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def streamed_call(name, arguments, size=3, index=0, call_id="call_1"):
    first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    return [chunk(first)] + [chunk({"index": index, "function": {"arguments": arguments[i:i + size]}})
                             for i in range(0, len(arguments), size)]


def test_streamed_custom_calls_go_back_as_custom_deltas():
    events = [chunk(content=""), *streamed_call("pin", '{"input": "1234"}'),
              *streamed_call("exec_command", '{"cmd": "ls"}', index=1, call_id="call_2"),
              chunk(finish="tool_calls")]
    stream = ChatCustomStream({"pin"})
    out = [stream.feed(event) for event in events] + stream.finish()
    calls = [call for c in out for choice in c["choices"] for call in choice["delta"].get("tool_calls", [])]
    pin = [call for call in calls if call["index"] == 0]
    assert pin[0] == {"index": 0, "id": "call_1", "type": "custom", "custom": {"name": "pin", "input": ""}}
    assert all("function" not in call and set(call["custom"]) <= {"name", "input"} for call in pin)
    assert "".join(call["custom"].get("input", "") for call in pin) == "1234"
    other = [call for call in calls if call["index"] == 1]
    assert other[0]["type"] == "function" and "".join(
        call["function"]["arguments"] for call in other) == '{"cmd": "ls"}'
    assert out[0] is events[0] and out[-1] is events[-1]   # untouched chunks stay the same objects


def test_what_the_decoding_could_not_stream_goes_out_with_the_chunk_that_ends_the_call():
    stream = ChatCustomStream({"note"})
    out = [stream.feed(event) for event in [*streamed_call("note", "free text"), chunk(finish="tool_calls")]]
    last = out[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"] == [{"index": 0, "custom": {"input": "free text"}}]


def turn(tool_choice, *tools):
    body = chat(*(tools or (EXEC, PIN, NOTE)), tool_choice=tool_choice)
    rewritten = rewrite_request(body, "chat", check_turn=_for("hermes"))
    data = rewritten.request
    return (output_filter(rewritten, data, "chat"),
            output_contract(rewritten, data, "chat", strict_all=False),
            read_custom_tools(data["tools"], "chat").names)


@pytest.mark.parametrize("tool_choice", [select("required", custom("pin")), custom("pin"), "auto"])
def test_the_unary_guard_judges_a_chat_custom_input_against_its_grammar(tool_choice):
    call_filter, contract, names = turn(tool_choice)
    good = completion(function_call("pin", '{"input": "2024"}'))
    restore_completion(good, names)
    check_chat_completion(good, call_filter, contract=contract)
    bad = completion(function_call("pin", '{"input": "20x4"}'))
    restore_completion(bad, names)
    with pytest.raises(AllowedToolsViolation) as caught:
        check_chat_completion(bad, call_filter, contract=contract)
    assert caught.value.reason == "custom_input_invalid"
    cut = completion(function_call("pin", '{"input": "20'), finish="length")   # the limit cut it
    restore_completion(cut, names)
    check_chat_completion(cut, call_filter, contract=contract)


def test_the_unary_guard_lets_out_exactly_the_selected_custom_tools():
    call_filter, contract, names = turn(select("required", custom("pin")))
    body = completion(function_call("note", '{"input": "hi"}'))
    restore_completion(body, names)
    with pytest.raises(AllowedToolsViolation) as caught:
        check_chat_completion(body, call_filter, contract=contract)
    assert caught.value.kind == "custom"


def test_the_stream_guard_judges_a_chat_custom_input_before_the_call_completes():
    call_filter, contract, names = turn(select("required", custom("pin")))
    good = run_guard(ChatStreamGuard(call_filter, contract=contract, custom_names=names),
                     [*streamed_call("pin", '{"input": "2024"}'), chunk(finish="tool_calls")])
    assert not any("error" in c for c in good)
    assert "".join(call["custom"].get("input", "") for c in good for choice in c["choices"]
                   for call in choice["delta"].get("tool_calls", [])) == "2024"
    assert good[-1]["choices"][0]["finish_reason"] == "tool_calls"
    bad = run_guard(ChatStreamGuard(call_filter, contract=contract, custom_names=names),
                    [*streamed_call("pin", '{"input": "20x4"}'), chunk(finish="tool_calls")])
    assert "error" in bad[-1] and "custom_input_invalid" in json.dumps(bad[-1])
    assert all(choice.get("finish_reason") is None for c in bad[:-1] for choice in c["choices"])


def test_a_streamed_custom_call_whose_input_cannot_be_answered_is_refused():
    call_filter, contract, names = turn("auto")
    out = run_guard(ChatStreamGuard(call_filter, contract=contract, custom_names=names),
                    [*streamed_call("note", '{"input": "ab" "c"}'), chunk(finish="tool_calls")])
    assert "error" in out[-1] and "custom_input_invalid" in json.dumps(out[-1])
