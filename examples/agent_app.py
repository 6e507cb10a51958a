"""The application side the three agent examples share: tool handlers, the authorization rule and
the dispatch guard every returned call goes through before it runs.

Each example (``responses_agent.py``, ``chat_agent.py``, ``agents_sdk_agent.py``) is the loop for
one client API; this file is what an application has no matter which API it talks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_allowed_tools.dispatch import Dispatcher, InMemoryGrantChecker, Invocation, allow, deny

TENANT, SUBJECT = "acme", "alice"   # from your own authentication, never from the model

# The catalog: sent unchanged every turn.
CATALOG = ["get_weather", "read_file", "send_email", "create_calendar", "search_note",
           "update_ticket", "get_contact", "delete_photo"]


@dataclass(frozen=True)
class Turn:
    ask: str
    allowed: list[str]   # this turn's subset of CATALOG
    mode: str            # "auto" (text or an allowed call) or "required" (an allowed call)


def fake_handler(name: str) -> Callable[[dict[str, Any], Invocation], Any]:
    """A local stand-in for the real tool: it only reports what it was asked to do."""
    def handle(arguments: dict[str, Any], invocation: Invocation) -> dict[str, Any]:
        return {"ok": True, "tool": name, "done_for": invocation.subject, **arguments}
    return handle


def authorize(invocation: Invocation):
    """The application's own rules, with the caller's identity and the parsed arguments."""
    if invocation.name == "delete_photo" and invocation.subject != "admin":
        return deny("only admins may delete photos")
    return allow()


def build_dispatcher(catalog: Iterable[str], grants: InMemoryGrantChecker) -> Dispatcher:
    """Handlers for the catalog; ``send_email`` is gated (it needs a live grant)."""
    return Dispatcher({name: fake_handler(name) for name in catalog}, authorize=authorize,
                      gated=["send_email"], grants=grants)


@dataclass
class CallRecord:
    name: str
    arguments: str
    ok: bool
    code: str | None       # the refusal's code, None when the call ran
    output: str            # what was sent back to the model


def run_from_command_line(run: Callable[..., list[Any]], doc: str | None,
                          argv: list[str] | None = None) -> int:
    """``main()`` of every example: run the conversation against ``--base-url`` and sum it up."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's /v1 URL")
    parser.add_argument("--model", default="tiny", help="served model name (default: tiny)")
    parser.add_argument("--api-key", default="local")
    args = parser.parse_args(argv)
    records = run(args.base_url, model=args.model, api_key=args.api_key)
    calls = [call for record in records for call in record.calls]
    print(f"\n{len(calls)} calls, {sum(c.ok for c in calls)} ran, "
          f"{sum(not c.ok for c in calls)} refused")
    return 0
