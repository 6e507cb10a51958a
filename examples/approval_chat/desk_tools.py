"""The agent's tools: local stand-ins that change something the person can see on the page.

Each person's :class:`Desk` holds what their tools did (emails in the outbox, calendar entries,
deleted files, weather looked up), so a released call is visible the moment it runs. Every call
goes through the package's dispatch guard first (:class:`~vllm_allowed_tools.dispatch.Dispatcher`):
the name must be one this turn allowed and the arguments must match the schema, whatever the
server returned. Whether a gated call may run at all is the server's decision (it releases it only
after an approval or under a grant); the app never decides that itself.

Names and argument enums come from ``vllm_allowed_tools.testing.tool_pool``: the tiny test model
only knows those names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_allowed_tools.dispatch import Dispatcher, DispatchError, Invocation, TurnContext, allow_all
from vllm_allowed_tools.testing.tool_pool import POOL_BY_NAME

#: every tool the agent offers, each turn (a stable catalog; the turn narrows it)
CATALOG = ("get_weather", "create_calendar", "send_email", "delete_file")


@dataclass
class Desk:
    """What one person's tools changed, shown beside the chat."""

    outbox: list[str] = field(default_factory=list)
    calendar: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    weather: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, list[str]]:
        return {"outbox": list(self.outbox), "calendar": list(self.calendar),
                "deleted": list(self.deleted), "weather": list(self.weather)}


def _describe(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(arguments.items()))


def _handlers(desk: Desk) -> dict[str, Callable[[dict[str, Any], Invocation], Any]]:
    def get_weather(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.weather.append(f"forecast looked up ({_describe(arguments)}): sunny")
        return {"forecast": "sunny", **arguments}

    def create_calendar(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.calendar.append(f"meeting on {arguments['day']}")
        return {"created": True, **arguments}

    def send_email(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.outbox.append(f"email sent ({_describe(arguments)})")
        return {"sent": True, **arguments}

    def delete_file(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.deleted.append(f"file deleted ({_describe(arguments)})")
        return {"deleted": True, **arguments}

    return {"get_weather": get_weather, "create_calendar": create_calendar,
            "send_email": send_email, "delete_file": delete_file}


def tool_definitions() -> list[dict[str, Any]]:
    """The Responses function tools of :data:`CATALOG`, sent unchanged every request."""
    return [POOL_BY_NAME[name].responses_tool() for name in CATALOG]


@dataclass(frozen=True)
class ToolRun:
    """One executed (or refused) call, as the page shows it and the model reads it."""

    call_id: str
    name: str
    ok: bool
    output: str


class DeskTools:
    """One person's tools: their desk and the dispatch guard in front of its handlers."""

    def __init__(self, person: str) -> None:
        self.person = person
        self.desk = Desk()
        self._dispatcher = Dispatcher(_handlers(self.desk), authorize=allow_all)

    def run(self, call: dict[str, Any], request_body: dict[str, Any], session: str) -> ToolRun:
        """Run one released ``function_call`` item of the response to ``request_body``: the turn
        context is that body, so only a call this request allowed can run."""
        turn = TurnContext.from_request(request_body, "responses", tenant="approval-chat",
                                        session=session, subject=self.person)
        outcome = self._dispatcher.try_dispatch(call, turn)
        ok = not isinstance(outcome, DispatchError)
        return ToolRun(call_id=str(call.get("call_id")), name=str(call.get("name")), ok=ok,
                       output=outcome.to_tool_output())
