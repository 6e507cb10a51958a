"""The application side the three agent examples share: tool handlers, the authorization rule and
the dispatch guard every returned call goes through before it runs.

Each example (``responses_agent.py``, ``chat_agent.py``, ``agents_sdk_agent.py``) is the loop for
one client API; this file is what an application has no matter which API it talks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_allowed_tools.dispatch import Dispatcher, InMemoryGrantChecker, Invocation, allow, deny

TENANT, SUBJECT = "acme", "alice"   # from your own authentication, never from the model


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
