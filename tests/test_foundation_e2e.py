"""The foundation, end to end: the plugin loads in a real `vllm serve` and tool calling works."""

from __future__ import annotations

import json
import random

import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL, sample_catalog

pytestmark = pytest.mark.server


def test_plugin_parser_selected_and_chat_tool_call_works(happy_server):
    """A plain tool-calling request (auto) through our allowed_hermes parser, on the tool-happy
    model, which emits well-formed calls."""
    log = happy_server.log_text()
    assert "'tool_call_parser': 'allowed_hermes'" in log   # vLLM accepted our parser name
    catalog = [tool.chat_tool() for tool in POOL[:8]]
    names = {tool["function"]["name"] for tool in catalog}
    response = happy_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go ahead."}], tools=catalog,
        max_tokens=80, temperature=0.0)
    calls = response.choices[0].message.tool_calls
    assert calls, response
    for call in calls:
        assert call.function.name in names
        json.loads(call.function.arguments)


def test_responses_tool_call_works(happy_server):
    catalog = [tool.responses_tool() for tool in POOL[8:16]]
    names = {tool["name"] for tool in catalog}
    response = happy_server.client().responses.create(
        model="tiny", input="Go ahead.", tools=catalog, max_output_tokens=80, temperature=0.0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    assert all(call.name in names for call in calls)


def test_rendered_prompt_is_our_template(random_server):
    """The server renders with our template: the catalog appears once, sorted, without `strict`."""
    import httpx
    tools = [tool.chat_tool(strict=True) for tool in reversed(POOL[:3])]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    rendered = httpx.post(random_server.root_url + "/tokenize", json=body, timeout=60).json()
    from vllm_allowed_tools.templates.render import render_chat
    expected = render_chat(body["messages"], tools)
    detok = httpx.post(random_server.root_url + "/detokenize",
                       json={"model": "tiny", "tokens": rendered["tokens"]}, timeout=60).json()
    assert detok["prompt"] == expected
    assert "strict" not in expected


def test_tool_happy_model_violates_allowlists_without_the_policy(happy_server):
    """Measure the adversary: with plain `auto` (no allowlist), how often does the tool-happy model
    call a catalog tool outside a random 2-of-8 subset? It must be most of the time, or the
    auto-mode enforcement tests built on it would be hollow."""
    rng = random.Random(7)
    client = happy_server.client()
    trials, well_formed, in_catalog, outside = 40, 0, 0, 0
    for _ in range(trials):
        catalog = sample_catalog(rng, 8)
        allowed = {tool.name for tool in rng.sample(catalog, 2)}
        response = client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "You are a helpful agent."},
                                    {"role": "user", "content": rng.choice(["Go ahead.", "Continue."])}],
            tools=[tool.chat_tool() for tool in catalog], max_tokens=60,
            temperature=1.0, seed=rng.randrange(1 << 30))
        calls = response.choices[0].message.tool_calls or []
        if calls:
            well_formed += 1
            name = calls[0].function.name
            if name in {tool.name for tool in catalog}:
                in_catalog += 1
                outside += name not in allowed
    print(json.dumps({"trials": trials, "well_formed_call": well_formed / trials,
                      "name_in_catalog": in_catalog / trials,
                      "outside_2_of_8_allowlist": outside / trials}))
    assert well_formed / trials >= 0.8
    assert outside / trials >= 0.5

