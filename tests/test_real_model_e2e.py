"""The real model (SmolLM2-135M-Instruct, ``serve-tiny --flavour real``) under the plugin: what only a
model that reads its prompt can show. Greedy, so every answer is the same on every run.

On a fixed set of prompts, with tools as most clients send them (not ``strict``), each answer's call
names and argument values are the ones a person would expect (``get_weather`` with ``city ==
"Paris"``, ``send_email`` to the address in the prompt), on Chat Completions and Responses, unary and
streamed, for plain ``required``, ``allowed_tools`` in ``required`` and ``auto`` mode and a named
choice. The guard: a prompt whose plain ``required`` answer calls ``get_weather`` gets no
``get_weather`` call when the allowlist leaves it out. Approvals: a gated tool's call comes back as
an approval request carrying the arguments the prompt asked for, and on Chat a gated tool is never
called.

One server for the module (the session's ``real_server``, an approval policy gating
``delete_file``), 12 requests of at most 100 tokens, and the README's two requests as written.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest


from support import readme
from support.calls import chat_selection, responses_selection

pytestmark = pytest.mark.server

GATED = "delete_file"   # the real_server fixture's approval policy gates it (tests/conftest.py)
MAX_TOKENS = 100


def _function(name: str, description: str, properties: dict[str, str]) -> dict[str, Any]:
    """A Chat tool as most clients write one: a described schema, no ``strict``."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {key: {"type": "string", "description": text}
                                         for key, text in properties.items()},
        "required": list(properties)}}}


CHAT_TOOLS = [
    _function("get_weather", "Get the current weather for a city.", {"city": "The city name"}),
    _function("send_email", "Send an email.", {"to": "The recipient's email address",
                                               "subject": "The subject line", "body": "The message"}),
    _function("search_web", "Search the web.", {"query": "What to search for"}),
]
GATED_TOOL = _function(GATED, "Delete a file.", {"path": "The file's name"})
#: the same tools in the Responses shape (flat)
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]

WEATHER_PARIS = "What is the weather in Paris?"
WEATHER_TOKYO = "What is the weather in Tokyo?"
EMAIL = "Send an email to info@paris.fr saying hello."
ADDRESS = "info@paris.fr"
SEARCH = "Search the web for the tallest building in the world."
DELETE = "Delete the file notes.txt."


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=900)


def _chat(server, prompt: str, tool_choice: Any, tools: list[dict[str, Any]] = CHAT_TOOLS,
          stream: bool = False, text: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """One Chat turn: its calls as (name, arguments), a streamed answer assembled from its deltas;
    its text is appended to ``text`` when given."""
    body = dict(model="tiny", messages=[{"role": "user", "content": prompt}], tools=tools,
                tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0)
    client = _client(server)
    if not stream:
        message = client.chat.completions.create(**body).choices[0].message
        if text is not None:
            text.append(message.content or "")
        return [(call.function.name, json.loads(call.function.arguments))
                for call in message.tool_calls or ()]
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            if text is not None:
                text.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return [(call["name"], json.loads(call["arguments"])) for _, call in sorted(calls.items())]


def _responses(server, prompt: str, tool_choice: Any, tools: list[dict[str, Any]] = RESPONSES_TOOLS,
               stream: bool = False) -> list[dict[str, Any]]:
    """One Responses turn's output items (a streamed one's from its ``response.completed``)."""
    body = dict(model="tiny", input=prompt, tools=tools, tool_choice=tool_choice,
                max_output_tokens=MAX_TOKENS, temperature=0)
    with _client(server).responses.with_streaming_response.create(**body, stream=stream) as raw:
        if not stream:
            return raw.json()["output"]
        events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
    completed = [event for event in events if event["type"] == "response.completed"]
    assert len(completed) == 1, [event["type"] for event in events]
    return completed[0]["response"]["output"]


def _calls(output: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(item["name"], json.loads(item["arguments"])) for item in output
            if item["type"] == "function_call"]


# ---------------------------------------------------------------- Chat Completions

def test_chat_plain_required_calls_the_weather_for_the_city_asked(real_server):
    assert _chat(real_server, WEATHER_PARIS, "required") == [("get_weather", {"city": "Paris"})]


def test_chat_allowlist_without_the_tool_the_model_wants_gets_no_call_to_it(real_server):
    """The guard's promise on a real answer: plain ``required`` picks ``get_weather`` for this prompt
    (above); with ``get_weather`` outside the allowlist, no such call leaves the server."""
    calls = _chat(real_server, WEATHER_PARIS, chat_selection("required", ["send_email", "search_web"]))
    assert calls and {name for name, _ in calls} <= {"send_email", "search_web"}, calls


def test_chat_streamed_allowlist_required_calls_the_weather_for_tokyo(real_server):
    calls = _chat(real_server, WEATHER_TOKYO, chat_selection("required", ["get_weather", "search_web"]),
                  stream=True)
    assert calls == [("get_weather", {"city": "Tokyo"})]


def test_chat_named_choice_copies_the_address_from_the_prompt(real_server):
    calls = _chat(real_server, EMAIL, {"type": "function", "function": {"name": "send_email"}})
    assert len(calls) == 1 and calls[0][0] == "send_email", calls
    assert calls[0][1]["to"] == ADDRESS, calls


def test_chat_allowlist_auto_answers_or_calls_only_what_it_allows(real_server):
    """``auto`` leaves the model free to answer in prose (SmolLM2 mostly does); any call it makes
    is an allowed one with the city asked about."""
    text: list[str] = []
    calls = _chat(real_server, WEATHER_PARIS, chat_selection("auto", ["get_weather"]), stream=True,
                  text=text)
    assert all(call == ("get_weather", {"city": "Paris"}) for call in calls), calls
    assert calls or "".join(text).strip(), "neither a call nor an answer"


def test_chat_never_calls_a_gated_tool(real_server):
    """Chat cannot carry an approval request, so a gated tool is left out of what the model may
    call: asked to delete a file, with ``required`` over a catalog holding the gated tool, the
    answer calls the other tool."""
    calls = _chat(real_server, DELETE, "required", tools=[GATED_TOOL, CHAT_TOOLS[2]])
    assert calls and all(name == "search_web" for name, _ in calls), calls


# ---------------------------------------------------------------- Responses

def test_responses_allowlist_required_calls_the_weather_for_paris(real_server):
    output = _responses(real_server, WEATHER_PARIS, responses_selection("required", ["get_weather",
                                                                                    "send_email"]))
    assert _calls(output) == [("get_weather", {"city": "Paris"})], output


def test_responses_streamed_plain_required_writes_the_email_to_the_address_given(real_server):
    calls = _calls(_responses(real_server, EMAIL, "required", stream=True))
    assert len(calls) == 1 and calls[0][0] == "send_email" and calls[0][1]["to"] == ADDRESS, calls


def test_responses_named_search_carries_the_question(real_server):
    calls = _calls(_responses(real_server, SEARCH, {"type": "function", "name": "search_web"}))
    assert len(calls) == 1 and calls[0][0] == "search_web", calls
    assert "tallest building" in calls[0][1]["query"].lower(), calls


def test_responses_streamed_guard_keeps_the_weather_out_of_an_allowlist_without_it(real_server):
    output = _responses(real_server, WEATHER_PARIS, responses_selection("required", ["search_web"]),
                        stream=True)
    assert [name for name, _ in _calls(output)] == ["search_web"], output


def test_responses_allowlist_auto_answers_or_calls_only_what_it_allows(real_server):
    output = _responses(real_server, WEATHER_PARIS, responses_selection("auto", ["get_weather"]))
    assert all(call == ("get_weather", {"city": "Paris"}) for call in _calls(output)), output
    assert _calls(output) or any(item["type"] == "message" for item in output), output


def test_responses_gated_call_is_an_approval_request_with_the_file_asked_for(real_server):
    tools = [{"type": "function", **GATED_TOOL["function"]}, RESPONSES_TOOLS[0]]
    output = _responses(real_server, DELETE, "required", tools=tools)
    assert not any(item["type"] == "function_call" and item["name"] == GATED for item in output), output
    requests = [item for item in output if item["type"] == "elicitation"]
    assert len(requests) == 1, output
    request = requests[0]
    assert request["elicitation_type"] == "tool_call_approval" and request["name"] == GATED, request
    assert json.loads(request["arguments"]) == {"path": "notes.txt"}, request


# ---------------------------------------------------------------- the README's requests

def test_readme_requests_answer_as_it_says(real_server):
    """Each of the README's two requests, as written but for the server's address and model name:
    a 200 whose answer is the one ``get_weather`` call for Paris the README describes, the
    client's own ``allowed_tools`` echoed on Responses."""
    answered = []
    for argv in readme.requests():
        status, answer = readme.run(argv, real_server)
        assert status == 200, answer
        if answer["object"] == "response":
            assert answer["status"] == "completed", answer
            assert answer["tool_choice"]["type"] == "allowed_tools", answer["tool_choice"]
            calls = [(item["name"], json.loads(item["arguments"])) for item in answer["output"]
                     if item["type"] == "function_call"]
        else:
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            calls = [(call["function"]["name"], json.loads(call["function"]["arguments"]))
                     for call in choice["message"]["tool_calls"] or ()]
        assert calls == [("get_weather", {"city": "Paris"})], answer
        answered.append(answer["object"])
    assert sorted(answered) == ["chat.completion", "response"]
