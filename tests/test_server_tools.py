"""Server-side tools, the pure parts: reading the request's tools and selection, require_approval,
the per-turn decision and its backstop, mapping answers, rewriting responses; and the recipient
mapping checked against vLLM's own dispatch (``HarmonyContext.call_tool``) on arbitrary
recipients."""

from __future__ import annotations

import asyncio
import inspect
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.approvals import ApprovalEngine
from vllm_allowed_tools.approvals.policy import ApprovalPolicy
from vllm_allowed_tools.approvals.store import SQLiteGrantStore
from vllm_allowed_tools.errors import AllowedToolsError
from vllm_allowed_tools.response import ResponsesStream
from vllm_allowed_tools.response.violations import AllowedToolsViolation
from vllm_allowed_tools.server_tools import read_server_tools, recipient_target
from vllm_allowed_tools.server_tools.request import prepare_server_turn, split_selection
from vllm_allowed_tools.server_tools.response import ServerToolStream, apply_to_response
from vllm_allowed_tools.server_tools.tools import read_require_approval
from vllm_allowed_tools.server_tools.server_turn import HookStatus, ServerTurnFilter

MCP = {"type": "mcp", "server_label": "container", "require_approval": "never"}
ON = HookStatus(True, "test")


def body(tools=None, choice=None, **extra):
    out = {"model": "m", "input": [{"role": "user", "content": "hi"}], "tools": tools or [MCP]}
    if choice is not None:
        out["tool_choice"] = choice
    return {**out, **extra}


def select(*entries, mode="required"):
    return {"type": "allowed_tools", "mode": mode, "tools": list(entries)}


# ---------------------------------------------------------------------------- reading


@pytest.mark.parametrize("value, param", [
    (3, "tools[0].require_approval"), ("sometimes", "tools[0].require_approval"),
    ({"always": {"tool_names": "ls"}}, "tools[0].require_approval.always.tool_names"),
    ({"never": {"read_only": "yes"}}, "tools[0].require_approval.never.read_only"),
    ({"maybe": {}}, "tools[0].require_approval.maybe"),
    ({"always": []}, "tools[0].require_approval.always"),
])
def test_a_malformed_require_approval_is_a_400_naming_it(value, param):
    with pytest.raises(AllowedToolsError) as caught:
        read_server_tools({"tools": [{**MCP, "require_approval": value}]})
    assert caught.value.status == 400 and caught.value.param == param


def test_an_mcp_tool_needs_a_server_label():
    for label in (None, "", 5):
        with pytest.raises(AllowedToolsError) as caught:
            read_server_tools({"tools": [{"type": "mcp", "server_label": label}]})
        assert caught.value.param == "tools[0].server_label"


def test_require_approval_reads_as_openai_documents_it_and_fails_closed():
    assert read_require_approval(None, "p").gates("x")          # absent: always
    assert not read_require_approval("never", "p").gates("x")
    filters = read_require_approval({"never": {"tool_names": ["ls"]},
                                     "always": {"tool_names": ["rm"]}}, "p")
    assert not filters.gates("ls") and filters.gates("rm") and filters.gates("other")
    # a read_only condition never exempts a tool (the server's annotations are not read)
    assert read_require_approval({"never": {"read_only": True}}, "p").gates("ls")
    assert read_require_approval({"always": {"read_only": True}}, "p").gates("ls")


def test_which_tools_are_server_side():
    tools = read_server_tools({"tools": [
        {"type": "function", "name": "f"}, {"type": "mcp", "server_label": "elsewhere"},
        MCP, {"type": "code_interpreter"}, {"type": "web_search_preview"},
        {"type": "mcp", "server_label": "code_interpreter"}]})
    assert [(t.index, t.builtin) for t in tools.tools] == [
        (2, "container"), (3, "python"), (4, "browser"), (5, "python")]


@pytest.mark.parametrize("recipient, expected", [
    ("container.exec", ("container", "exec")), ("container.exec json", ("container", "exec")),
    ("python", ("python", "python")), ("python.run", ("python", "python")),
    ("pythonic", ("python", "python")), ("browser.search", ("browser", "search")),
    ("browser.open.x", ("browser", "open")), ("functions.container", None), ("container", None),
    ("browser", None), (None, None),
])
def test_recipients_map_to_what_vllm_dispatches(recipient, expected):
    target = recipient_target(recipient)
    assert (None if target is None else (target.builtin, target.tool_name)) == expected


class _Session:
    def __init__(self, log, builtin):
        self.log, self.builtin = log, builtin

    async def call_tool(self, name, args):
        self.log.append((self.builtin, name))
        return SimpleNamespace(content=[SimpleNamespace(text="ok")])


def _vllm_dispatch(recipient: str):
    """What vLLM's own HarmonyContext runs for ``recipient`` (its need and call methods, with
    recording sessions), or None when it runs nothing."""
    from openai_harmony import Author, Message, Role, TextContent
    from vllm.entrypoints.openai.responses.context import HarmonyContext

    context = object.__new__(HarmonyContext)
    log: list = []
    message = Message(author=Author(role=Role.ASSISTANT), content=[TextContent(text="{}")],
                      recipient=recipient, channel="commentary")
    context._messages = [message]
    context.available_tools = ["browser", "python", "container"]
    context._tool_sessions = {b: _Session(log, b) for b in context.available_tools}
    context.called_tools = set()
    # vLLM's own methods, also where another test of this process installed the hook over them
    need = inspect.unwrap(HarmonyContext.need_builtin_tool_call)
    call = inspect.unwrap(HarmonyContext.call_tool)
    if not need(context):
        return None
    asyncio.run(call(context))
    return log[0] if log else None


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(alphabet="abcdefghnoprtyx. _-/", max_size=24),
    st.sampled_from(["python", "python.x", "container.", "container.exec", "browser.",
                     "browser.search", "browser.find x", "container.ls json", "pythonx.y"])
    .flatmap(lambda s: st.text(alphabet=". x", max_size=4).map(lambda t: s + t))))
def test_the_decision_reads_every_recipient_as_vllms_dispatch_does(recipient):
    try:
        expected = _vllm_dispatch(recipient)
    except (IndexError, KeyError):
        expected = "crash"   # vLLM itself fails on it (e.g. "browser." with no tool): runs nothing
    target = recipient_target(recipient)
    if expected in (None, "crash"):
        assert target is None or expected == "crash"
    else:
        assert target is not None and (target.builtin, target.tool_name) == expected


# ---------------------------------------------------------------------------- selection


def test_selection_takes_out_server_entries_and_keeps_functions():
    tools = read_server_tools(body())
    new, selection, only = split_selection(body(choice=select(
        {"type": "mcp", "server_label": "container", "name": "ls"})), tools)
    assert only and new["tool_choice"] == "auto" and selection.entries == {(0, "ls")}
    assert selection.recipients(tools) == [("container", "ls")]


@pytest.mark.parametrize("entry, param", [
    ({"type": "mcp"}, "tool_choice.tools[0].server_label"),
    ({"type": "mcp", "server_label": 3}, "tool_choice.tools[0].server_label"),
    ({"type": "mcp", "server_label": "other"}, "tool_choice.tools[0].server_label"),
    ({"type": "mcp", "server_label": "container", "name": 7}, "tool_choice.tools[0].name"),
    ({"type": "mcp", "server_label": "container", "names": ["x"]}, "tool_choice.tools[0].names"),
    ({"type": "code_interpreter"}, "tool_choice.tools[0]"),
])
def test_a_malformed_server_selection_is_a_400_naming_it(entry, param):
    with pytest.raises(AllowedToolsError) as caught:
        split_selection(body(choice=select(entry)), read_server_tools(body()))
    assert caught.value.status == 400 and caught.value.param == param


def test_an_mcp_tools_own_allowed_tools_limits_the_selection():
    tools = read_server_tools(body([{**MCP, "allowed_tools": ["ls"]}]))
    with pytest.raises(AllowedToolsError) as caught:
        split_selection(body(choice=select({"type": "mcp", "server_label": "container",
                                            "name": "exec"})), tools)
    assert caught.value.param == "tool_choice.tools[0].name"


# ---------------------------------------------------------------------------- refusals


def test_server_tools_under_a_policy_are_refused_where_the_hook_cannot_decide():
    data = body([{**MCP, "require_approval": "always"}])
    tools = read_server_tools(data)
    for harmony, hook, code in ((False, ON, "server_tools_unguarded"),
                                (True, HookStatus(False, "vLLM 9: missing"), "server_tools_unguarded")):
        with pytest.raises(AllowedToolsError) as caught:
            prepare_server_turn(data, tools, engine=object(), headers=[], harmony=harmony,
                                hook=hook, operator_engine=False)
        assert caught.value.code == code and caught.value.param == "tools[0]"


def test_require_approval_that_cannot_be_honoured_is_a_400():
    data = body([{**MCP, "require_approval": "always"}])
    with pytest.raises(AllowedToolsError) as caught:
        prepare_server_turn(data, read_server_tools(data), engine=None, headers=[], harmony=True,
                            hook=ON, operator_engine=False)
    assert caught.value.param == "tools[0].require_approval"


def test_no_policy_no_require_approval_passes_even_off_the_harmony_path():
    data = body()
    prepared = prepare_server_turn(data, read_server_tools(data), engine=None, headers=[],
                                   harmony=False, hook=HookStatus(False), operator_engine=False)
    assert prepared is not None and prepared.selection is None


# ---------------------------------------------------------------------------- decisions


@pytest.fixture
def engine(tmp_path):
    policy = ApprovalPolicy.from_mapping({"rules": [
        {"tools": ["container__exec"], "approval": "required", "scopes": ["once"]}]})
    return ApprovalEngine(policy, SQLiteGrantStore(tmp_path / "g.db"))


def turn_for(data, engine, headers=()):
    prepared = prepare_server_turn(data, read_server_tools(data), engine=engine,
                                   headers=list(headers), harmony=True, hook=ON,
                                   operator_engine=True)
    return prepared


def test_decisions_follow_the_allowlist_the_client_and_the_operator(engine):
    turn = turn_for(body(choice=select({"type": "mcp", "server_label": "container",
                                        "name": "ls"})), engine).turn
    assert turn.decide("container.ls", '{"cmd": "ls"}').verdict == "execute"
    assert turn.decide("container.exec", "{}").verdict == "refuse"     # outside allowed_tools
    assert turn.decide("python", "1") .verdict == "refuse"             # not offered
    assert turn.decide("functions.f", "{}") is None                    # vLLM runs nothing
    free = turn_for(body(), engine).turn
    paused = free.decide("container.exec", '{"cmd": "ls"}')
    assert paused.verdict == "pause" and paused.wire == "elicitation"  # the operator's rule
    asked = turn_for(body([{**MCP, "require_approval": "always"}]), engine).turn
    paused = asked.decide("container.ls", "{}")
    assert paused.verdict == "pause" and paused.wire == "mcp"          # the client's setting
    none = turn_for(body(choice="none"), engine).turn
    assert none.decide("container.ls", "{}").verdict == "refuse"


def test_the_backstop_runs_only_what_was_decided_once(engine):
    turn = turn_for(body(), engine).turn
    message, other = object(), object()
    decision = turn.decide("container.ls", "{}", message)
    assert turn.authorize(other, "container.ls", "{}") is None          # undecided
    assert turn.authorize(message, "container.ls", '{"x":1}') is None   # changed since
    assert turn.authorize(message, "container.ls", "{}") is decision
    assert turn.authorize(message, "container.ls", "{}") is None        # only once
    gated = object()
    turn.decide("container.exec", "{}", gated)
    assert turn.authorize(gated, "container.exec", "{}") is None        # paused: never runs


def test_max_tool_calls_stops_the_loop(engine):
    turn = turn_for(body(max_tool_calls=1), engine).turn
    assert turn.decide("container.ls", "{}").verdict == "execute"
    assert turn.decide("container.ls", "{}").verdict == "stop"


def test_the_servers_bound_caps_a_response_and_a_request_can_only_lower_it(engine, monkeypatch):
    from vllm_allowed_tools import settings as settings_module
    monkeypatch.setenv("VLLM_ALLOWED_TOOLS_MAX_SERVER_TOOL_CALLS", "2")
    settings_module.reset_for_tests()
    for limit, runs in ((None, 2), (1, 1), (5, 2)):
        turn = turn_for(body(max_tool_calls=limit) if limit is not None else body(), engine).turn
        verdicts = [turn.decide("container.ls", "{}").verdict for _ in range(3)]
        assert verdicts == ["execute"] * runs + ["stop"] * (3 - runs), (limit, verdicts)


@pytest.mark.parametrize("stage", ["native", "logits-processor"])
def test_a_required_turn_is_required_once_in_vllms_loop(stage):
    """After a call ran, the SamplingParams vLLM's loop reuses carry the turn's auto grammar."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_allowed_tools.decode.stage import tag_digest
    from vllm_allowed_tools.wire import XARGS_DIGEST, XARGS_TAG
    from vllm_allowed_tools.vllm_glue.server_tool_hook import _relax_after_a_call

    turn = SimpleNamespace(sampling_params=None, grammar_after_a_call='{"auto": 1}')
    params = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag='{"req": 1}')) \
        if stage == "native" else SamplingParams(extra_args={XARGS_TAG: '{"req": 1}', XARGS_DIGEST: "d"})
    _relax_after_a_call(turn)                       # no params known yet: nothing to change
    turn.sampling_params = params
    _relax_after_a_call(turn)
    if stage == "native":
        assert params.structured_outputs.structural_tag == '{"auto": 1}'
    else:
        assert params.extra_args == {XARGS_TAG: '{"auto": 1}', XARGS_DIGEST: tag_digest('{"auto": 1}')}
    assert turn.grammar_after_a_call is None        # once


def _answer(approval, approve, **extra):
    return [{"role": "user", "content": "hi"}, approval,
            {"type": "mcp_approval_response", "approval_request_id": approval["id"],
             "approve": approve, **extra}]


def test_an_accept_resumes_the_recorded_call_and_a_decline_refuses_it(engine):
    data = body([{**MCP, "require_approval": "always"}])
    headers = [(b"authorization", b"Bearer k")]
    paused = turn_for(data, engine, headers).turn.decide("container.ls", '{"cmd":"ls"}')
    approval = {"type": "mcp_approval_request", "id": paused.approval.id,
                "server_label": "container", "name": "ls", "arguments": '{"cmd":"ls"}'}
    accepted = turn_for({**data, "input": _answer(approval, True)}, engine, headers)
    assert accepted.body["input"] == [{"role": "user", "content": "hi"}]
    resume = accepted.turn.resume
    assert resume.refusal is None and resume.target.recipient == "container.ls"
    assert resume.arguments == '{"cmd":"ls"}' and resume.elicitation_id == approval["id"]
    again = turn_for({**data, "input": _answer(approval, True)}, engine, headers).turn.resume
    assert again == resume                                   # a retried accept: the same call
    with pytest.raises(AllowedToolsError):                   # another caller: nothing
        turn_for({**data, "input": _answer(approval, True)}, engine, [(b"authorization", b"Bearer z")])
    paused = turn_for(data, engine, headers).turn.decide("container.ls", '{"cmd":"pwd"}')
    approval = {**approval, "id": paused.approval.id}
    declined = turn_for({**data, "input": _answer(approval, False, reason="no")}, engine, headers)
    assert "declined" in declined.turn.resume.refusal and "no" in declined.turn.resume.refusal


@pytest.mark.parametrize("answer, param", [
    ({"approval_request_id": 3, "approve": True}, "input[1].approval_request_id"),
    ({"approval_request_id": "x", "approve": "true"}, "input[1].approve"),
    ({"approval_request_id": "x", "approve": False, "reason": 5}, "input[1].reason"),
])
def test_malformed_mcp_answers_are_a_400(engine, answer, param):
    data = body(input=[{"role": "user", "content": "hi"},
                       {"type": "mcp_approval_response", **answer}])
    with pytest.raises(AllowedToolsError) as caught:
        turn_for(data, engine)
    assert caught.value.param == param


def test_the_execution_is_claimed_once(engine):
    store = engine.store
    assert store.claim_execution("e1", recipient="container.ls", arguments_digest="d", now=1) is None
    earlier = store.claim_execution("e1", recipient="container.ls", arguments_digest="d", now=2)
    assert earlier is not None and earlier.output is None       # outcome unknown: never again
    store.finish_execution("e1", output="ran", now=3)
    assert store.claim_execution("e1", recipient="container.ls", arguments_digest="d",
                                 now=4).output == "ran"


# ---------------------------------------------------------------------------- responses


def _mcp_item(name="ls", arguments="{}"):
    return {"id": "mcp_1", "type": "mcp_call", "server_label": "container", "name": name,
            "arguments": arguments, "status": "completed"}


def test_the_unary_answer_shows_runs_pauses_and_refusals(engine):
    turn = turn_for(body([{**MCP, "require_approval": {"never": {"tool_names": ["ls"]}}}]),
                    engine).turn
    ran = turn.decide("container.ls", "{}", message := object())
    turn.authorize(message, "container.ls", "{}")
    turn.record(ran, "ls output")
    turn.decide("container.exec", '{"cmd":"x"}')
    response = apply_to_response(turn, {"output": [_mcp_item(), _mcp_item("exec", '{"cmd":"x"}')]})
    first, second = response["output"]
    assert first["output"] == "ls output"
    assert second["type"] == "mcp_approval_request" and second["name"] == "exec"   # by the client
    refused = turn_for(body(choice=select({"type": "mcp", "server_label": "container",
                                           "name": "ls"})), engine).turn
    refused.decide("container.exec", "{}")
    with pytest.raises(AllowedToolsViolation):
        apply_to_response(refused, {"output": [_mcp_item("exec")]})


def test_the_stream_holds_a_call_until_it_is_decided(engine):
    turn = turn_for(body([{**MCP, "require_approval": "always"}]), engine).turn
    stream = ResponsesStream()
    ServerToolStream(turn, stream)
    item = _mcp_item()
    events = [{"type": "response.created", "sequence_number": 0, "response": {"output": []}},
              {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
               "item": {**item, "status": "in_progress"}},
              {"type": "response.output_item.done", "sequence_number": 2, "output_index": 0,
               "item": item}]
    sent = [e for event in events for e in stream.feed(event)]
    assert [e["type"] for e in sent] == ["response.created"]            # held
    turn.decide("container.ls", "{}")                                   # the loop decides
    sent = stream.feed({"type": "response.completed", "sequence_number": 3,
                        "response": {"output": [item]}})
    kinds = [(e["type"], e.get("item", {}).get("type")) for e in sent]
    assert kinds == [("response.output_item.added", "mcp_approval_request"),
                     ("response.output_item.done", "mcp_approval_request"),
                     ("response.completed", None)], kinds
    assert sent[-1]["response"]["output"][0]["type"] == "mcp_approval_request"


def test_the_guards_filter_admits_only_the_allowed_server_items(engine):
    turn = turn_for(body(choice=select({"type": "mcp", "server_label": "container"})), engine).turn
    only_server = ServerTurnFilter(None, turn, functions=False)
    assert only_server.allows("builtin", "mcp_call")
    assert not only_server.allows("builtin", "web_search_call")
    assert not only_server.allows("function", "anything")
    assert json.dumps(sorted(only_server.item_types)) == '["mcp_call"]'


def test_a_selection_or_a_named_function_without_server_entries_allows_none(engine):
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    for choice in (select({"type": "function", "name": "f"}), {"type": "function", "name": "f"}):
        turn = turn_for(body([fn, MCP], choice=choice), engine).turn
        assert turn.decide("container.ls", "{}").verdict == "refuse"
    named = turn_for(body(choice={"type": "mcp", "server_label": "container", "name": "ls"}),
                     engine)
    assert named.only_server and named.turn.decide("container.ls", "{}").verdict == "execute"
    assert named.turn.decide("container.exec", "{}").verdict == "refuse"


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["always", "never", "tool_names",
                                                        "read_only", "x"]), inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.sampled_from(["ls", "exec", "rm"]))
def test_any_require_approval_is_read_or_refused_naming_it_and_never_widens(value, name):
    try:
        parsed = read_require_approval(value, "tools[0].require_approval")
    except AllowedToolsError as error:
        assert error.status == 400 and error.param.startswith("tools[0].require_approval")
        return
    if value != "never" and not (isinstance(value, dict) and isinstance(value.get("never"), dict)
                                 and name in (value["never"].get("tool_names") or [])
                                 and not (isinstance(value.get("always"), dict) and name in (
                                     value["always"].get("tool_names") or []))):
        assert parsed.gates(name), (value, name)   # only "never" or a never-list ever exempts


def test_the_server_side_items_and_events_are_checked_as_openai_shapes():
    from vllm_allowed_tools.response.conformance import check, check_event, conformed_event
    from vllm_allowed_tools.server_tools.response import mcp_error
    call = {**_mcp_item(), "output": "x", "approval_request_id": "elicit_1",
            "error": mcp_error("no")}
    assert check(call, "ItemField") == []
    assert check({"type": "mcp_approval_request", "id": "e", "server_label": "container",
                  "name": "ls", "arguments": "{}"}, "ItemField") == []
    assert check({**call, "error": "a string"}, "ItemField")              # OpenAI's shape only
    done = {"type": "response.mcp_call_arguments.done", "sequence_number": 3, "item_id": "mcp_1",
            "output_index": 0, "arguments": "{}", "name": "container.ls"}
    assert check_event(done) and check_event(conformed_event(done)) == []


@pytest.mark.parametrize("choice", [{"type": ["mcp"]}, {"type": {"mcp": 1}},
                                    {"type": "allowed_tools", "mode": "auto", "tools": [{"type": ["mcp"]}]}])
def test_a_type_that_is_no_string_is_no_server_side_entry(choice):
    """A list or object where a tool type goes is read as no server-side entry (never a TypeError,
    a 500): the selection's own check then refuses it naming the field."""
    tools = read_server_tools({"tools": [{"type": "mcp", "server_label": "container"}]})
    body, selection, only_server = split_selection({"tool_choice": choice, "tools": []}, tools)
    assert not only_server and (selection is None or not selection.entries)
    assert body["tool_choice"] == choice
