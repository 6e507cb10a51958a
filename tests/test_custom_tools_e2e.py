"""A custom grammar tool under ``allowed_tools`` on a real ``vllm serve``: the random-weight model,
held to the tool's grammar while it decodes, always calls the selected custom tool with an input the
grammar admits, unary and streamed, on a JSON-argument format (hermes: the input is a JSON string)
and an XML one (qwen3_coder: the input is the raw parameter value). The grammar is bounded so every
call ends within the token limit.
"""

from __future__ import annotations

import json

import httpx
import pytest

from vllm_allowed_tools.request.custom_tools import compile_custom_grammar

pytestmark = pytest.mark.server

#: bounded, and framed by a quote and a backslash: what a JSON string writes escaped (hermes) and
#: an XML value carries raw (qwen3_coder)
GRAMMAR = r'start: "\"" ("a" | "b" "c"~1..3) "\\"'
SHORT = {"type": "custom", "name": "short", "description": "Say it short.",
         "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
ADMITTED = {f'"{core}\\' for core in ("a", "bc", "bcc", "bccc")}   # every input the grammar admits
SEEDS = (0, 1, 2)


@pytest.fixture
def server(random_server):
    """hermes; the same tests on qwen3_coder run on that format's server in test_parsers_e2e.py."""
    return random_server


def request_body(seed: int, stream: bool, **extra) -> dict:
    return {"model": "tiny", "input": "Go ahead.", "tools": [EXEC, SHORT],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "custom", "name": "short"}]},
            "parallel_tool_calls": False, "max_output_tokens": 120, "temperature": 1.0, "seed": seed,
            "stream": stream, **extra}


def unary(server, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/responses", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/responses", json=body, timeout=180) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def the_one_custom_call(response: dict) -> dict:
    """The response's one call: a ``custom_tool_call`` of the selected tool, its input admitted."""
    assert response["status"] == "completed", response
    calls = [item for item in response["output"] if item["type"] in ("function_call", "custom_tool_call")]
    assert [(item["type"], item["name"]) for item in calls] == [("custom_tool_call", "short")], response
    assert calls[0]["input"] in ADMITTED, calls[0]
    assert compile_custom_grammar("short", "lark", GRAMMAR).admits(calls[0]["input"])
    return calls[0]


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
