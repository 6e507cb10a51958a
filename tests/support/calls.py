"""What a client got back: the tool calls and text of one Chat Completions or Responses answer.

The end-to-end tests ask a served tiny model for calls under an ``allowed_tools`` selection, unary
or streamed, through the official ``openai`` SDK; these helpers send that request and collect the
answer the same way on both endpoints, so every test judges the same thing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

USER_TURN = "Go ahead."


class Reply(NamedTuple):
    #: Chat: [(name, arguments)]; Responses: [(name, arguments, namespace)]
    calls: list[tuple]
    text: str
    #: the Chat message (None when streamed) or the final Responses object
    raw: Any


def chat_selection(mode: Any, names: Iterable[str]) -> dict[str, Any]:
    """A Chat Completions ``tool_choice`` allowing `names` in `mode`."""
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def responses_selection(mode: Any, names: Iterable[str]) -> dict[str, Any]:
    """A Responses ``tool_choice`` allowing `names` in `mode`."""
    return {"type": "allowed_tools", "mode": mode,
            "tools": [{"type": "function", "name": n} for n in names]}


def chat_calls(client: Any, catalog: Sequence[Any], mode: str, allowed: Sequence[str] | None,
               seed: int, *, stream: bool = False, parallel: bool = False, max_tokens: int = 120,
               system: str | None = None, extra_body: dict | None = None) -> Reply:
    """Ask Chat Completions for calls from `catalog` (tool-pool tools) under `allowed` (None: the
    plain `mode`, e.g. ``"required"``; ``extra_body``: more request fields, e.g. ``logit_bias``)."""
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": USER_TURN}]
    request = dict(model="tiny", messages=messages, tools=[tool.chat_tool() for tool in catalog],
                   tool_choice=mode if allowed is None else chat_selection(mode, allowed),
                   parallel_tool_calls=parallel, max_tokens=max_tokens, temperature=1.0, seed=seed,
                   extra_body=extra_body)
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        return Reply([(c.function.name, c.function.arguments) for c in message.tool_calls or []],
                     message.content or "", message)
    calls: dict[int, list[str]] = {}
    text = []
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            if call.function and call.function.name:
                entry[0] += call.function.name
            if call.function and call.function.arguments:
                entry[1] += call.function.arguments
    return Reply([tuple(calls[i]) for i in sorted(calls)], "".join(text), None)


def responses_calls(client: Any, catalog: Sequence[Any] | None, mode: str,
                    allowed: Sequence[str] | None, seed: int, *, stream: bool = False,
                    parallel: bool = False, max_tokens: int = 120, system: str | None = None,
                    tools: list[dict] | None = None, extra_body: dict | None = None) -> Reply:
    """Ask Responses for calls from `catalog` (or raw `tools`) under `allowed` (None: the plain
    `mode`; ``extra_body``: vLLM's sampling extensions, e.g. ``logit_bias``)."""
    request = dict(model="tiny", input=USER_TURN,
                   tools=tools or [tool.responses_tool() for tool in catalog or ()],
                   tool_choice=mode if allowed is None else responses_selection(mode, allowed),
                   parallel_tool_calls=parallel, max_output_tokens=max_tokens, temperature=1.0,
                   extra_body={"seed": seed, **(extra_body or {})})
    if system:
        request["instructions"] = system
    if not stream:
        response = client.responses.create(**request)
    else:
        response = None
        for event in client.responses.create(stream=True, **request):
            if event.type in ("response.completed", "response.incomplete"):
                response = event.response
        assert response is not None, "the stream ended without a terminal response"
    output = response.output
    calls = [(item.name, item.arguments, getattr(item, "namespace", None))
             for item in output if item.type == "function_call"]
    text = "".join(part.text for item in output if item.type == "message"
                   for part in item.content if part.type == "output_text")
    return Reply(calls, text, response)
