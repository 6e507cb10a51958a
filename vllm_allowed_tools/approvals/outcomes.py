"""What the approval engine decides for one call, as values the glue acts on.

:class:`Release` (the call goes out), :class:`Decline` (the model sees why it did not), and for an
answer that changes nothing, :class:`Replayed` or :class:`Rejected`. Each says whether the call
executes, so the glue never has to reason about approvals itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..request import FunctionSpec, ToolIdentity
from ..request.identity import ToolKind
from .digests import definition_digest as compute_definition_digest
from .approval_errors import ApprovalInputError
from .store import ElicitationRecord

__all__ = ["Decline", "DeclineCause", "Outcome", "ProposedCall", "Rejected", "Release", "Replayed",
           "call_item"]


@dataclass(frozen=True)
class ProposedCall:
    """One tool call a model produced, with the definition it was produced against.

    ``arguments`` is the JSON text exactly as the model emitted it (it is what a release hands on);
    for a ``custom`` tool (``kind``), the call's raw ``input``.
    ``hint`` is the tool definition's ``approval`` object (:func:`~.hints.approval_hint`), and
    ``hint_param`` where it sits in the request (for 400 messages).
    """

    call_id: str
    identity: ToolIdentity
    arguments: str
    definition_digest: str
    hint: Mapping[str, Any] | None = None
    hint_param: str = "approval"
    kind: ToolKind = "function"

    @classmethod
    def from_spec(cls, spec: FunctionSpec, *, call_id: str, arguments: str,
                  hint: Mapping[str, Any] | None = None, hint_param: str = "approval") -> ProposedCall:
        return cls(call_id=call_id, identity=spec.identity, arguments=arguments,
                   definition_digest=compute_definition_digest(spec), hint=hint,
                   hint_param=hint_param, kind=spec.kind)

    @property
    def flat_name(self) -> str:
        return self.identity.flat_name


@dataclass(frozen=True)
class Release:
    """The call may go out (be executed, or be handed to the client that executes it).

    ``via``: ``policy`` (not gated), ``grant`` (a live grant, ``grant_id``), ``approval`` (an
    ``accept`` just consumed; ``scope``, ``elicitation_id``, and ``grant_id`` when one was minted).
    The call fields come from the server's record, never from the client.
    """

    call_id: str
    name: str
    namespace: str | None
    arguments: str
    arguments_digest: str
    definition_digest: str
    via: Literal["policy", "grant", "approval"]
    scope: str | None = None
    grant_id: str | None = None
    elicitation_id: str | None = None
    #: ``custom``: the call is a ``custom_tool_call`` whose ``input`` is ``arguments``
    tool_type: ToolKind = "function"

    executes: bool = field(default=True, init=False)

    @property
    def flat_name(self) -> str:
        return ToolIdentity(self.namespace, self.name).flat_name

    def call_item(self) -> dict[str, Any]:
        """The Responses item of the released call (no ``id``: the glue adds one): a
        ``function_call``, or a ``custom_tool_call`` for a custom tool."""
        return call_item(self.tool_type, self.call_id, self.name, self.namespace, self.arguments)

    function_call_item = call_item   # the name from before custom tools: a function's item


DeclineCause = Literal["declined", "cancelled", "expired", "unanswered", "definition_changed",
                       "not_approvable"]

_DECLINE_TEXT: Mapping[str, str] = {
    "declined": "The user declined this tool call; it was not executed.",
    "cancelled": "The user declined this tool call; it was not executed.",
    "unanswered": "The user did not approve this tool call; it was not executed.",
    "expired": "The approval request for this tool call expired before it was approved; the tool "
               "call was not executed.",
    "definition_changed": "The tool's definition changed after approval was requested; the tool "
                          "call was not executed.",
    "not_approvable": "This tool call needs an approval that cannot be given here; it was not "
                      "executed.",
}


@dataclass(frozen=True)
class Decline:
    """A terminal refusal the model must see as the call's result (``tool_output``)."""

    call_id: str
    name: str
    namespace: str | None
    arguments: str
    cause: DeclineCause
    reason: str | None
    tool_output: str
    elicitation_id: str | None = None
    tool_type: ToolKind = "function"

    executes: bool = field(default=False, init=False)

    @classmethod
    def of(cls, record: ElicitationRecord | None, cause: DeclineCause, reason: str | None = None, *,
           call: ProposedCall | None = None) -> Decline:
        text = _DECLINE_TEXT[cause]
        if reason and cause == "declined":
            text += f" Reason given: {reason}"
        if record is not None:
            return cls(call_id=record.call_id, name=record.name, namespace=record.namespace,
                       arguments=record.arguments, cause=cause,
                       reason=reason if cause == "declined" else None, tool_output=text,
                       elicitation_id=record.id, tool_type=record.tool_type)
        assert call is not None
        return cls(call_id=call.call_id, name=call.identity.name, namespace=call.identity.namespace,
                   arguments=call.arguments, cause=cause, reason=None, tool_output=text,
                   tool_type=call.kind)

    def call_item(self) -> dict[str, Any]:
        """The declined call as the model made it (``function_call`` or ``custom_tool_call``)."""
        return call_item(self.tool_type, self.call_id, self.name, self.namespace, self.arguments)

    def output_item(self) -> dict[str, Any]:
        """The item the model sees as this call's result: a ``function_call_output``, or a
        ``custom_tool_call_output`` for a custom tool's call."""
        kind = "custom_tool_call_output" if self.tool_type == "custom" else "function_call_output"
        return {"type": kind, "call_id": self.call_id, "output": self.tool_output}

    function_call_output_item = output_item   # the name from before custom tools

    def chat_tool_message(self) -> dict[str, Any]:
        """The same, as a Chat Completions ``tool`` message."""
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.tool_output}


def call_item(kind: str, call_id: str, name: str, namespace: str | None,
              arguments: str) -> dict[str, Any]:
    """A completed Responses call item (no ``id``): ``function_call`` with ``arguments``, or for a
    ``custom`` tool ``custom_tool_call`` with ``input`` (a custom tool is top level: no namespace)."""
    if kind == "custom":
        return {"type": "custom_tool_call", "call_id": call_id, "name": name, "input": arguments,
                "status": "completed"}
    item: dict[str, Any] = {"type": "function_call", "call_id": call_id, "name": name,
                            "arguments": arguments, "status": "completed"}
    if namespace is not None:
        item["namespace"] = namespace
    return item


@dataclass(frozen=True)
class Replayed:
    """The same answer again (kept in the transcript's history, or retried): nothing new happens.

    ``release``: for a repeated ``accept`` whose call is not in the request's history, the release
    the first answer made, identical (same call id, arguments and grant id; no new grant): the
    wire answers with it again, so a lost reply loses nothing. None otherwise."""

    elicitation_id: str
    response_id: str
    status: str
    release: Release | None = None
    executes: bool = field(default=False, init=False)


@dataclass(frozen=True)
class Rejected:
    """A response that lost the race for its elicitation: nothing happens (``error`` says why)."""

    elicitation_id: str
    response_id: str
    error: ApprovalInputError
    executes: bool = field(default=False, init=False)


Outcome = Release | Decline | Replayed | Rejected
