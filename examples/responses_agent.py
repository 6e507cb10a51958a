"""An agent loop over the Responses API: a stable catalog, a different allowed subset every turn, and
the dispatch guard between every returned call and the code that runs it.

    python examples/responses_agent.py --base-url http://127.0.0.1:8000/v1

Each turn the agent sends the *same* full catalog (a stable, cacheable prompt prefix) and narrows it
with ``tool_choice: {"type": "allowed_tools", ...}``. Whatever the server returns, the application
checks it again before running anything: it resolves the very body it sent into a
:class:`~vllm_allowed_tools.dispatch.TurnContext` bound to tenant, session and caller, and
:class:`~vllm_allowed_tools.dispatch.Dispatcher` refuses a name outside this turn's subset, bad
JSON, arguments that break the schema, a caller the authorization hook denies, or a gated tool
without a live grant. The result (or the typed refusal) goes back to the model as the tool output.

Tool names come from ``vllm_allowed_tools.devtools.models.tool_pool`` (the names the tiny test models know);
the handlers are local fakes.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_app import (
    CATALOG,
    SUBJECT,
    TENANT,
    CallRecord,
    Turn,
    build_dispatcher,
    run_from_command_line,
)
from openai import OpenAI

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.dispatch import InMemoryGrantChecker, TurnContext

# This conversation's turns: the allowed subset changes, the catalog does not.
TURNS = [
    Turn("What's the weather on Friday?", ["get_weather", "get_contact"], "required"),
    Turn("Now read the notes file.", ["read_file", "search_note"], "auto"),
    Turn("Email the notes to me.", ["send_email"], "required"),
    Turn("Put it in my calendar and close the ticket.", ["create_calendar", "update_ticket"],
         "required"),
]
MAX_STEPS_PER_TURN = 2    # model requests per turn (a call, its result, maybe one more)


@dataclass
class TurnRecord:
    index: int
    ask: str
    mode: str
    allowed: list[str]
    calls: list[CallRecord] = field(default_factory=list)
    text: str = ""


# ---------------------------------------------------------------------------------- the loop


def run(base_url: str, *, model: str = "tiny", api_key: str = "local",
        out: Callable[[str], None] = print) -> list[TurnRecord]:
    """Run the conversation against ``base_url``; print the transcript; return what happened."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    session = f"session-{uuid.uuid4().hex[:8]}"
    grants = InMemoryGrantChecker()
    dispatcher = build_dispatcher(CATALOG, grants)
    tools = [POOL_BY_NAME[name].responses_tool() for name in CATALOG]
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful agent."}]
    records: list[TurnRecord] = []

    out(f"catalog (every turn, unchanged): {', '.join(CATALOG)}")
    for index, turn in enumerate(TURNS, 1):
        record = TurnRecord(index, turn.ask, turn.mode, list(turn.allowed))
        records.append(record)
        out(f"\n--- turn {index}: allowed_tools {turn.mode} {turn.allowed}")
        if "send_email" in turn.allowed:
            # the approvals layer would do this after asking the user; here the user said yes
            grants.grant(SUBJECT, session, "send_email", ttl_s=300)
            out("approval  : the user approved send_email for this session (5 minutes)")
        history.append({"role": "user", "content": turn.ask})
        out(f"user      > {turn.ask}")

        for _step in range(MAX_STEPS_PER_TURN):
            body = {
                "model": model, "input": list(history), "tools": tools,
                "tool_choice": {"type": "allowed_tools", "mode": turn.mode,
                                "tools": [{"type": "function", "name": n} for n in turn.allowed]},
                "parallel_tool_calls": False, "max_output_tokens": 80, "temperature": 0.0,
            }
            # The policy of *this* request, bound to who is asking.
            context = TurnContext.from_request(body, "responses", tenant=TENANT, session=session,
                                               subject=SUBJECT, turn_id=f"turn-{index}")
            response = client.responses.create(**body)

            calls = [item for item in response.output if item.type == "function_call"]
            for item in response.output:
                if item.type == "message":
                    text = "".join(part.text for part in item.content if part.type == "output_text")
                    if text:
                        record.text += text
                        out(f"assistant > {text!r}")
                        history.append({"role": "assistant", "content": text})
            if not calls:
                break
            for item in calls:
                out(f"assistant > call {item.name}({item.arguments})")
                outcome = dispatcher.try_dispatch(item, context)
                history.append({"type": "function_call", "call_id": item.call_id,
                                "name": item.name, "arguments": item.arguments})
                history.append(outcome.to_responses_item())
                code = None if outcome.ok else outcome.code
                record.calls.append(CallRecord(item.name, item.arguments, outcome.ok, code,
                                               outcome.to_tool_output()))
                verdict = "ran" if outcome.ok else f"REFUSED ({code})"
                out(f"dispatch  : {verdict}")
                out(f"tool      > {outcome.to_tool_output()}")
    return records


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
