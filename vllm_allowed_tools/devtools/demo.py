"""The demo: a real `vllm serve` with the plugin on the tiny model, and a scripted agent conversation.

An agent keeps one tool catalog for the whole conversation and narrows it each turn with
`tool_choice: {"type": "allowed_tools", ...}`; the transcript shows what was allowed, what the
model called, and the prompt-cache reuse the server reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..testing.server import start_server
from ..testing.tool_pool import POOL_BY_NAME

CATALOG = ["get_weather", "read_file", "send_email", "create_calendar", "search_note",
           "update_ticket", "get_contact", "delete_photo"]
TURNS = [
    ("What's the weather?", ["get_weather", "get_contact"], "required"),
    ("Now read the notes file.", ["read_file", "search_note"], "auto"),
    ("Send an email about it.", ["send_email"], "required"),
]


def _print(text: str = "") -> None:
    print(text, flush=True)


def converse(base_url: str) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="demo", max_retries=0)
    tools = [POOL_BY_NAME[name].responses_tool() for name in CATALOG]
    history: list[dict] = [{"role": "system", "content": "You are a helpful agent."}]
    _print(f"catalog (sent every turn, unchanged): {', '.join(CATALOG)}")
    for index, (ask, allowed, mode) in enumerate(TURNS, 1):
        history.append({"role": "user", "content": ask})
        _print(f"\n--- turn {index}: allowed_tools {mode} {allowed}")
        _print(f"user      > {ask}")
        response = client.responses.create(
            model="tiny", input=history, tools=tools, max_output_tokens=80, temperature=0.0,
            tool_choice={"type": "allowed_tools", "mode": mode,
                         "tools": [{"type": "function", "name": name} for name in allowed]})
        for item in response.output:
            if item.type == "function_call":
                verdict = "allowed" if item.name in allowed else "NOT ALLOWED"
                _print(f"assistant > call {item.name}({item.arguments})   [{verdict}]")
                history.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                                "arguments": item.arguments})
                history.append({"type": "function_call_output", "call_id": item.call_id,
                                "output": json.dumps({"ok": True})})
                _print(f"tool      > {json.dumps({'ok': True})}")
            elif item.type == "message":
                text = "".join(part.text for part in item.content if part.type == "output_text")
                _print(f"assistant > {text!r}")
                history.append({"role": "assistant", "content": text})
        usage = response.usage
        _print(f"usage     : input {usage.input_tokens} tokens, "
               f"{usage.input_tokens_details.cached_tokens} served from the prefix cache")
    _contrast(client, tools)
    return 0


def _contrast(client, tools: list[dict]) -> None:
    """The same ask with and without a policy, and what an invalid selection gets."""
    import openai

    ask = [{"role": "system", "content": "You are a helpful agent."},
           {"role": "user", "content": "Please use delete_photo."}]
    _print("\n--- the user asks for delete_photo; this turn allows only get_weather")
    plain = client.responses.create(model="tiny", input=ask, tools=tools, max_output_tokens=60,
                                    temperature=0.0)
    names = [item.name for item in plain.output if item.type == "function_call"]
    _print(f"without a policy (plain auto) the model calls: {names or 'nothing'}")
    governed = client.responses.create(
        model="tiny", input=ask, tools=tools, max_output_tokens=60, temperature=0.0,
        tool_choice={"type": "allowed_tools", "mode": "auto",
                     "tools": [{"type": "function", "name": "get_weather"}]})
    names = [item.name for item in governed.output if item.type == "function_call"]
    _print(f"with allowed_tools auto [get_weather] it calls:  {names or 'nothing'}")
    _print("\n--- an invalid selection fails before the engine sees it")
    try:
        client.responses.create(
            model="tiny", input=ask, tools=tools,
            tool_choice={"type": "allowed_tools", "mode": "auto",
                         "tools": [{"type": "function", "name": "drop_database"}]})
    except openai.BadRequestError as error:
        body = error.body or {}
        _print(f"HTTP {error.status_code} param={body.get('param')!r}: {body.get('message')}")


def run_demo(model: Path, args: argparse.Namespace) -> int:
    """Serve `model` with the CLI's server options, then converse with it."""
    print(f"starting vllm serve with the plugin on {model} ...", file=sys.stderr, flush=True)
    with start_server(model, port=args.port, host=args.host, parser=args.parser,
                      log_path=args.log_file, timeout=args.timeout) as server:
        _print(f"server: {server.base_url} (log: {server.log_path})")
        return converse(server.base_url)
