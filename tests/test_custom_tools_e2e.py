"""A custom grammar tool under ``allowed_tools`` on a real ``vllm serve``: the random-weight model,
held to the tool's grammar while it decodes, always calls the selected custom tool with an input the
grammar admits, unary and streamed, on a JSON-argument format (hermes: the input is a JSON string)
and an XML one (qwen3_coder: the input is the raw parameter value). The grammar is bounded so every
call ends within the token limit.
"""

from __future__ import annotations

import httpx
import pytest

from support.custom_tools import (
    ADMITTED,
    EXEC,
    SEEDS,
    SHORT,
    request_body,
    streamed,
    the_one_custom_call,
    unary,
)

pytestmark = pytest.mark.server


@pytest.fixture
def server(random_server):
    """hermes; the same tests on qwen3_coder run on that format's server in test_parsers_e2e.py."""
    return random_server


@pytest.mark.parametrize("seed", SEEDS)
def test_required_calls_the_selected_custom_tool_with_an_input_its_grammar_admits(server, seed):
    response = unary(server, request_body(seed, False))
    the_one_custom_call(response)
    assert response["tools"][1] == SHORT   # echoed as the client sent it (a grammar tool)
    assert response["tool_choice"]["tools"] == [{"type": "custom", "name": "short"}]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_streamed_required_turn_streams_that_call_and_its_input(server, seed):
    events = streamed(server, request_body(seed, True))
    assert events[-1]["type"] == "response.completed", events[-1]
    call = the_one_custom_call(events[-1]["response"])
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    done = [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert deltas == call["input"] and done == [call["input"]], events


def test_a_function_selected_as_a_custom_tool_is_a_400_naming_the_entry(random_server):
    body = request_body(0, False)
    body["tool_choice"]["tools"] = [{"type": "custom", "name": "short"}, {"type": "custom", "name": "exec_command"}]
    response = httpx.post(f"{random_server.base_url}/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice.tools[1].name" and "is a function tool" in error["message"]


# ------------------------------------------------------------------------- Chat Completions

CHAT_SHORT = {"type": "custom", "custom": {"name": "short", "description": "Say it short.",
                                           "format": SHORT["format"]}}
CHAT_EXEC = {"type": "function", "function": {"name": "exec_command", "description": EXEC["description"],
                                              "parameters": EXEC["parameters"]}}


def chat_body(seed: int, stream: bool, tool_choice=None) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Go ahead."}],
            "tools": [CHAT_EXEC, CHAT_SHORT],
            "tool_choice": tool_choice or {"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "custom", "custom": {"name": "short"}}]}},
            "parallel_tool_calls": False, "max_tokens": 120, "temperature": 1.0, "seed": seed,
            "stream": stream}


def chat_unary(server, body: dict) -> dict:
    return unary(server, body, "chat/completions")


def chat_streamed(server, body: dict) -> list[dict]:
    return streamed(server, body, "chat/completions")


def the_one_chat_custom_call(calls: list[dict]) -> dict:
    """A Chat message's one call: OpenAI's custom call shape, the selected tool, its input admitted."""
    assert [(call["type"], call["custom"]["name"]) for call in calls] == [("custom", "short")], calls
    assert set(calls[0]) == {"id", "type", "custom"} and calls[0]["id"], calls
    assert calls[0]["custom"]["input"] in ADMITTED, calls
    return calls[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_required_calls_the_selected_custom_tool_with_an_input_its_grammar_admits(server, seed):
    response = chat_unary(server, chat_body(seed, False))
    assert response["choices"][0]["finish_reason"] == "tool_calls", response
    the_one_chat_custom_call(response["choices"][0]["message"]["tool_calls"])


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_a_streamed_required_turn_streams_custom_deltas(server, seed):
    chunks = chat_streamed(server, chat_body(seed, True))
    assert not any("error" in chunk for chunk in chunks), chunks[-1]
    deltas = [call for chunk in chunks for choice in chunk["choices"]
              for call in (choice["delta"].get("tool_calls") or [])]
    assert deltas and all("function" not in call for call in deltas), deltas
    first = deltas[0]
    assert first["type"] == "custom" and first["custom"]["name"] == "short" and first["id"], first
    streamed_input = "".join(call["custom"].get("input") or "" for call in deltas)
    the_one_chat_custom_call([{"id": first["id"], "type": "custom",
                               "custom": {"name": "short", "input": streamed_input}}])
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] \
        == ["tool_calls"]


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_a_named_custom_choice_calls_it_with_an_input_its_grammar_admits(server, seed):
    body = chat_body(seed, False, {"type": "custom", "custom": {"name": "short"}})
    response = chat_unary(server, body)
    the_one_chat_custom_call(response["choices"][0]["message"]["tool_calls"])


@pytest.mark.parametrize("seed", SEEDS)
def test_responses_a_named_custom_choice_calls_it_with_an_input_its_grammar_admits(server, seed):
    body = request_body(seed, False)
    body["tool_choice"] = {"type": "custom", "name": "short"}
    the_one_custom_call(unary(server, body))


def test_chat_a_function_named_as_a_custom_tool_is_a_400_naming_the_field(random_server):
    body = chat_body(0, False, {"type": "custom", "custom": {"name": "exec_command"}})
    response = httpx.post(f"{random_server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice.custom.name" and "is a function tool" in error["message"]


# ------------------------------------------------------------------------------- auto mode

def trigger_bias() -> dict[str, float]:
    """``logit_bias`` pushing the random model onto hermes' ``<tool_call>`` token, so an ``auto``
    turn opens calls at once (what follows the trigger is the grammar's)."""
    from vllm_allowed_tools.devtools.models.format_model import writing_nudges
    from vllm_allowed_tools.devtools.models.tiny_model import ensure_model
    return writing_nudges(ensure_model("random", log=lambda *_: None), {"<tool_call>": 30.0})


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("seed", SEEDS)
def test_auto_calls_only_the_selected_custom_tool_with_an_input_its_grammar_admits(server, seed, stream):
    """``auto`` over the custom tool (the function is offered, not selected): with the trigger
    pushed the model calls at once, and every call is the custom tool with an admitted input."""
    body = request_body(seed, stream, logit_bias=trigger_bias())
    body["tool_choice"]["mode"] = "auto"
    response = streamed(server, body)[-1]["response"] if stream else unary(server, body)
    calls = [item for item in response["output"] if item["type"] in ("function_call", "custom_tool_call")]
    assert calls, response["output"]
    for call in calls:
        assert (call["type"], call["name"]) == ("custom_tool_call", "short"), call
        assert call["input"] in ADMITTED, call
    chat = chat_body(seed, False)
    chat["tool_choice"]["allowed_tools"]["mode"] = "auto"
    chat["logit_bias"] = trigger_bias()
    message = chat_unary(server, chat)["choices"][0]["message"]
    assert message.get("tool_calls"), message
    for call in message["tool_calls"]:
        assert call["type"] == "custom" and call["custom"]["name"] == "short", call
        assert call["custom"]["input"] in ADMITTED, call


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_definition(random_server, api):
    """A lookahead (xgrammar's regexes have none): refused before generation, the field named."""
    broken = {"type": "grammar", "syntax": "regex", "definition": "(?=a)a+"}
    if api == "responses":
        body = request_body(0, False)
        body["tools"] = [EXEC, {**SHORT, "format": broken}]
        path, param = "responses", "tools[1].format.definition"
    else:
        body = chat_body(0, False)
        body["tools"] = [CHAT_EXEC, {"type": "custom", "custom": {**CHAT_SHORT["custom"], "format": broken}}]
        path, param = "chat/completions", "tools[1].custom.format.definition"
    response = httpx.post(f"{random_server.base_url}/{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "does not compile" in error["message"], error
