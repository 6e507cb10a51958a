"""The demo: a real `vllm serve` with the plugin on a real model, and a scripted agent conversation.

The model is SmolLM2-135M-Instruct from its registry package (``--flavour real``, built in seconds,
no training). An agent keeps one tool catalog for the whole conversation and narrows it each turn
with ``tool_choice: {"type": "allowed_tools", ...}``; the transcript shows each thing the plugin
does: the allowed subset changing per turn with the prompt prefix reused, a call the model makes
without a policy and cannot make under one, an invalid selection's 400, and the output guard
refusing a call the grammar could not prevent. Greedy decoding and small token limits keep it
deterministic and short.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .serve import start_server

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TEXT = {"type": "string"}
#: ``delete_file`` stays inside the workspace: no absolute path, no ``..``. JSON Schema's ``not``
#: says so, a keyword the decoding grammar (xgrammar) does not enforce, so only the output guard can
OUTSIDE_WORKSPACE = {"pattern": r"^/|\.\."}


def _function(name: str, description: str, properties: dict, strict: bool = False) -> dict:
    tool = {"type": "function", "name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)}}
    if strict:
        tool["strict"] = True
        tool["parameters"]["additionalProperties"] = False
    return tool


#: the agent's whole catalog, sent unchanged every turn (Responses shape); only ``delete_file``
#: is ``strict``, so its schema (paths inside the workspace) is a promise the guard keeps
CATALOG = [
    _function("get_weather", "Get the current weather in a city.",
              {"city": {"type": "string", "description": "City name, e.g. Paris"}}),
    _function("send_email", "Send an email.",
              {"to": {"type": "string", "description": "Recipient name or email address"},
               "subject": TEXT, "body": TEXT}),
    _function("search_web", "Search the web.", {"query": TEXT}),
    _function("read_file", "Read a file.", {"path": TEXT}),
    _function("delete_file", "Delete a file.",
              {"path": {"type": "string", "not": OUTSIDE_WORKSPACE}}, strict=True),
    _function("create_event", "Create a calendar event.",
              {"title": TEXT, "date": {"type": "string", "description": "YYYY-MM-DD"}}),
]
ADDRESS = "info@paris.fr"
#: the conversation: (user's ask, mode, the allowed subset, what the tool answers if called)
TURNS = [
    ("What's the weather in Paris?", "required", ["get_weather", "search_web"],
     {"city": "Paris", "forecast": "sunny", "temp_c": 21}),
    (f"Send an email to {ADDRESS} saying it will be sunny.", "required", ["send_email"],
     {"sent": True}),
    ("Create an event called Picnic on 2025-06-01.", "required", ["create_event"], {"created": True}),
]
PREVENTED_ASK = "Delete the file notes.txt."
PREVENTED_ALLOWED = ["read_file", "search_web"]
GUARD_ASK = "Delete the file /etc/passwd."
MAX_TOKENS = 100


def _print(text: str = "") -> None:
    print(text, flush=True)


def _signature(tool: dict) -> str:
    strict = " [strict]" if tool.get("strict") else ""
    return f"{tool['name']}({', '.join(tool['parameters']['properties'])}){strict}"


def _allowed(mode: str, names: list[str]) -> dict:
    return {"type": "allowed_tools", "mode": mode,
            "tools": [{"type": "function", "name": name} for name in names]}


def _chat_tools() -> list[dict]:
    return [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            for tool in CATALOG]


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def _text(response) -> str:
    return "".join(part.text for item in response.output if item.type == "message"
                   for part in item.content if part.type == "output_text")


def _ask(client, history: list, tool_choice) -> object:
    return client.responses.create(model="tiny", input=history, tools=CATALOG, tool_choice=tool_choice,
                                   max_output_tokens=MAX_TOKENS, temperature=0.0,
                                   parallel_tool_calls=False)


def _say_answer(response, allowed: list[str] | None) -> None:
    for call in _calls(response):
        verdict = "" if allowed is None else ("   [allowed]" if call.name in allowed else "   [NOT ALLOWED]")
        _print(f"assistant > call {call.name}({call.arguments}){verdict}")
    if _text(response):
        _print(f"assistant > {_text(response)!r}")
    if not _calls(response) and not _text(response):
        _print(f"assistant > (nothing: status {response.status})")


def conversation(client) -> None:
    """One catalog, a different allowed subset each turn; the prefix cache reports its reuse."""
    _print("== 1. One catalog every turn, a different allowed subset per turn (Responses API)")
    _print("catalog (sent every turn, unchanged): " + ", ".join(_signature(t) for t in CATALOG))
    history: list[dict] = [SYSTEM]
    for index, (ask, mode, allowed, result) in enumerate(TURNS, 1):
        history.append({"role": "user", "content": ask})
        _print(f"\n--- turn {index}: allowed_tools {mode} {allowed}")
        _print(f"user      > {ask}")
        response = _ask(client, history, _allowed(mode, allowed))
        _say_answer(response, allowed)
        for call in _calls(response):
            history.append({"type": "function_call", "call_id": call.call_id, "name": call.name,
                            "arguments": call.arguments})
            history.append({"type": "function_call_output", "call_id": call.call_id,
                            "output": json.dumps(result)})
            _print(f"tool      > {json.dumps(result)}")
        if _text(response):
            history.append({"role": "assistant", "content": _text(response)})
        usage = response.usage
        _print(f"usage     : input {usage.input_tokens} tokens, "
               f"{usage.input_tokens_details.cached_tokens} served from the prefix cache")


def prevented(client) -> None:
    """The same ask without a policy and with one that leaves the model's pick out."""
    _print(f"\n== 2. A call the model makes without a policy, and cannot make under one")
    ask = [SYSTEM, {"role": "user", "content": PREVENTED_ASK}]
    _print(f"user      > {PREVENTED_ASK}")
    _print("plain tool_choice \"required\" (no policy: any tool of the catalog):")
    _say_answer(_ask(client, ask, "required"), None)
    _print(f"allowed_tools required {PREVENTED_ALLOWED} (same catalog, same ask):")
    _say_answer(_ask(client, ask, _allowed("required", PREVENTED_ALLOWED)), PREVENTED_ALLOWED)


def bad_selection(client) -> None:
    """A selection naming a tool the catalog does not hold never reaches the engine."""
    import openai

    _print("\n== 3. An invalid selection is a 400 naming the field, before the engine sees it")
    _print("allowed_tools auto ['drop_database'] (not in the catalog):")
    try:
        _ask(client, [SYSTEM, {"role": "user", "content": PREVENTED_ASK}],
             _allowed("auto", ["drop_database"]))
    except openai.BadRequestError as error:
        body = error.body or {}
        _print(f"HTTP {error.status_code} param={body.get('param')!r}: {body.get('message')}")
    else:
        _print("unexpected: the server accepted it")


def guarded(client) -> None:
    """A strict call whose arguments break a schema keyword the grammar cannot express."""
    import openai

    _print("\n== 4. The output guard stops a call the grammar could not prevent (Chat Completions)")
    _print("how it is provoked: delete_file is strict, and its schema keeps `path` inside the "
           "workspace with\n  JSON Schema's `not` (" + json.dumps(OUTSIDE_WORKSPACE) + ": no absolute "
           "path, no `..`), a keyword the decoding\n  grammar (xgrammar) does not enforce. So the "
           "model can write such a path, and the guard, which\n  validates a strict call's arguments "
           "against the whole schema before anything reaches the client,\n  refuses the answer.")
    _print(f"user      > {GUARD_ASK}")
    _print("allowed_tools required ['delete_file']:")
    try:
        response = client.chat.completions.create(
            model="tiny", messages=[SYSTEM, {"role": "user", "content": GUARD_ASK}],
            tools=_chat_tools(), max_tokens=MAX_TOKENS, temperature=0.0, parallel_tool_calls=False,
            tool_choice={"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": "delete_file"}}]}})
    except openai.InternalServerError as error:
        body = error.body or {}
        _print(f"HTTP {error.status_code} code={body.get('code')!r}: {body.get('message')}")
    else:
        calls = response.choices[0].message.tool_calls or []
        _print("not refused: " + ", ".join(f"{c.function.name}({c.function.arguments})" for c in calls)
               or f"not refused, no call: {response.choices[0].message.content!r}")


def converse(base_url: str) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="demo", max_retries=0, timeout=600)
    conversation(client)
    prevented(client)
    bad_selection(client)
    guarded(client)
    return 0


def run_demo(model: Path, args: argparse.Namespace) -> int:
    """Serve `model` with the CLI's server options, then converse with it."""
    print(f"starting vllm serve with the plugin on {model} ...", file=sys.stderr, flush=True)
    with start_server(model, port=args.port, host=args.host, parser=args.parser,
                      log_path=args.log_file, timeout=args.timeout) as server:
        _print(f"server: {server.base_url} (log: {server.log_path})")
        return converse(server.base_url)
