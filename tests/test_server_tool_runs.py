"""Server-side calls as agents meet them, the pure parts: a call is decided only when complete (the
harmony grammar ends it with ``<|call|>``, the hook reads how the generation ended and whether the
arguments parse), a call that fails is a failed item, a function is rendered next to a built-in
``mcp`` tool. The end-to-end checks are in ``test_server_tools_e2e.py``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_allowed_tools import metrics
from vllm_allowed_tools.response import ResponsesStream
from vllm_allowed_tools.server_tools import read_server_tools
from vllm_allowed_tools.server_tools.response import ServerToolStream, apply_to_response
from vllm_allowed_tools.server_tools.runs import (
    failure_text,
    incomplete_reason,
    note_end,
    tool_error,
    watching_errors,
)
from vllm_allowed_tools.server_tools.server_turn import ServerTurn
from vllm_allowed_tools.vllm_glue.harmony_tools import stop_tokens_for_grammar

CALL, RETURN, END_OF_TEXT = 200012, 200002, 199999
ARGS = [90, 92]   # any tokens


def ended(*chunks: list[int], finish_reason: str = "stop", flushed: bool = False) -> SimpleNamespace:
    """A HarmonyContext after a generation that streamed ``chunks`` (the last one finished)."""
    context = SimpleNamespace(last_append_flush_status=False)
    for n, ids in enumerate(chunks):
        last = n == len(chunks) - 1
        context.last_append_flush_status = flushed and last
        note_end(context, SimpleNamespace(finished=last, outputs=[SimpleNamespace(
            token_ids=ids, finish_reason=finish_reason if last else None, stop_reason=None)]))
    return context


CONTAINER_CALL = SimpleNamespace(recipient="container.ls")


def test_a_call_is_complete_only_when_it_ended_with_call_and_its_arguments_parse():
    assert incomplete_reason(ended([*ARGS, CALL]), CONTAINER_CALL, '{"cmd": "ls"}') is None
    # the stop token the grammar admits after <|call|> (the call token is a grammar token there)
    assert incomplete_reason(ended([*ARGS, CALL, RETURN]), CONTAINER_CALL, "{}") is None
    assert incomplete_reason(ended(ARGS, [CALL], [RETURN]), CONTAINER_CALL, "{}") is None   # streamed
    assert incomplete_reason(ended([*ARGS, RETURN]), CONTAINER_CALL, "{}")[0] == "not_called"
    assert incomplete_reason(ended([*ARGS, END_OF_TEXT]), CONTAINER_CALL, "{}")[0] == "not_called"
    cut = ended(ARGS, finish_reason="length", flushed=True)
    assert incomplete_reason(cut, CONTAINER_CALL, '{"cmd": "l')[0] == "cut_off"
    assert incomplete_reason(ended([*ARGS, CALL]), CONTAINER_CALL, '{"text": "ab')[0] == "not_json"
    assert incomplete_reason(ended([*ARGS, CALL]), CONTAINER_CALL, "[1]")[0] == "not_json"
    # python's arguments are its code
    assert incomplete_reason(ended([*ARGS, CALL]), SimpleNamespace(recipient="python"), "x(") is None
    assert incomplete_reason(SimpleNamespace(), CONTAINER_CALL, "{}")[0] == "cut_off"   # never ended


@given(st.lists(st.integers(0, 201087), max_size=40), st.sampled_from(["stop", "length"]))
def test_only_a_generation_whose_last_content_token_is_call_is_complete(ids, finish_reason):
    reason = incomplete_reason(ended(ids, finish_reason=finish_reason), CONTAINER_CALL, "{}")
    content = [t for t in ids if t not in (RETURN, END_OF_TEXT)]
    assert (reason is None) == (bool(content) and content[-1] == CALL)


@given(st.sets(st.integers(0, 201087), max_size=6), st.sets(st.integers(0, 201087), max_size=6))
def test_a_grammars_own_tokens_leave_its_stop_tokens(stops, named):
    grammar = json.dumps({"type": "sequence", "elements": [{"type": "token", "token": t}
                                                           for t in sorted(named)]})
    assert stop_tokens_for_grammar(stops, grammar) == stops - named
    assert stop_tokens_for_grammar(stops, None) == stops


def test_a_failure_names_the_innermost_error():
    group = ExceptionGroup("unhandled errors in a TaskGroup",
                           [ExceptionGroup("inner", [ConnectionError("Connection closed")])])
    assert failure_text(group) == "This tool call failed: ConnectionError: Connection closed"
    assert failure_text(ValueError()).endswith("ValueError: no detail")
    assert tool_error(SimpleNamespace(is_error=True)) and tool_error(SimpleNamespace(isError=True))
    assert not tool_error(SimpleNamespace(is_error=False))


def test_the_replies_of_one_call_are_watched_and_the_session_left_as_it_was():
    class Session:
        async def call_tool(self, name, args):
            return SimpleNamespace(is_error=name == "fail")

    session = Session()
    context = SimpleNamespace(_tool_sessions={"container": session})

    async def run():
        with watching_errors(context, "container") as replies:
            await session.call_tool("fail", {})
        return replies
    replies = asyncio.run(run())
    assert [tool_error(r) for r in replies] == [True]
    assert "call_tool" not in vars(session)
    with watching_errors(SimpleNamespace(), "browser") as nothing:   # no session: nothing watched
        assert nothing == []


def _turn(tools: list) -> ServerTurn:
    return ServerTurn(read_server_tools({"tools": tools}), selection=None)


def _mcp_item(name: str = "note", **extra) -> dict:
    return {"type": "mcp_call", "id": "mcp_1", "name": name, "server_label": "container",
            "arguments": '{"text": "ab', "status": "completed", **extra}


def test_a_call_not_run_and_a_call_that_failed_show_as_such():
    turn = _turn([{"type": "mcp", "server_label": "container", "require_approval": "never"}])
    turn.incomplete("container.note", '{"text": "ab', "the call was cut off by the token limit")
    (item,) = apply_to_response(turn, {"output": [_mcp_item()]})["output"]
    assert item["status"] == "incomplete" and "cut off" in item["error"]["content"][0]["text"]
    assert turn.incomplete("functions.f", "{}", "x") is None   # vLLM runs nothing for it

    failed = _turn([{"type": "mcp", "server_label": "container", "require_approval": "never"}])
    decision = failed.decide("container.ls", "{}", message := object())
    failed.authorize(message, "container.ls", "{}")
    failed.record(decision, None, "This tool call failed: MCPError: Connection closed")
    (item,) = apply_to_response(failed, {"output": [_mcp_item("ls", arguments="{}")]})["output"]
    assert item["status"] == "failed" and "Connection closed" in item["error"]["content"][0]["text"]
    assert "output" not in item


def _cut_off_count() -> int:
    return metrics.snapshot().get("server_tool_failures", {}).get("cut_off", 0)


def test_a_call_the_loop_never_asked_about_is_never_shown_as_completed():
    """The generation ended inside the call (harmony's parser never completed it as a message, so
    vLLM's loop never asked to run it): its item is ``incomplete``, counted once, never run."""
    turn = _turn([{"type": "mcp", "server_label": "container", "require_approval": "never"}])
    before = _cut_off_count()
    cut = {"output": [_mcp_item()], "status": "incomplete",
           "incomplete_details": {"reason": "max_output_tokens"}}
    (item,) = apply_to_response(turn, cut)["output"]
    assert item["status"] == "incomplete" and "output" not in item
    assert "cut off by the token limit" in item["error"]["content"][0]["text"]
    assert _cut_off_count() == before + 1
    (item,) = apply_to_response(turn, {"output": [_mcp_item()]})["output"]
    assert item["status"] == "incomplete" and "did not finish" in item["error"]["content"][0]["text"]

    stream = ResponsesStream()
    ServerToolStream(turn, stream)
    before = _cut_off_count()
    sent = [e for event in [{"type": "response.created", "response": {"output": []}},
                            *_events(_mcp_item(), 0),
                            {"type": "response.incomplete", "response": cut}]
            for e in stream.feed(event)]
    done = next(e["item"] for e in sent if e["type"] == "response.output_item.done")
    assert done["status"] == "incomplete" and "cut off" in done["error"]["content"][0]["text"]
    assert "response.mcp_call.failed" in [e["type"] for e in sent]
    assert "response.mcp_call.completed" not in [e["type"] for e in sent]
    (final,) = sent[-1]["response"]["output"]
    assert sent[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert _cut_off_count() == before + 1   # the terminal snapshot does not count it again


def _events(item: dict, index: int = 1) -> list[dict]:
    return [{"type": "response.output_item.added", "output_index": index,
             "item": {**item, "status": "in_progress"}},
            {"type": "response.mcp_call.completed", "output_index": index, "item_id": item["id"]},
            {"type": "response.output_item.done", "output_index": index, "item": item}]


def test_the_stream_ends_a_failed_call_with_failed_and_shows_a_browser_call_once():
    turn = _turn([{"type": "mcp", "server_label": "container", "require_approval": "never"},
                  {"type": "web_search_preview"}])
    stream = ResponsesStream()
    ServerToolStream(turn, stream)
    twin = {"type": "mcp_call", "id": "mcp_2", "name": "browser.search",
            "server_label": "browser.search", "arguments": "{}", "status": "completed"}
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "vllm"}}
    upstream = [{"type": "response.created", "response": {"output": []}},
                *_events(_mcp_item("ls", arguments="{}"), 0)]
    sent = [e for event in upstream for e in stream.feed(event)]
    decision = turn.decide("container.ls", "{}", message := object())
    turn.authorize(message, "container.ls", "{}")
    turn.record(decision, None, "This tool call failed: RuntimeError: boom")
    for event in [*_events(twin), {"type": "response.output_item.added", "output_index": 1,
                                   "item": {**search, "status": "in_progress"}},
                  {"type": "response.output_item.done", "output_index": 1, "item": search}]:
        sent += stream.feed(event)
    turn.decide("browser.search", "{}", second := object())
    turn.authorize(second, "browser.search", "{}")
    turn.record(turn.decisions[-1], "results")
    sent += stream.feed({"type": "response.completed", "response": {"output": []}})
    kinds = [(e["type"], (e.get("item") or {}).get("type")) for e in sent]
    assert ("response.mcp_call.failed", None) in kinds and ("response.mcp_call.completed", None) \
        not in kinds, kinds
    assert [k for k in kinds if k[1] == "mcp_call"] == [("response.output_item.added", "mcp_call"),
                                                        ("response.output_item.done", "mcp_call")]
    assert ("response.output_item.done", "web_search_call") in kinds, kinds


def test_a_function_is_rendered_next_to_a_built_in_mcp_tool(monkeypatch):
    from vllm.entrypoints.openai.parser import harmony_utils

    from vllm_allowed_tools.vllm_glue.harmony_tools import _without_builtin_mcp
    from openai.types.responses import FunctionTool
    from openai.types.responses.tool import Mcp
    monkeypatch.setenv("VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS", "container")
    function = FunctionTool(type="function", name="get_weather", strict=False,
                            parameters={"type": "object", "properties": {}})
    builtin = Mcp(type="mcp", server_label="container")
    other = Mcp(type="mcp", server_label="github", server_url="http://x")
    original = harmony_utils.get_developer_message
    original = getattr(original, "__wrapped__", original)
    with pytest.raises(Exception, match="tool type 'mcp' is not supported"):
        original(tools=[function, builtin])                   # vLLM's own
    wrapped = _without_builtin_mcp(original)
    rendered = harmony_utils.get_encoding().decode(harmony_utils.get_encoding().render(
        wrapped(tools=[function, builtin])))
    assert "get_weather" in rendered and "container" not in rendered
    with pytest.raises(Exception, match="tool type 'mcp' is not supported"):
        wrapped(tools=[function, other])                      # vLLM runs no such tool


def test_a_server_side_grammar_stops_only_at_call_and_the_engine_keeps_it_so():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_allowed_tools.vllm_glue.harmony_tools import _grammar_stop_tokens
    update = _grammar_stop_tokens(SamplingParams.update_from_generation_config)
    tag = json.dumps({"type": "token", "token": CALL})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=tag))
    update(params, {"eos_token_id": [RETURN, END_OF_TEXT, CALL]}, RETURN)
    received = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    assert CALL not in received.all_stop_token_ids and CALL not in received.stop_token_ids
    assert {RETURN, END_OF_TEXT} <= received.all_stop_token_ids
    plain = SamplingParams()
    update(plain, {"eos_token_id": [RETURN, END_OF_TEXT, CALL]}, RETURN)
    assert CALL in plain.all_stop_token_ids


#: o200k_harmony's marker ids (a raw vocabulary of its size: the markers at their ids, printable
#: characters as single tokens, the rest unused)
MARKERS = {200002: "<|return|>", 200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
           200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>", 199999: "<|endoftext|>"}


@pytest.fixture(scope="module")
def harmony_matcher():
    import string

    import xgrammar as xgr
    vocab = [f"<unused{i}>" for i in range(201088)]
    vocab[:len(string.printable)] = list(string.printable)
    for token, text in MARKERS.items():
        vocab[token] = text
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW,
                                                     vocab_size=len(vocab)))

    def matcher(tag_json: str):
        stops = sorted(stop_tokens_for_grammar({RETURN, END_OF_TEXT, CALL}, tag_json))
        return xgr.GrammarMatcher(compiler.compile_structural_tag(tag_json),
                                  override_stop_tokens=stops)

    def encode(text: str) -> list[int]:
        return [string.printable.index(c) for c in text]
    return matcher, encode


@pytest.mark.parametrize("with_function", [False, True], ids=["server-only", "with-a-function"])
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_every_call_of_a_server_side_turn_ends_with_call(harmony_matcher, mode, with_function):
    import vllm.parser.harmony  # noqa: F401 - registers vLLM's harmony tag, as serving does

    from vllm_allowed_tools.decode.grammar import AllowedFunction, turn_tag
    from vllm_allowed_tools.decode.server_recipients import with_server_calls
    function_tag = turn_tag("openai", [AllowedFunction("get_weather", {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]})],
        catalog_digest="c", allowlist_digest=f"a-{mode}", mode=mode, parallel_tool_calls=False,
        max_whitespace=1).tag.model_copy(deep=True) if with_function else None
    schemas = {"ls": {"type": "object", "properties": {"cmd": {"enum": ["ls"]}}, "required": ["cmd"]}}
    tag = with_server_calls(function_tag, [("container", "ls")], mode, 1,
                            lambda builtin: schemas if builtin == "container" else None)
    calls = [("commentary to=container.ls ", '{"cmd": "ls"}')]
    if with_function:
        calls.append(("commentary to=functions.get_weather ", '{"city": "Paris"}'))
    new_matcher, encode = harmony_matcher
    for header, arguments in calls:
        matcher = new_matcher(json.dumps(tag.model_dump()))
        ids = [200005, *encode(header), 200003, *encode("json"), 200008, *encode(arguments)]
        assert all(matcher.accept_token(t) for t in ids), header
        assert not matcher.accept_token(RETURN) and not matcher.accept_token(END_OF_TEXT), header
        assert matcher.accept_token(CALL) and matcher.accept_token(RETURN), header

