"""A plain ``auto`` request cannot produce a tool name outside its own catalog: decoding admits only
the catalog's names (the output guard stays the backstop), and the operator switch
``VLLM_ALLOWED_TOOLS_PLAIN_DECODING=vanilla`` restores vLLM's own decoding.

The tool-happy model was trained on one pool of tools and calls them eagerly; offered a catalog of
names it never saw, vanilla decoding lets it write its pool's names (refused by the guard, after
the fact), catalog decoding makes it call one of the offered tools instead."""

from __future__ import annotations

import json

import httpx
import pytest

from support.servers import start_cli_server, stop_cli_server

pytestmark = [pytest.mark.server, pytest.mark.trained_model]

#: names the tool-happy model never saw in training (its pool: vllm_allowed_tools.devtools.models.tool_pool)
UNSEEN = ["brew_coffee", "water_plants", "tune_guitar"]
SCHEMA = {"type": "object", "properties": {"amount": {"type": "string"}}, "required": ["amount"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n.replace('_', ' ')}.",
                                                "parameters": SCHEMA}} for n in UNSEEN]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"{n.replace('_', ' ')}.",
                    "parameters": SCHEMA} for n in UNSEEN]
SEEDS = range(6)


@pytest.fixture(scope="module")
def happy_vanilla_decoding():
    server = start_cli_server("tool-happy", env={"VLLM_ALLOWED_TOOLS_PLAIN_DECODING": "vanilla"})
    yield server
    stop_cli_server(server)


def _chat(server, seed, stream=False):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Do the next step."}],
            "tools": CHAT_TOOLS, "tool_choice": "auto", "max_tokens": 160, "temperature": 1.0,
            "seed": seed, "stream": stream}
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    assert response.status_code in (200, 500), response.text
    if not stream:
        return response.json()
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return chunks


def _chat_names(payload) -> tuple[list[str], bool]:
    """(called names, whether the guard refused something)."""
    if isinstance(payload, dict):
        if "error" in payload:
            return [], True
        calls = payload["choices"][0]["message"].get("tool_calls") or []
        return [call["function"]["name"] for call in calls], False
    names, refused = [], False
    for chunk in payload:
        refused |= "error" in chunk
        for choice in chunk.get("choices", []):
            for call in choice.get("delta", {}).get("tool_calls") or []:
                if call.get("function", {}).get("name"):
                    names.append(call["function"]["name"])
    return names, refused


@pytest.mark.parametrize("stream", [False, True])
def test_plain_auto_calls_only_catalog_names(happy_server, stream):
    called = []
    for seed in SEEDS:
        names, refused = _chat_names(_chat(happy_server, seed, stream))
        assert not refused, f"seed {seed}: the guard had to refuse a call"
        assert set(names) <= set(UNSEEN), names
        called += names
    assert called, "the tool-happy model made no call at all: the test shows nothing"


def test_plain_auto_on_responses_calls_only_catalog_names(happy_server):
    called = []
    for seed in SEEDS:
        response = httpx.post(happy_server.base_url + "/responses", timeout=120, json={
            "model": "tiny", "input": "Do the next step.", "tools": RESPONSES_TOOLS,
            "max_output_tokens": 160, "temperature": 1.0, "seed": seed})
        assert response.status_code == 200, response.text
        # "incomplete" is a call cut off by max_output_tokens; "failed" would be a refused call
        assert response.json()["status"] != "failed", response.json().get("error")
        called += [i["name"] for i in response.json()["output"] if i["type"] == "function_call"]
    assert called and set(called) <= set(UNSEEN), called


def test_vanilla_decoding_lets_the_model_name_its_own_tools(happy_vanilla_decoding):
    """The switch restores vLLM's decoding: the same requests now produce names outside the
    catalog, which only the output guard stops (what catalog decoding prevents)."""
    refusals = sum(_chat_names(_chat(happy_vanilla_decoding, seed))[1] for seed in SEEDS)
    assert refusals > 0
