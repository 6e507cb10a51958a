"""The agent loop on the OpenAI Agents SDK (``openai-agents``): a stable catalog, a different allowed
subset every turn, and the dispatch guard between every returned call and the code that runs it.

    python examples/agents_sdk_agent.py --base-url http://127.0.0.1:8000/v1

The SDK has no typed field for ``allowed_tools`` (``ModelSettings.tool_choice`` takes a string or a
tool name), so the selection rides in ``ModelSettings(extra_args={"tool_choice": {...}})``, which
:class:`~agents.OpenAIResponsesModel` passes verbatim to ``responses.create`` on **every** request
of a run, the follow-ups after a tool result included (the SDK only resets its own typed
``tool_choice`` after a call). Each user turn is one ``Runner.run`` of a clone of the agent with that
turn's settings; the agent's tools never change, so the catalog the model sees is the same every
turn (the SDK sends them as ``strict: true`` function tools).

The SDK runs function tools itself. Here every tool's ``on_invoke_tool`` is the dispatch guard: it
takes the request body the SDK actually sent (recorded by an ``httpx`` request hook on the client),
resolves it into a :class:`~vllm_allowed_tools.dispatch.TurnContext` bound to tenant, session and
caller, and lets :class:`~vllm_allowed_tools.dispatch.Dispatcher` refuse a name outside the
subset, bad JSON, arguments that break the schema, a caller the authorization hook denies, or a
gated tool without a live grant. The result (or the typed refusal) is the tool output the model
reads next.

``mode: "required"`` in ``extra_args`` holds for every request of the run too, so a run in required
mode can never end with text: such turns stop at the first tool result
(``tool_use_behavior="stop_on_first_tool"``); ``auto`` turns let the model read the result and go
on, at most ``MAX_STEPS_PER_TURN`` model requests per turn.

Tool names come from ``vllm_allowed_tools.devtools.models.tool_pool`` (the names the tiny test models know);
the handlers are local fakes. Tracing is switched off: the SDK would upload traces to OpenAI.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from agent_app import (
    CATALOG,
    SUBJECT,
    TENANT,
    CallRecord,
    Turn,
    build_dispatcher,
    run_from_command_line,
)
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    RunErrorHandlerInput,
    RunErrorHandlerResult,
    Runner,
    set_tracing_disabled,
)
from agents.tool_context import ToolContext
from openai import AsyncOpenAI

from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.dispatch import Dispatcher, InMemoryGrantChecker, TurnContext

# The catalog: the agent's tools, unchanged every turn.
# This conversation's turns: the allowed subset changes, the catalog does not.
TURNS = [
    Turn("Find my notes about the trip.", ["search_note", "read_file"], "auto"),
    Turn("What's the weather in Lima on Sunday?", ["get_weather"], "required"),
    Turn("Send the summary to Carol.", ["send_email", "get_contact"], "required"),
    Turn("Open a ticket for the broken photo upload.", ["update_ticket", "delete_photo"], "auto"),
]
MAX_STEPS_PER_TURN = 2    # model requests per turn in auto mode (a call, its result, maybe one more)


@dataclass
class TurnRecord:
    index: int
    ask: str
    mode: str
    allowed: list[str]
    calls: list[CallRecord] = field(default_factory=list)
    tool_choices: list[Any] = field(default_factory=list)   # tool_choice of each request sent
    final_output: str = ""


class SentRequests:
    """An ``httpx`` request hook that keeps the last ``/responses`` body the SDK sent: the policy
    the returned calls are checked against is the one the server was asked to enforce."""

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    async def __call__(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/responses"):
            self.last = json.loads(request.content)
            for listener in self.listeners:
                listener(self.last)


@dataclass
class AppState:
    """What the tools need at call time: who is asking, in which session, and this turn's record."""

    dispatcher: Dispatcher
    sent: SentRequests
    session: str
    record: TurnRecord | None = None
    out: Callable[[str], None] = print


def guarded_tool(name: str, state: AppState) -> FunctionTool:
    """The catalog tool ``name`` as the SDK sees it; invoking it goes through the dispatch guard."""
    spec = POOL_BY_NAME[name]

    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> str:
        body = state.sent.last or {}
        turn = TurnContext.from_request(body, "responses", tenant=TENANT, session=state.session,
                                        subject=SUBJECT, turn_id=f"turn-{state.record.index}")
        call = ctx.tool_call if ctx.tool_call is not None else {
            "type": "function_call", "name": ctx.tool_name, "arguments": arguments,
            "call_id": ctx.tool_call_id, "namespace": ctx.tool_namespace}
        state.out(f"assistant > call {ctx.tool_name}({arguments})")
        outcome = state.dispatcher.try_dispatch(call, turn)
        code = None if outcome.ok else outcome.code
        state.record.calls.append(CallRecord(ctx.tool_name, arguments, outcome.ok, code,
                                             outcome.to_tool_output()))
        state.out(f"dispatch  : {'ran' if outcome.ok else f'REFUSED ({code})'}")
        state.out(f"tool      > {outcome.to_tool_output()}")
        return outcome.to_tool_output()

    return FunctionTool(name=spec.name, description=spec.description,
                        params_json_schema=spec.parameters, on_invoke_tool=on_invoke_tool,
                        strict_json_schema=True)


def turn_settings(turn: Turn) -> ModelSettings:
    return ModelSettings(
        temperature=0.0, max_tokens=80, parallel_tool_calls=False,
        extra_args={"tool_choice": {"type": "allowed_tools", "mode": turn.mode,
                                    "tools": [{"type": "function", "name": n}
                                              for n in turn.allowed]}})


def step_budget_reached(data: RunErrorHandlerInput[Any]) -> RunErrorHandlerResult:
    """An auto turn that is still calling tools after MAX_STEPS_PER_TURN requests ends here."""
    return RunErrorHandlerResult(final_output="(step budget for this turn reached)")


# ---------------------------------------------------------------------------------- the loop


async def run_async(base_url: str, *, model: str = "tiny", api_key: str = "local",
                    out: Callable[[str], None] = print) -> list[TurnRecord]:
    set_tracing_disabled(True)
    sent = SentRequests()
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120,
                         http_client=httpx.AsyncClient(event_hooks={"request": [sent]}))
    session = f"session-{uuid.uuid4().hex[:8]}"
    grants = InMemoryGrantChecker()
    state = AppState(build_dispatcher(CATALOG, grants), sent, session, out=out)
    sent.listeners.append(lambda body: state.record.tool_choices.append(body.get("tool_choice")))
    agent = Agent(name="assistant", instructions="You are a helpful agent.",
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  tools=[guarded_tool(name, state) for name in CATALOG])
    history: list[Any] = []
    records: list[TurnRecord] = []

    out(f"catalog (every turn, unchanged): {', '.join(CATALOG)}")
    try:
        for index, turn in enumerate(TURNS, 1):
            state.record = record = TurnRecord(index, turn.ask, turn.mode, list(turn.allowed))
            records.append(record)
            out(f"\n--- turn {index}: allowed_tools {turn.mode} {turn.allowed}")
            if "send_email" in turn.allowed:
                # the approvals layer would do this after asking the user; here the user said yes
                grants.grant(SUBJECT, session, "send_email", ttl_s=300)
                out("approval  : the user approved send_email for this session (5 minutes)")
            out(f"user      > {turn.ask}")
            turn_agent = agent.clone(
                model_settings=turn_settings(turn),
                tool_use_behavior="stop_on_first_tool" if turn.mode == "required" else "run_llm_again")
            result = await Runner.run(turn_agent, [*history, {"role": "user", "content": turn.ask}],
                                      max_turns=MAX_STEPS_PER_TURN,
                                      error_handlers={"max_turns": step_budget_reached})
            record.final_output = str(result.final_output)
            out(f"result    > {record.final_output!r}")
            history = result.to_input_list()
    finally:
        await client.close()
    return records


def run(base_url: str, *, model: str = "tiny", api_key: str = "local",
        out: Callable[[str], None] = print) -> list[TurnRecord]:
    """Run the conversation against ``base_url``; print the transcript; return what happened."""
    return asyncio.run(run_async(base_url, model=model, api_key=api_key, out=out))


def main(argv: list[str] | None = None) -> int:
    return run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
