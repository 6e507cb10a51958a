"""The same agent loop over Chat Completions: a stable catalog, a different allowed subset every
turn, and the dispatch guard between every returned call and the code that runs it.

    python examples/chat_agent.py --base-url http://127.0.0.1:8000/v1

Chat Completions nests the selection under ``tool_choice.allowed_tools`` and returns calls as
``message.tool_calls``; the application resolves the body it sent with ``api="chat"``, checks each
call with :class:`~vllm_allowed_tools.dispatch.Dispatcher`, and answers it with a ``role: tool``
message (the result, or the typed refusal the model can read).

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
    Turn("Who is my contact in Paris?", ["get_contact", "search_note"], "required"),
    Turn("What's the weather there on Monday?", ["get_weather"], "required"),
    Turn("Email the notes to them.", ["send_email", "read_file"], "auto"),
    Turn("Add a calendar entry for Friday.", ["create_calendar"], "required"),
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
    tools = [POOL_BY_NAME[name].chat_tool() for name in CATALOG]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful agent."}]
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
        messages.append({"role": "user", "content": turn.ask})
        out(f"user      > {turn.ask}")

        for _step in range(MAX_STEPS_PER_TURN):
            body = {
                "model": model, "messages": list(messages), "tools": tools,
                "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                    "mode": turn.mode,
                    "tools": [{"type": "function", "function": {"name": n}} for n in turn.allowed]}},
                "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0.0,
            }
            # The policy of *this* request, bound to who is asking.
            context = TurnContext.from_request(body, "chat", tenant=TENANT, session=session,
                                               subject=SUBJECT, turn_id=f"turn-{index}")
            message = client.chat.completions.create(**body).choices[0].message

            calls = list(message.tool_calls or [])
            if message.content:
                record.text += message.content
                out(f"assistant > {message.content!r}")
            if not calls:
                if message.content:
                    messages.append({"role": "assistant", "content": message.content})
                break
            messages.append({"role": "assistant", "content": message.content,
                             "tool_calls": [call.model_dump() for call in calls]})
            for call in calls:
                out(f"assistant > call {call.function.name}({call.function.arguments})")
                outcome = dispatcher.try_dispatch(call, context)
                messages.append(outcome.to_chat_message())
                code = None if outcome.ok else outcome.code
                record.calls.append(CallRecord(call.function.name, call.function.arguments,
                                               outcome.ok, code, outcome.to_tool_output()))
                verdict = "ran" if outcome.ok else f"REFUSED ({code})"
                out(f"dispatch  : {verdict}")
                out(f"tool      > {outcome.to_tool_output()}")
    return records


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
