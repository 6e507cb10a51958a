"""The turn plan (asgi/turn_plan.py) without a server: what a request is rewritten to and what its
answer is judged by, from the body and the server's settings. The plain ``required`` turn of a
format whose calls are no JSON (the pythonic ones) is decoded in the format's own syntax."""

from __future__ import annotations

import pytest

from vllm_allowed_tools.asgi.turn_plan import plan_turn
from vllm_allowed_tools.request.placement import TEMPLATE_VARIABLE
from vllm_allowed_tools.settings import Settings
from vllm_allowed_tools.wire import ALLOWLIST_KEY, WireAllowlist

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]


def plan(parser: str, body: dict, api: str = "chat", *, env: dict | None = None):
    settings = Settings.from_environ(env or {}, ["vllm", "serve", "m", "--tool-call-parser", parser])
    return plan_turn(body, api, settings, placement=TEMPLATE_VARIABLE,  # type: ignore[arg-type]
                     render=False, filter_catalogs=False, approvals=False)


def chat(choice) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": choice}


def responses(choice) -> dict:
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    return {"model": "m", "input": "x", "tools": tools, "tool_choice": choice}


@pytest.mark.parametrize("parser", ["allowed_pythonic", "allowed_llama4_pythonic"])
def test_plain_required_on_a_pythonic_format_is_decoded_in_its_call_syntax(parser):
    """The whole catalog, in required mode, travels as the wire allowlist: the wrapper then holds
    the turn to the format's call list (``[get_weather(city="Paris")]``), not vLLM's JSON array."""
    made = plan(parser, chat("required"))
    wire = WireAllowlist.from_wire(made.rewritten.body[ALLOWLIST_KEY])
    assert wire is not None and wire.mode == "required"
    assert wire.allowed == frozenset({"get_weather", "get_time"})
    assert made.rewritten.body["tool_choice"] == "required"   # the prompt and vLLM's view: as sent
    assert made.contract is not None and made.contract.requirement is not None


def test_plain_required_on_a_json_format_stays_vllms():
    made = plan("allowed_hermes", chat("required"))
    assert ALLOWLIST_KEY not in made.rewritten.body


def test_plain_required_stays_vllms_when_plain_requests_are_left_to_vllm():
    made = plan("allowed_pythonic", chat("required"),
                env={"VLLM_ALLOWED_TOOLS_PLAIN_DECODING": "vanilla"})
    assert ALLOWLIST_KEY not in made.rewritten.body


def test_a_named_choice_on_a_pythonic_format_stays_vllms():
    made = plan("allowed_pythonic", chat({"type": "function", "function": {"name": "get_time"}}))
    assert ALLOWLIST_KEY not in made.rewritten.body


def test_the_responses_object_echoes_the_clients_required():
    """vLLM sees the turn as ``auto`` once the format's parser reads it (vllm_glue/parsers.py): the
    Responses object echoes the client's ``required``; a plain auto echoes what the client sent."""
    assert plan("allowed_pythonic", responses("required"), "responses").echo["tool_choice"] == "required"
    assert plan("allowed_pythonic", responses("auto"), "responses").echo["tool_choice"] == "auto"
    unset = responses("auto")
    del unset["tool_choice"]
    assert "tool_choice" not in plan("allowed_pythonic", unset, "responses").echo


def test_a_response_format_keeps_vllms_grammar():
    body = {**chat("required"), "response_format": {"type": "json_object"}}
    assert ALLOWLIST_KEY not in plan("allowed_pythonic", body).rewritten.body
