"""The agent's tools: local stand-ins that change something the person can see on the page.

Each person's :class:`Desk` holds what their tools did (emails in the outbox, calendar entries,
deleted files, weather looked up), so a released call is visible the moment it runs. Every call
goes through the package's dispatch guard first (:class:`~vllm_allowed_tools.dispatch.Dispatcher`):
the name must be one this turn allowed and the arguments must match the schema, whatever the
server returned. Whether a gated call may run at all is the server's decision (it releases it only
after an approval or under a grant); the app never decides that itself.

The definitions are what the model reads: plain names, one-line descriptions and argument names a
person would use (``send_email(recipient, subject, body)``: named ``to``, SmolLM2 writes an address
it invents, ``john@example.com``), every argument required, no examples in the
descriptions (a small model copies an example instead of reading the request), and bounded string
lengths (the server holds each call's arguments to the schema, so a small model cannot run on in a
free-text field until the token limit). They are ``strict``: the server's output guard also refuses
any call off the schema, the right promise for tools that act on a person's behalf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_allowed_tools.dispatch import Dispatcher, DispatchError, Invocation, TurnContext, allow_all


def _text(name: str, description: str) -> dict[str, Any]:
    return {"type": "string", "description": description, "maxLength": LONGEST.get(name, SHORT)}


#: the longest value of each argument, in characters (default: :data:`SHORT`): a small model may
#: run on in a free-text field until the token limit; a bound makes the server close the string
SHORT, LONGEST = 80, {"body": 160}

#: name -> (description, {argument: description}); every argument is a required string
SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "get_weather": ("Get the weather forecast for a city.",
                    {"city": "The name of the city"}),
    "add_calendar_event": ("Add an event to the user's calendar.",
                           {"title": "A short title for the event", "day": "The day of the event",
                            "time": "The time the event starts"}),
    "send_email": ("Send an email from the user's account.",
                   {"recipient": "Who the email is for",
                    "subject": "What the email is about",
                    "body": "The text of the email, one or two sentences"}),
    "delete_file": ("Delete a file from the user's files.",
                    {"path": "The name of the file to delete"}),
}

#: every tool the agent offers, each turn (a stable catalog; the turn narrows it)
CATALOG = tuple(SPECS)


def tool_definitions() -> list[dict[str, Any]]:
    """The Responses function tools of :data:`CATALOG`, sent unchanged every request (a stable
    prefix the server's prompt cache reuses; each turn's ``allowed_tools`` narrows it)."""
    return [{"type": "function", "name": name, "description": description, "strict": True,
             "parameters": {"type": "object",
                            "properties": {arg: _text(arg, text) for arg, text in arguments.items()},
                            "required": list(arguments), "additionalProperties": False}}
            for name, (description, arguments) in SPECS.items()]


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


def _handlers(desk: Desk) -> dict[str, Callable[[dict[str, Any], Invocation], Any]]:
    def get_weather(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.weather.append(f"{arguments['city']}: sunny, 21 °C")
        return {"city": arguments["city"], "forecast": "sunny", "temperature_c": 21}

    def add_calendar_event(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.calendar.append(f"{arguments['day']} {arguments['time']}: {arguments['title']}")
        return {"added": True, **arguments}

    def send_email(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.outbox.append(f"To {arguments['recipient']}: {arguments['subject']} — "
                           f"{arguments['body']}")
        return {"sent": True, "recipient": arguments["recipient"], "subject": arguments["subject"]}

    def delete_file(arguments: dict[str, Any], _: Invocation) -> dict[str, Any]:
        desk.deleted.append(arguments["path"])
        return {"deleted": True, "path": arguments["path"]}

    return {"get_weather": get_weather, "add_calendar_event": add_calendar_event,
            "send_email": send_email, "delete_file": delete_file}


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
