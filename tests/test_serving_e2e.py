"""allowed_tools served for real: the tiny models behind `vllm serve` with the plugin, official SDK.

Random weights are an adversarial model: whatever they emit, the contract must hold. The tool-happy
model calls catalog tools outside a 2-of-8 allowlist most of the time without a policy (measured in
the same test), so a green auto-mode test is not hollow.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL, POOL_BY_NAME

from support.calls import (
    chat_calls,
    chat_selection,
    responses_calls,
    responses_selection,
)
from support.metrics import scrape_metric
from support.serving import catalog_and_subset, happy_model_violation_figures

pytestmark = pytest.mark.server

SEEDS = range(6)


# --------------------------------------------------------------------------- required mode

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_required_mode_chat_only_allowed_calls(random_server, stream):
    client = random_server.client()
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, text, _ = chat_calls(client, catalog, "required", allowed, seed, stream=stream)
        assert len(calls) == 1, (seed, calls, text)
        name, arguments = calls[0]
        assert name in allowed, (seed, name, allowed)
        assert POOL_BY_NAME[name].arguments_valid(arguments), (seed, arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_required_mode_responses_only_allowed_calls(random_server, stream):
    client = random_server.client()
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, text, response = responses_calls(client, catalog, "required", allowed, seed, stream=stream)
        assert len(calls) == 1, (seed, calls, text)
        name, arguments, _ = calls[0]
        assert name in allowed and POOL_BY_NAME[name].arguments_valid(arguments), (seed, calls)
        # the client's own tool_choice is echoed, not the internal rewrite
        assert response.tool_choice.type == "allowed_tools"
        assert sorted(t["name"] for t in response.tool_choice.tools) == sorted(allowed)


def test_parallel_calls_allowed_are_all_in_subset(random_server):
    """With parallel calls allowed the random model keeps calling until max_tokens; every complete
    call must still be in the subset."""
    client = random_server.client()
    seen = 0
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, _, _ = responses_calls(client, catalog, "required", allowed, seed, parallel=True,
                                      max_tokens=200)
        seen += len(calls)
        assert all(name in allowed for name, _, _ in calls), (seed, calls, allowed)
    assert seen >= len(SEEDS)


def test_unary_and_streaming_produce_the_same_calls(random_server):
    client = random_server.client()
    for seed in SEEDS[:3]:
        catalog, allowed = catalog_and_subset(seed)
        unary, _, _ = chat_calls(client, catalog, "required", allowed, seed)
        streamed, _, _ = chat_calls(client, catalog, "required", allowed, seed, stream=True)
        assert [(n, json.loads(a)) for n, a in unary] == [(n, json.loads(a)) for n, a in streamed]
        r_unary, _, _ = responses_calls(client, catalog, "required", allowed, seed)
        r_stream, _, _ = responses_calls(client, catalog, "required", allowed, seed, stream=True)
        assert [(n, json.loads(a)) for n, a, _ in r_unary] == [(n, json.loads(a)) for n, a, _ in r_stream]


# --------------------------------------------------------------------------- auto mode

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_auto_mode_never_calls_outside_subset_random(random_server, stream):
    """The random model left alone (nothing pushed) in auto turns: never a call outside the subset,
    and text-only answers stay possible. It opens no call here (measured: none in the 24 turns of
    both cases; its next token is near uniform, ``<tool_call>`` about 0.08% a step), so the floor on
    hermes auto calls is held by the tool-happy model's test below and the trigger-pushed one in
    tests/test_approvals_blackbox_e2e.py."""
    client = random_server.client()
    text_only = 0
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, text, _ = chat_calls(client, catalog, "auto", allowed, seed, stream=stream, max_tokens=60)
        assert all(name in allowed for name, _ in calls), (seed, calls)
        r_calls, r_text, _ = responses_calls(client, catalog, "auto", allowed, seed, stream=stream,
                                             max_tokens=60)
        assert all(name in allowed for name, _, _ in r_calls), (seed, r_calls)
        text_only += (not calls and bool(text)) + (not r_calls and bool(r_text))
    assert text_only > 0, "auto mode must still allow a text-only answer"


def test_auto_mode_holds_against_the_tool_happy_model(happy_server):
    """The model violates a 2-of-8 allowlist most of the time on its own; with the policy no
    response carries a disallowed call, and allowed calls are still made."""
    figures = happy_model_violation_figures(happy_server.client(), trials=24)
    assert figures["violation_rate_with_policy"] == 0
    assert figures["responses_with_allowed_calls"] > 0, "the model should still make allowed calls in auto mode"


# --------------------------------------------------------------------------- parallel / namespaces

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_parallel_false_never_more_than_one_call(random_server, stream):
    client = random_server.client()
    for seed in SEEDS:
        catalog, allowed = catalog_and_subset(seed)
        calls, _, _ = responses_calls(client, catalog, "required", allowed, seed, stream=stream,
                                      parallel=False, max_tokens=200)
        assert len(calls) == 1, calls   # required: one, and not more
        chat, _, _ = chat_calls(client, catalog, "required", allowed, seed, stream=stream,
                             parallel=False, max_tokens=200)
        assert len(chat) == 1, chat


def test_namespaced_catalog_round_trips_namespace(random_server):
    client = random_server.client()
    members = POOL[:4]
    tools = [tool.responses_tool() for tool in POOL[4:8]] + [{
        "type": "namespace", "name": "crm", "description": "CRM tools.",
        "tools": [tool.responses_tool() for tool in members]}]
    for seed in SEEDS[:4]:
        # select by bare name (a unique namespace member) and by flat name
        selection = [members[0].name, f"crm__{members[1].name}"]
        calls, _, response = responses_calls(client, None, "required", selection, seed, tools=tools)
        assert len(calls) == 1, calls
        name, arguments, namespace = calls[0]
        assert namespace == "crm" and name in {members[0].name, members[1].name}, calls[0]
        assert POOL_BY_NAME[name].arguments_valid(arguments)


# --------------------------------------------------------------------------- prompt and validation

def test_rendered_prompt_holds_the_full_catalog_whatever_the_subset(random_server):
    """The engine's own prompt tokens (``return_token_ids``) hold the whole catalog for any subset,
    and everything before the tail policy block is token-identical."""
    catalog = POOL[:8]
    client = random_server.client()
    prompts = []
    for allowed in ([catalog[0].name], [catalog[3].name, catalog[5].name]):
        response = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Go ahead."}],
            tools=[tool.chat_tool() for tool in catalog], tool_choice=chat_selection("required", allowed),
            parallel_tool_calls=False, max_tokens=5, extra_body={"return_token_ids": True})
        token_ids = response.model_extra["prompt_token_ids"]
        text = httpx.post(random_server.root_url + "/detokenize",
                          json={"model": "tiny", "tokens": token_ids}, timeout=60).json()["prompt"]
        for tool in catalog:
            assert f'"name": "{tool.name}"' in text
        assert text.count("Allowed tools this turn (required): " + ", ".join(sorted(allowed))) == 1
        prompts.append((token_ids, text))
    (ids_a, text_a), (ids_b, text_b) = prompts
    block = text_a.index("<|im_start|>system\nAllowed tools")
    assert text_b[:block] == text_a[:block]
    common = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b)
    assert text_a.startswith(httpx.post(random_server.root_url + "/detokenize", timeout=60, json={
        "model": "tiny", "tokens": ids_a[:common]}).json()["prompt"])
    assert len(httpx.post(random_server.root_url + "/detokenize", timeout=60, json={
        "model": "tiny", "tokens": ids_a[:common]}).json()["prompt"]) >= block


_metric = scrape_metric


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_invalid_selection_is_a_400_and_the_engine_sees_nothing(random_server, api):
    client = random_server.client()
    catalog = POOL[:8]
    before = (_metric(random_server.root_url, "vllm:prompt_tokens_total"),
              _metric(random_server.root_url, "vllm:request_success_total"))
    rejected_before = _metric(random_server.root_url, "vllm_allowed_tools:invalid_selections_total")
    cases = [([], "empty_subset"), (["no_such_tool"], "unknown_function")]
    for names, _reason in cases:
        with pytest.raises(openai.BadRequestError) as error:
            if api == "chat":
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}],
                    tools=[t.chat_tool() for t in catalog], tool_choice=chat_selection("auto", names))
            else:
                client.responses.create(model="tiny", input="hi",
                                        tools=[t.responses_tool() for t in catalog],
                                        tool_choice=responses_selection("auto", names))
        body = error.value.body
        assert body["type"] == "invalid_request_error" and body["code"]
        assert body["param"].startswith("tool_choice")
    # a non-function selector
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input="hi", tools=[t.responses_tool() for t in catalog],
                                tool_choice={"type": "allowed_tools", "mode": "auto",
                                             "tools": [{"type": "mcp", "server_label": "x"}]})
    assert error.value.body["param"] == "tool_choice.tools[0].type"
    after = (_metric(random_server.root_url, "vllm:prompt_tokens_total"),
             _metric(random_server.root_url, "vllm:request_success_total"))
    assert after == before, "an invalid selection reached the engine"
    assert _metric(random_server.root_url, "vllm_allowed_tools:invalid_selections_total") == \
        rejected_before + 3


PLAIN_CHOICES = ["none", "auto", "required", "named"]


@pytest.mark.parametrize("choice", PLAIN_CHOICES)
def test_plain_choices_match_vanilla_vllm(random_server, vanilla_server, choice):
    """none / auto / required / named behave exactly as vanilla vLLM with the base parser: same
    prompts, same seeds, same outputs, finish reasons and usage, on both endpoints."""
    catalog = POOL[:8]
    chat_choice = {"type": "function", "function": {"name": catalog[2].name}} \
        if choice == "named" else choice
    responses_choice = {"type": "function", "name": catalog[2].name} if choice == "named" else choice
    for seed in range(3):
        results = []
        for server in (random_server, vanilla_server):
            client = server.client()
            chat = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}],
                tools=[t.chat_tool() for t in catalog], tool_choice=chat_choice, max_tokens=40,
                temperature=1.0, seed=seed)
            message = chat.choices[0].message
            response = client.responses.create(
                model="tiny", input="hi", tools=[t.responses_tool() for t in catalog],
                tool_choice=responses_choice, max_output_tokens=40, temperature=1.0,
                extra_body={"seed": seed})
            results.append((
                message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
                chat.choices[0].finish_reason, chat.usage.prompt_tokens, chat.usage.completion_tokens,
                [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output],
                response.status, response.tool_choice, response.usage.input_tokens,
                response.usage.output_tokens))
        assert results[0] == results[1], (choice, seed)


# --------------------------------------------------------------------------- conformance

def _sse_data(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_responses_objects_and_events_validate_against_sdk_types(random_server, mode):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    event_adapter = TypeAdapter(ResponseStreamEvent)
    catalog, allowed = catalog_and_subset(11)
    body = {"model": "tiny", "input": "Go ahead.", "tools": [t.responses_tool() for t in catalog],
            "tool_choice": responses_selection(mode, allowed), "max_output_tokens": 60,
            "parallel_tool_calls": False, "temperature": 1.0, "seed": 3}
    unary = httpx.post(random_server.base_url + "/responses", json=body, timeout=120)
    assert unary.status_code == 200, unary.text
    Response.model_validate(unary.json(), strict=False)
    assert unary.json()["tool_choice"] == body["tool_choice"]
    with httpx.stream("POST", random_server.base_url + "/responses", json={**body, "stream": True},
                      timeout=120) as streamed:
        events = _sse_data(streamed)
    assert events and events[-1]["type"] in ("response.completed", "response.incomplete")
    sequence = [event["sequence_number"] for event in events]
    assert sequence == sorted(set(sequence))
    for event in events:
        event_adapter.validate_python(event)
        if isinstance(event.get("response"), dict):
            assert event["response"]["tool_choice"] == body["tool_choice"]


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_chat_objects_and_chunks_validate_against_sdk_types(random_server, mode):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    catalog, allowed = catalog_and_subset(12)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go ahead."}],
            "tools": [t.chat_tool() for t in catalog], "tool_choice": chat_selection(mode, allowed),
            "max_tokens": 60, "parallel_tool_calls": False, "temperature": 1.0, "seed": 3}
    unary = httpx.post(random_server.base_url + "/chat/completions", json=body, timeout=120)
    assert unary.status_code == 200, unary.text
    ChatCompletion.model_validate(unary.json())
    with httpx.stream("POST", random_server.base_url + "/chat/completions",
                      json={**body, "stream": True}, timeout=120) as streamed:
        chunks = _sse_data(streamed)
    assert chunks
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
