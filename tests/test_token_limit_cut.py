"""A call the request's output limit cut, on unary Chat: vLLM reports such an auto turn as
``finish_reason: "tool_calls"`` (its stream and the Responses API say ``length``/``incomplete`` for
the same generation), so the guard read an unfinished call as a refused one and answered a 500. The
guard now knows the request's limit: the choice goes out as ``length``, as OpenAI reports a cut."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_allowed_tools.asgi.guarded_send import GuardedSend, StopSignal
from vllm_allowed_tools.asgi.turn_plan import output_contract
from vllm_allowed_tools.request.rewrite import rewrite_request
from vllm_allowed_tools.response import AllowedNames, AllowedToolsViolation, check_chat_completion
from vllm_allowed_tools.response.contract import OutputContract

from support.guard import send_plan

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMES = AllowedNames(frozenset({"get_weather"}))


def completion(arguments: str, used: int, finish: str = "tool_calls", choices: int = 1) -> dict:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    return {"object": "chat.completion", "choices": [
        {"index": n, "finish_reason": finish,
         "message": {"role": "assistant", "content": None, "tool_calls": [call]}}
        for n in range(choices)], "usage": {"prompt_tokens": 5, "completion_tokens": used}}


def request(max_tokens: int | None = 40, key: str = "max_tokens", choice: str = "auto") -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": choice}
    if max_tokens is not None:
        body[key] = max_tokens
    return body


def contract_for(body: dict) -> OutputContract:
    return output_contract(rewrite_request(body, "chat"), body, "chat", strict_all=False)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_a_call_cut_at_the_requests_limit_goes_out_as_length(key):
    body = completion('{"city": "Par', used=40)
    assert check_chat_completion(body, NAMES, contract=contract_for(request(40, key))) is True
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'


@pytest.mark.parametrize("case", ["below the limit", "no limit", "finished call", "two choices"])
def test_anything_else_unfinished_is_still_refused_or_left_alone(case):
    """Only a cut the limit explains is a cut: an unfinished call short of the limit (or with no
    limit) is still the 500 it was; a complete call at the limit is a real ``tool_calls``."""
    if case == "finished call":
        body = completion('{"city": "Paris"}', used=40)
        assert check_chat_completion(body, NAMES, contract=contract_for(request(40))) is False
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        return
    body = completion('{"city": "Par', used=39 if case == "below the limit" else 40,
                      choices=2 if case == "two choices" else 1)
    with pytest.raises(AllowedToolsViolation, match="arguments"):
        check_chat_completion(body, NAMES,
                              contract=contract_for(request(None if case == "no limit" else 40)))


def test_a_required_turn_cut_inside_its_call_is_length_too():
    body = completion('{"ci', used=12)
    assert check_chat_completion(body, NAMES, contract=contract_for(request(12, choice="required")))
    assert body["choices"][0]["finish_reason"] == "length"


def test_the_guarded_send_sends_the_corrected_body():
    """What the client receives through the middleware's ``send`` (the body is re-serialised)."""
    body = request(40)
    plan = send_plan("chat", NAMES, body, contract=contract_for(body))
    sent: list[dict] = []

    async def client_send(message):
        sent.append(message)

    async def run():
        send = GuardedSend(client_send, plan, StopSignal(), (2, 4))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "more_body": False,
                    "body": json.dumps(completion('{"city": "Par', used=40)).encode()})

    asyncio.run(run())
    assert sent[0]["status"] == 200
    out = json.loads(sent[-1]["body"])
    assert out["choices"][0]["finish_reason"] == "length"
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(sent[-1]["body"])).encode()
