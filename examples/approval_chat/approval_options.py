"""The choices an approval prompt offers, each with a label and what choosing it means.

The proposal asks clients to "clearly explain the implication behind each option". An elicitation
says which scopes the server offers; how long a grant lives and whether it covers other arguments
is the operator's policy, so the explanation names those only when the app knows the policy (it
started the server itself, or was given ``--policy``). Otherwise it says what holds in general.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_allowed_tools.approvals.policy import ApprovalPolicy
from vllm_allowed_tools.request import ToolIdentity


@dataclass(frozen=True)
class Option:
    action: str              # accept / decline / cancel
    scope: str | None        # with accept: once / session / always
    label: str
    meaning: str

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "scope": self.scope, "label": self.label,
                "meaning": self.meaning}


def _lifetime(seconds: int | None) -> str:
    if seconds is None:
        return "until it expires"
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds // size
            return f"for {count} {unit}{'s' if count != 1 else ''}"
    return f"for {seconds} seconds"


class ApprovalOptions:
    """Builds the options of one prompt; ``policy`` (may be None) is the server's policy file."""

    def __init__(self, policy: ApprovalPolicy | None) -> None:
        self._policy = policy

    def needs_approval(self, name: str, namespace: str | None = None) -> bool | None:
        """Whether the policy gates ``name`` (before any definition hint); None without a policy."""
        if self._policy is None:
            return None
        return self._policy.effective(ToolIdentity(namespace, name)).required

    def for_prompt(self, name: str, namespace: str | None,
                   requested_scopes: list[str]) -> list[Option]:
        tool = ToolIdentity(namespace, name).flat_name
        lifetimes: dict[str, int] = {}
        bound: bool | None = None
        if self._policy is not None:
            effective = self._policy.effective(ToolIdentity(namespace, name))
            lifetimes, bound = dict(effective.grant_expires_in), effective.bind_arguments
        which = {True: f"only {tool} calls with exactly these arguments",
                 False: f"{tool} calls with any arguments",
                 None: f"{tool} calls (the server may limit this to these same arguments)"}[bound]
        revoke = "or until you revoke it on My approvals"
        options = []
        if "once" in requested_scopes:
            options.append(Option("accept", "once", "Allow once",
                                  f"Runs this call now, this once. The next {tool} call asks you "
                                  "again. Nothing is remembered."))
        if "session" in requested_scopes:
            options.append(Option("accept", "session", "Allow for this session",
                                  f"Runs this call now, and lets {which} run in this chat without "
                                  f"asking, {_lifetime(lifetimes.get('session'))} {revoke}. "
                                  "A new chat asks again."))
        if "always" in requested_scopes:
            options.append(Option("accept", "always", "Always allow",
                                  f"Runs this call now, and lets {which} run without asking in "
                                  "every chat signed in with your API key, "
                                  f"{_lifetime(lifetimes.get('always'))} {revoke}."))
        options.append(Option("decline", None, "Decline",
                              "The call does not run. The assistant is told you declined it, with "
                              "your reason if you write one, and answers without it."))
        options.append(Option("cancel", None, "Cancel",
                              "The call does not run and no reason is sent: the assistant is only "
                              "told it was not run."))
        return options
