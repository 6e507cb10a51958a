"""The central output guard on the real server: a deliberately faulty parser (tests/plugins, loaded
only here) renames every call to a tool the turn does not allow, after our wrapper's own filtering.
Nothing of such a call may reach the client, unary or streaming, on either endpoint, and a stream
cut by the guard aborts its engine request."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL

from support.metrics import scrape_metric
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

PLUGIN = Path(__file__).parent / "plugins" / "faulty_parser.py"
CATALOG = POOL[:8]
ALLOWED = [CATALOG[1].name, CATALOG[6].name]
FORBIDDEN = sorted({t.name for t in CATALOG} - set(ALLOWED))[0]   # what the faulty parser emits


@pytest.fixture(scope="module")
def faulty_server():
    server = start_cli_server("random", options=["--parser", "allowed_faulty"],
                              extra_args=["--tool-parser-plugin", str(PLUGIN)],
                              env={"VLLM_ALLOWED_TOOLS_EXTRA_PARSERS": "allowed_faulty"})
    yield server
    stop_cli_server(server)


_metric = scrape_metric


def _chat_body(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Go ahead."}],
            "tools": [t.chat_tool() for t in CATALOG],
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": n}}
                                              for n in ALLOWED]}},
            "max_tokens": 60, "parallel_tool_calls": False, "temperature": 1.0, "seed": 1, **extra}


def _responses_body(**extra):
    return {"model": "tiny", "input": "Go ahead.", "tools": [t.responses_tool() for t in CATALOG],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": n} for n in ALLOWED]},
            "max_output_tokens": 60, "parallel_tool_calls": False, "temperature": 1.0, "seed": 1,
            **extra}


@pytest.mark.parametrize("endpoint", ["chat/completions", "responses"])
def test_unary_violation_is_a_contract_error(faulty_server, endpoint):
    before = _metric(faulty_server.root_url, "vllm_allowed_tools:violations_total",
                     source="unary_guard")
    body = _chat_body() if endpoint == "chat/completions" else _responses_body()
    response = httpx.post(f"{faulty_server.base_url}/{endpoint}", json=body, timeout=120)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "allowed_tools_violation" and error["type"] == "server_error"
    assert FORBIDDEN in error["message"]
    assert _metric(faulty_server.root_url, "vllm_allowed_tools:violations_total",
                   source="unary_guard") == before + 1


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_responses_stream_violation_fails_once_and_aborts_the_engine_request(faulty_server):
    root = faulty_server.root_url
    tokens_before = _metric(root, "vllm:generation_tokens_total")
    finished_before = _metric(root, "vllm:request_success_total")
    # parallel calls on and EOS ignored: the engine would keep generating calls for 3000 tokens
    body = _responses_body(stream=True, parallel_tool_calls=True, max_output_tokens=3000,
                           ignore_eos=True)
    with httpx.stream("POST", faulty_server.base_url + "/responses", json=body, timeout=120) as stream:
        raw = b"".join(stream.iter_bytes())
    text = raw.decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    types = [event["type"] for event in events]
    assert types.count("response.failed") == 1 and types[-1] == "response.failed", types
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "allowed_tools_violation"
    for event in events[:-1]:   # no byte of the refused call: no item, delta or done names it
        item = event.get("item") or {}
        assert item.get("name") != FORBIDDEN and event.get("name") != FORBIDDEN, event
    assert all(item.get("name") != FORBIDDEN for item in failed.get("output", []))
    numbers = [event["sequence_number"] for event in events]
    assert numbers == sorted(set(numbers))
    # the engine request was aborted, not left running: with EOS ignored it would have generated
    # 3000 tokens and finished; it stops far short and never finishes (vLLM 0.32 counts no abort)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(root, "vllm:num_requests_running") != 0:
        time.sleep(0.5)
    time.sleep(2)
    assert _metric(root, "vllm:num_requests_running") == 0
    generated = _metric(root, "vllm:generation_tokens_total") - tokens_before
    assert 0 < generated < 1000, generated
    assert _metric(root, "vllm:request_success_total") == finished_before


def test_chat_stream_violation_sends_one_error_then_done(faulty_server):
    body = _chat_body(stream=True)
    with httpx.stream("POST", faulty_server.base_url + "/chat/completions", json=body,
                      timeout=120) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    errors = [json.loads(line[6:]) for line in lines if '"error"' in line]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "allowed_tools_violation"
    assert lines[-2].startswith("data: {\"error\"")
    for line in lines[:-2]:
        assert FORBIDDEN not in line, line


def test_plain_auto_call_outside_the_catalog_is_refused(faulty_server):
    """Without allowed_tools the faulty parser emits a name that is in no request's catalog: a
    violation in every mode, plain `auto`/`required` included."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go ahead."}],
            "tools": [t.chat_tool() for t in CATALOG], "tool_choice": "required",
            "max_tokens": 400, "parallel_tool_calls": False, "temperature": 1.0, "seed": 1}
    response = httpx.post(faulty_server.base_url + "/chat/completions", json=body, timeout=120)
    if response.status_code == 200:   # the random model ran out of tokens before a whole call
        assert not response.json()["choices"][0]["message"].get("tool_calls")
    else:
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "allowed_tools_violation"
        assert "no_such_tool_anywhere" in response.json()["error"]["message"]


# ------------------------------------------------------------------ a call cut off by the token limit
# The plugin's own server (allowed_hermes, no faulty parser): a `required` allowlist turn whose token
# limit cuts the forced call short. The grammar fixes every token of a hermes call up to its
# arguments (`<tool_call>`, `{"name": "`, the name, `"arguments": `), one small token at a time, so
# with greedy decoding these outputs are the same on every run: 5 tokens end before the name
# (`<tool_call>{"name"`), 9 inside it (`... "list`), 19 inside the arguments (`... {"pri`). vLLM's
# parser hands such a cut-off call out as message text; the answer must be incomplete (Responses
# `status: incomplete`, reason max_output_tokens; Chat finish_reason `length`) with no piece of the
# call in any text, unary and streamed (streamed, a call whose name is complete may come out as a
# call with the arguments it has, as vLLM streams every call: a call, which the guard judges).

CUT_CALL = CATALOG[1].name   # the one allowed tool; its name is the grammar's only choice
CUT_LIMITS = (5, 9, 19)


def _cut_body(api: str, limit: int, stream: bool) -> dict:
    extra = {"max_tokens" if api == "chat/completions" else "max_output_tokens": limit,
             "stream": stream, "temperature": 0.0, "seed": 0}
    body = _chat_body(**extra) if api == "chat/completions" else _responses_body(**extra)
    tools = [{"type": "function", "function": {"name": CUT_CALL}}] if api == "chat/completions" \
        else [{"type": "function", "name": CUT_CALL}]
    choice = body["tool_choice"]
    (choice["allowed_tools"] if api == "chat/completions" else choice)["tools"] = tools
    return body


def _item_texts(items: list[dict]) -> str:
    """Every text of the output items that are not calls (message and reasoning parts)."""
    return "".join(str(part.get("text") or part.get("refusal") or "")
                   for item in items if item.get("type") != "function_call"
                   for part in (item.get("content") or []) + (item.get("summary") or []))


def _assert_no_call_text(text: str) -> None:
    assert "<tool_call" not in text and "tool_call>" not in text, text
    assert '"name' not in text and "arguments" not in text, text
    for piece in ("list", "_weather", "weather", "{"):
        assert piece not in text, text


@pytest.mark.parametrize("limit", CUT_LIMITS)
@pytest.mark.parametrize("api", ["chat/completions", "responses"])
def test_a_call_cut_off_by_the_token_limit_is_incomplete_and_never_text(random_server, api, limit):
    response = httpx.post(f"{random_server.base_url}/{api}", json=_cut_body(api, limit, False),
                          timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    if api == "chat/completions":
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "length", body
        assert body["usage"]["completion_tokens"] == limit
        assert not choice["message"].get("tool_calls"), body
        _assert_no_call_text(choice["message"].get("content") or "")
    else:
        assert body["status"] == "incomplete", body
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["usage"]["output_tokens"] == limit
        assert not [item for item in body["output"] if item["type"] == "function_call"], body
        _assert_no_call_text(_item_texts(body["output"]))


@pytest.mark.parametrize("limit", CUT_LIMITS)
@pytest.mark.parametrize("api", ["chat/completions", "responses"])
def test_a_streamed_call_cut_off_by_the_token_limit_is_incomplete_and_never_text(random_server, api,
                                                                                  limit):
    with httpx.stream("POST", f"{random_server.base_url}/{api}", json=_cut_body(api, limit, True),
                      timeout=120) as stream:
        assert stream.status_code == 200
        events = _events(stream)
    if api == "chat/completions":
        text = "".join((choice.get("delta") or {}).get("content") or ""
                       for chunk in events for choice in chunk.get("choices") or ())
        names = [(call.get("function") or {}).get("name") for chunk in events
                 for choice in chunk.get("choices") or ()
                 for call in (choice.get("delta") or {}).get("tool_calls") or ()]
        finish = [choice["finish_reason"] for chunk in events for choice in chunk.get("choices") or ()
                  if choice.get("finish_reason")]
        assert finish == ["length"], events
        assert not any("error" in chunk for chunk in events)
    else:
        kinds = [event["type"] for event in events]
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        final = events[-1]["response"]
        assert final["status"] == "incomplete", final
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        text = "".join(event.get("delta", "") for event in events
                       if event["type"] in ("response.output_text.delta", "response.refusal.delta",
                                            "response.reasoning_text.delta"))
        text += "".join(str(event.get("text", "")) for event in events
                        if event["type"] in ("response.output_text.done",
                                             "response.reasoning_text.done"))
        text += _item_texts([event["item"] for event in events if "item" in event] + final["output"])
        names = [(event.get("item") or {}).get("name") for event in events
                 if (event.get("item") or {}).get("type") == "function_call"]
    _assert_no_call_text(text)
    assert all(name in (None, CUT_CALL) for name in names), names   # a call, if any, is the allowed one
