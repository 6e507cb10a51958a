"""Responses ``custom`` tools with a grammar (Codex's ``apply_patch``): read, compiled, served as
text tools to vLLM, echoed as the client sent them, and their calls' input checked by the grammar
(unary and streamed).
"""

from __future__ import annotations

import copy

import pytest

from vllm_allowed_tools.asgi.turn_plan import output_contract
from vllm_allowed_tools.errors import AllowedToolsError
from vllm_allowed_tools.request.custom_tools import CODE_INVALID_CUSTOM_TOOL, read_custom_tools
from vllm_allowed_tools.request.rewrite import echo_of, restore_echo, rewrite_request
from vllm_allowed_tools.response import ResponsesStreamGuard
from vllm_allowed_tools.response.call_names import AllowedNames
from vllm_allowed_tools.response.unary import check_responses_object
from vllm_allowed_tools.response.violations import AllowedToolsViolation

from support.guard import run_guard

PATCH_GRAMMAR = '''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Add File: " filename LF add_line+
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
%import common.LF
'''
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi \"there\"\n*** End Patch\n"
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
DIGITS = {"type": "custom", "name": "pin", "format": {"type": "grammar", "syntax": "regex",
                                                       "definition": r"[0-9]{4}"}}
FREE = {"type": "custom", "name": "note", "description": "Free text."}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}


def body(*tools, **extra):
    return {"model": "m", "input": "hi", "tools": list(tools), **extra}


def test_grammar_tools_reach_vllm_as_text_tools_that_show_the_grammar():
    rewritten = rewrite_request(body(EXEC, APPLY_PATCH, FREE), "responses")
    served = {tool["name"]: tool for tool in rewritten.body["tools"]}
    assert served["apply_patch"]["format"] == {"type": "text"}
    assert PATCH_GRAMMAR in served["apply_patch"]["description"]
    assert served["apply_patch"]["description"].startswith("Edit files.")
    assert served["note"] == FREE and served["exec_command"] == EXEC


def test_the_echo_gives_the_client_its_own_grammar_tool_back():
    rewritten = rewrite_request(body(EXEC, APPLY_PATCH), "responses")
    echoed = {"object": "response", "tools": [dict(EXEC, strict=None), dict(
        rewritten.body["tools"][0] if rewritten.body["tools"][0]["type"] == "custom" else rewritten.body["tools"][1])]}
    restored = restore_echo(echoed, echo_of(rewritten, "responses"))
    assert restored["tools"][1] == APPLY_PATCH and restored["tools"][0]["name"] == "exec_command"


@pytest.mark.parametrize("tool,param,words", [
    ({"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "regex",
                                                "definition": "(?=a)b"}}, "tools[1].format.definition", "Lookahead"),
    ({"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark",
                                                "definition": "start: ("}}, "tools[1].format.definition", "does not compile"),
    ({"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "ebnf",
                                                "definition": "x"}}, "tools[1].format.syntax", "lark"),
    ({"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark",
                                                "definition": 7}}, "tools[1].format.definition", "string"),
    ({"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark",
                                                "definition": "  "}}, "tools[1].format.definition", "non-empty"),
    ({"type": "custom", "name": "p", "format": {"type": "json"}}, "tools[1].format.type", "grammar"),
    ({"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "regex",
                                                "definition": "a" * 100_001}}, "tools[1].format.definition", "up to"),
    ({"type": "custom", "name": "p", "format": ["grammar"]}, "tools[1].format", "object"),
    ({"type": "custom", "name": 3, "format": {"type": "text"}}, "tools[1].name", "name"),
])
def test_a_grammar_this_server_cannot_take_is_a_400_naming_the_field(tool, param, words):
    with pytest.raises(AllowedToolsError) as caught:
        rewrite_request(body(EXEC, tool), "responses")
    error = caught.value
    assert error.status == 400 and error.param == param and error.code == CODE_INVALID_CUSTOM_TOOL
    assert words in error.message


def test_two_grammar_tools_of_one_name_are_refused():
    with pytest.raises(AllowedToolsError) as caught:
        read_custom_tools([APPLY_PATCH, dict(APPLY_PATCH)], "responses")
    assert caught.value.param == "tools[1].name"


def test_a_grammar_is_compiled_once_per_digest():
    first = read_custom_tools([APPLY_PATCH], "responses").grammar_for("apply_patch")
    again = read_custom_tools([copy.deepcopy(APPLY_PATCH)], "responses").grammar_for("apply_patch")
    assert first.digest == again.digest and first.ebnf is again.ebnf
    assert first.admits(PATCH) and not first.admits(PATCH.replace("+hi", "hi"))


# ------------------------------------------------------------------------------------ the guard

def _contract(request):
    rewritten = rewrite_request(request, "responses")
    return output_contract(rewritten, rewritten.request, "responses", strict_all=False)


def _response(*items):
    return {"object": "response", "status": "completed", "output": list(items)}


def _custom_call(name, text):
    return {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": name,
            "input": text, "status": "completed"}


@pytest.mark.parametrize("name,good,bad", [("apply_patch", PATCH, PATCH.replace("*** End Patch\n", "")),
                                           ("pin", "1234", "12a4")])
def test_unary_a_custom_input_its_grammar_does_not_admit_is_refused(name, good, bad):
    request = body(EXEC, APPLY_PATCH, DIGITS, FREE)
    contract, names = _contract(request), AllowedNames.from_request(request, "responses")
    check_responses_object(_response(_custom_call(name, good)), names, contract=contract)
    with pytest.raises(AllowedToolsViolation) as caught:
        check_responses_object(_response(_custom_call(name, bad)), names, contract=contract)
    assert caught.value.reason == "custom_input_invalid" and caught.value.kind == "custom"
    assert name in caught.value.message
    assert counted_reason("custom_input_invalid", lambda: check_responses_object(
        _response(_custom_call(name, bad)), names, contract=contract)) == 1


def counted_reason(reason, refused) -> int:
    """How many more backstop refusals ``reason`` counts after ``refused()`` raised once."""
    from vllm_allowed_tools import metrics
    before = dict(metrics.snapshot()["backstops"]).get(reason, 0)
    with pytest.raises(AllowedToolsViolation):
        refused()
    return dict(metrics.snapshot()["backstops"]).get(reason, 0) - before


def test_a_free_form_custom_tool_takes_any_input():
    request = body(EXEC, FREE)
    for text in ("anything at all", "", "{not json", "<tool_call>"):
        answer = _response(_custom_call("note", text))
        assert check_responses_object(answer, AllowedNames.from_request(request, "responses"),
                                      contract=_contract(request)) is False   # out as it is
        assert answer["output"][0]["input"] == text


def _stream(text):
    item = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "pin", "input": ""}
    done = dict(item, input=text, status="completed")
    response = {"object": "response", "id": "resp_1", "status": "in_progress", "output": []}
    events = [{"type": "response.created", "response": response},
              {"type": "response.output_item.added", "output_index": 0, "item": item},
              {"type": "response.custom_tool_call_input.delta", "output_index": 0, "item_id": "ctc_1",
               "delta": text},
              {"type": "response.custom_tool_call_input.done", "output_index": 0, "item_id": "ctc_1",
               "input": text},
              {"type": "response.output_item.done", "output_index": 0, "item": done},
              {"type": "response.completed", "response": dict(response, status="completed", output=[done])}]
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return events


def test_streamed_a_custom_input_its_grammar_does_not_admit_fails_before_the_call_completes():
    request = body(EXEC, DIGITS)
    names, contract = AllowedNames.from_request(request, "responses"), _contract(request)
    fine = run_guard(ResponsesStreamGuard(names, contract=contract), _stream("2024"))
    assert [e["type"] for e in fine][-1] == "response.completed"
    guard = ResponsesStreamGuard(names, contract=contract)
    out = run_guard(guard, _stream("20x4"))
    kinds = [e["type"] for e in out]
    assert kinds[-1] == "response.failed" and "response.custom_tool_call_input.done" not in kinds
    assert guard.violation.reason == "custom_input_invalid"
    assert "custom_input_invalid" in out[-1]["response"]["error"]["message"]


# ------------------------------------------------------------------- allowed_tools over custom tools

def select(mode, *entries):
    return {"type": "allowed_tools", "mode": mode, "tools": list(entries)}


def custom(name):
    return {"type": "custom", "name": name}


def function(name):
    return {"type": "function", "name": name}


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_selects_custom_tools_as_custom_tools_only(mode):
    request = body(EXEC, APPLY_PATCH, DIGITS, FREE, tool_choice=select(mode, custom("apply_patch"), custom("note")))
    rewritten = rewrite_request(request, "responses")
    turn = rewritten.allowlist
    assert turn.mode == mode and turn.allowed_flat_names == ("apply_patch", "note")
    assert turn.allows("custom", "apply_patch") and turn.allows("custom", "note")
    assert not turn.allows("custom", "pin") and not turn.allows("function", "exec_command")
    assert not turn.allows("function", "apply_patch")   # a custom tool's name is no function's
    assert turn.knows("custom", "pin") and not turn.knows("function", "pin")
    # what the parsers see: the names, and each custom tool's grammar (None: free text)
    wire = rewritten.body["vllm_allowed_tools"]
    assert wire["allowed"] == ["apply_patch", "note"]
    assert wire["custom"] == {"apply_patch": ["lark", PATCH_GRAMMAR], "pin": ["regex", "[0-9]{4}"], "note": None}
    assert rewritten.body["tool_choice"] == mode
    assert rewritten.body["chat_template_kwargs"]["allowed_tools_policy"]["names"] == ["apply_patch", "note"]
    from vllm_allowed_tools.wire import WireAllowlist
    parsed = WireAllowlist.from_wire(wire)
    assert parsed.allows("custom", "apply_patch") and not parsed.allows("function", "apply_patch")
    assert not parsed.allows("custom", "pin") and parsed.knows("custom", "pin")


def test_functions_and_custom_tools_are_selected_together():
    request = body(EXEC, APPLY_PATCH, tool_choice=select("required", function("exec_command"), custom("apply_patch")))
    turn = rewrite_request(request, "responses").allowlist
    assert turn.allows("function", "exec_command") and turn.allows("custom", "apply_patch")


def test_the_catalog_digest_binds_a_custom_tools_grammar():
    def digest(tool):
        return rewrite_request(body(EXEC, tool, tool_choice=select("auto", custom(tool["name"]))),
                               "responses").allowlist.catalog_digest
    other = {**APPLY_PATCH, "format": {**APPLY_PATCH["format"], "definition": PATCH_GRAMMAR + "\n"}}
    assert len({digest(APPLY_PATCH), digest(other), digest({**APPLY_PATCH, "format": {"type": "text"}})}) == 3


@pytest.mark.parametrize("entries,param,reason,words", [
    ([function("exec_command"), custom("exec_command")], "tool_choice.tools[1].name", "tool_type_mismatch",
     "is a function tool, not a custom tool"),
    ([function("apply_patch")], "tool_choice.tools[0].name", "tool_type_mismatch",
     'select it as {"type": "custom", "name": "apply_patch"}'),
    ([custom("aply_patch")], "tool_choice.tools[0].name", "unknown_function", "Did you mean 'apply_patch'?"),
    ([custom("")], "tool_choice.tools[0].name", "malformed", "custom tool"),
])
def test_a_custom_selector_that_names_no_custom_tool_is_a_400_naming_it(entries, param, reason, words):
    from vllm_allowed_tools.errors import InvalidSelectionError
    with pytest.raises(InvalidSelectionError) as caught:
        rewrite_request(body(EXEC, APPLY_PATCH, tool_choice=select("required", *entries)), "responses")
    assert (caught.value.status, caught.value.param, caught.value.reason) == (400, param, reason)
    assert words in caught.value.message


def test_a_custom_tool_and_a_function_of_one_name_are_refused_as_ambiguous():
    from vllm_allowed_tools.errors import InvalidSelectionError
    twin = {**APPLY_PATCH, "name": "exec_command"}
    with pytest.raises(InvalidSelectionError) as caught:
        rewrite_request(body(EXEC, twin, tool_choice=select("auto", custom("exec_command"))), "responses")
    assert caught.value.reason == "ambiguous_name" and caught.value.param == "tools[1].name"
    assert "custom tool 'exec_command'" in caught.value.message


def test_a_named_custom_choice_allows_that_custom_tool_only():
    turn = rewrite_request(body(EXEC, APPLY_PATCH, DIGITS, tool_choice=custom("pin")), "responses").allowlist
    assert turn.choice == "named" and turn.allowed_flat_names == ("pin",)
    assert turn.allows("custom", "pin") and not turn.allows("custom", "apply_patch")
    assert turn.internal_tool_choice() == custom("pin")   # vLLM decodes it as it decodes named choices


def test_the_guard_lets_out_exactly_the_selected_custom_tools():
    request = body(EXEC, APPLY_PATCH, DIGITS, tool_choice=select("required", custom("pin")))
    rewritten = rewrite_request(request, "responses")
    contract = output_contract(rewritten, rewritten.request, "responses", strict_all=False)
    check_responses_object(_response(_custom_call("pin", "2024")), rewritten.allowlist, contract=contract)
    with pytest.raises(AllowedToolsViolation) as caught:
        check_responses_object(_response(_custom_call("apply_patch", PATCH)), rewritten.allowlist,
                               contract=contract)
    assert caught.value.kind == "custom"
    with pytest.raises(AllowedToolsViolation) as caught:   # selected, but the input is not the grammar's
        check_responses_object(_response(_custom_call("pin", "20x4")), rewritten.allowlist, contract=contract)
    assert caught.value.reason == "custom_input_invalid"
    guard = ResponsesStreamGuard(rewritten.allowlist, contract=contract)
    assert [e["type"] for e in run_guard(guard, _stream("2024"))][-1] == "response.completed"
