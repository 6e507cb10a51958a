"""A client of a server with approvals on: its environment (an operator policy gating one tool),
the turns that ask for the gated tool or only a free one, and what each answer showed the client."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME

from ..calls import chat_selection, responses_selection
from .fuzz_cases import FUZZ_MAX_TOKENS
from .wire import PATHS, base_body, error_of, read_payload

GATED_TOOL, FREE_TOOL = "send_email", "get_weather"
APPROVAL_POLICY = {"rules": [{"tools": [GATED_TOOL], "approval": "required",
                              "scopes": ["once", "session"]}]}
STORE_TIMEOUT_S = 1.0          # the server's grant-store timeout in these runs (busy/lock waits)
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def approval_env(folder: Path, store: str | None = None) -> dict[str, str]:
    """The environment of a server with approvals on: policy file in `folder`, the store at
    `store` (default `folder/store/grants.db`)."""
    folder.mkdir(parents=True, exist_ok=True)
    policy = folder / "approvals.json"
    policy.write_text(json.dumps(APPROVAL_POLICY))
    if store is None:
        (folder / "store").mkdir(exist_ok=True)
        store = str(folder / "store" / "grants.db")
    return {"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy),
            "VLLM_ALLOWED_TOOLS_GRANT_STORE": store,
            "VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT": str(STORE_TIMEOUT_S)}


def _approval_tools(api: str) -> list[dict]:
    pick = "responses_tool" if api == "responses" else "chat_tool"
    return [getattr(POOL_BY_NAME[GATED_TOOL], pick)(), getattr(POOL_BY_NAME[FREE_TOOL], pick)()]


def gated_body(session: str, *history: dict, stream: bool = False) -> dict:
    """A Responses turn whose only allowed tool is the gated one (required: it will call it)."""
    return {"model": "tiny", "input": list(history) or "Send it.", "tools": _approval_tools("responses"),
            "tool_choice": responses_selection("required", [GATED_TOOL]),
            "parallel_tool_calls": False, "max_output_tokens": FUZZ_MAX_TOKENS, "temperature": 1.0,
            "prompt_cache_key": session, "stream": stream}


def free_body(api: str, stream: bool = False) -> dict:
    """A turn with the gated tool in the catalog but only the free one allowed."""
    body = base_body(api, 60)
    body.update(tools=_approval_tools(api), parallel_tool_calls=False, stream=stream,
                tool_choice=(responses_selection if api == "responses" else chat_selection)(
                    "required", [FREE_TOOL]))
    return body


def accept_input(elicitation: dict, response_id: str, scope: str = "session") -> list[dict]:
    return [{"role": "user", "content": "Send it."}, elicitation,
            {"id": response_id, "type": "elicitation_response", "elicitation_id": elicitation["id"],
             "action": "accept", "scope": scope}]


@dataclass
class Answer:
    status: int | None
    items: list[dict] = field(default_factory=list)      # Responses output items (final)
    events: list[dict] = field(default_factory=list)     # stream events
    error: dict | None = None                            # error body, or response.failed's error
    leaked: int = 0                                      # gated calls the client was shown
    transport_error: str | None = None


def _gated_items(items: list[dict]) -> int:
    return sum(1 for item in items if item.get("type") == "function_call"
               and item.get("name") == GATED_TOOL)


def _post_unary(client: httpx.Client, url: str, api: str, body: dict) -> Answer:
    response = client.post(url, json=body)
    payload = read_payload(response.content)
    answer = Answer(response.status_code)
    if response.status_code != 200:
        answer.error = error_of(payload)
    elif api == "chat":
        message = ((payload.get("choices") or [{}])[0].get("message") or {})
        calls = [c.get("function", {}).get("name") for c in message.get("tool_calls") or []]
        answer.leaked = calls.count(GATED_TOOL)
    else:
        answer.items = list(payload.get("output") or [])
        answer.leaked = _gated_items(answer.items)
    return answer


def _fold_events(api: str, answer: Answer) -> None:
    """The final items, the error and the gated calls shown in a stream's events."""
    shown: list[Any] = []
    for event in answer.events:
        if api == "chat":
            for choice in event.get("choices") or []:
                shown += [(c.get("function") or {}).get("name")
                          for c in (choice.get("delta") or {}).get("tool_calls") or []]
            continue
        if isinstance(event.get("item"), dict):
            shown.append(event["item"])
        if isinstance(event.get("response"), dict):
            if event["type"] == "response.failed":
                answer.error = event["response"].get("error")
            if event["type"] in TERMINAL_EVENTS:
                answer.items = list(event["response"].get("output") or [])
    if api == "chat":
        answer.leaked = shown.count(GATED_TOOL)
    else:
        answer.leaked = _gated_items(shown) + _gated_items(answer.items)


def _post_stream(client: httpx.Client, url: str, api: str, body: dict) -> Answer:
    with client.stream("POST", url, json=body) as response:
        answer = Answer(response.status_code)
        if response.status_code != 200:
            answer.error = error_of(read_payload(response.read()))
            return answer
        for line in response.iter_lines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                answer.events.append(json.loads(line[6:]))
    _fold_events(api, answer)
    return answer


def post_approval(client: httpx.Client, base_url: str, api: str, body: dict) -> Answer:
    """Send one request; collect items, the error and every gated call shown to the client (an
    output item, a stream's added/done item, or a call in the final object)."""
    post = _post_stream if body.get("stream") else _post_unary
    try:
        return post(client, base_url + PATHS[api], api, body)
    except httpx.HTTPError as exc:
        return Answer(None, transport_error=f"{type(exc).__name__}: {exc}")


def ask(client: httpx.Client, base_url: str, session: str) -> Answer:
    """A gated turn in `session` (unary)."""
    return post_approval(client, base_url, "responses", gated_body(session))


def elicitation_of(answer: Answer) -> dict | None:
    """The one elicitation a 200 answer asked (None otherwise)."""
    found = [item for item in answer.items if item.get("type") == "elicitation"]
    return found[0] if answer.status == 200 and len(found) == 1 else None


def made_no_call(answer: Answer) -> bool:
    """A 200 turn in which the random model made no call at all (cut off by max tokens: vLLM's
    parser then returns the markup as text)."""
    return answer.status == 200 and not any(
        i.get("type") in ("function_call", "elicitation") for i in answer.items)


def ask_until_called(client: httpx.Client, base_url: str, session: str, tries: int = 5,
                     sent: Counter | None = None) -> Answer:
    """Ask until the model makes a call (the random model sometimes makes none); each request
    sent is counted in ``sent["kill_requests"]`` when given."""
    for _ in range(tries):
        answer = ask(client, base_url, session)
        if sent is not None:
            sent["kill_requests"] += 1
        if not made_no_call(answer):
            return answer
    return answer
