"""Why a call is refused, and the error that says so (one wording for every guard)."""

from __future__ import annotations

from dataclasses import dataclass
from ..call_filter import CallFilter, CallKind
from ..errors import AllowedToolsError
from ..metrics import record_backstop

CODE_VIOLATION = "allowed_tools_violation"
SOURCE_UNREADABLE = "unreadable"   # metrics source of a response the guard could not read

#: what sending the same request again does after a refused call (the request itself was valid)
ON_RETRY = ("Sending the request again generates a new answer; with the same `seed` and sampling "
            "settings it is likely the same one, refused the same way.")

#: ``AllowedToolsViolation.reason`` of the backstops (a call's name is fine, the answer is not) and
#: the label they are counted under in ``vllm_allowed_tools:backstops_total``
REQUIRED_WITHOUT_CALL = "required_without_call"
ARGUMENTS_NOT_OBJECT = "arguments_not_object"
STRICT_ARGUMENTS_INVALID = "strict_arguments_invalid"
CUSTOM_INPUT_INVALID = "custom_input_invalid"

STREAM_MESSAGE = ("The model produced a tool call outside this turn's allowed tools. The call was "
                  f"withheld and the response stopped (allowed_tools_violation). {ON_RETRY}")


class AllowedToolsViolation(AllowedToolsError):
    """The model (or a parser) produced a call outside the turn's policy; nothing of it was sent.

    ``name`` is the offending flat name (None when the call had none), ``source`` the metrics label
    (``unary_guard`` / ``stream_guard`` / ``parser``), ``kind`` ``"function"`` or ``"custom"``;
    ``reason`` is set by a backstop (:data:`REQUIRED_WITHOUT_CALL`, :data:`ARGUMENTS_NOT_OBJECT`,
    :data:`STRICT_ARGUMENTS_INVALID`), None for a call outside the policy.
    """

    status = 500
    type = "server_error"
    code = CODE_VIOLATION

    def __init__(self, message: str, *, name: str | None, source: str,
                 kind: str = "function", reason: str | None = None) -> None:
        super().__init__(message, param=None)
        self.name = name
        self.source = source
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class ArgumentsRefusal:
    """Why a call's arguments are refused: ``reason`` (:data:`ARGUMENTS_NOT_OBJECT` or
    :data:`STRICT_ARGUMENTS_INVALID`), ``detail`` (may quote the arguments: unary messages only),
    ``paths`` (where a strict schema failed: what a streamed message may say)."""

    reason: str
    detail: str
    paths: tuple[str, ...] = ()


def record_reason(violation: AllowedToolsViolation) -> None:
    """Count a backstop's violation under its reason (the caller counts its source)."""
    if violation.reason is not None:
        record_backstop(violation.reason)


def _refusal_reason(call_filter: CallFilter, name: str | None, kind: CallKind) -> str:
    if name is None:
        return "has no name"
    if kind == "custom":
        return "is a custom tool, which this turn's policy does not allow"
    if kind == "builtin":
        return "is a built-in tool, which this turn's policy does not allow"
    if call_filter.knows(kind, name) is False:
        return "is not in the request's tool catalog"
    return "is not in this turn's allowed tools"


def refusal(call_filter: CallFilter, name: str | None, kind: CallKind, source: str, *,
            public_name: bool) -> AllowedToolsViolation:
    """The violation for a refused call; ``public_name``: the message may name the tool (a unary
    answer); a streamed message never does (the name is a byte of the withheld call)."""
    message = call_filter.refusal_message(kind, name, public_name=public_name)
    if message is None and public_name:
        shown = repr(name) if name is not None else "(unnamed)"
        message = (f"The model produced a call to {kind} tool {shown}, which "
                   f"{_refusal_reason(call_filter, name, kind)}. The response was withheld "
                   f"(allowed_tools_violation). {ON_RETRY}")
    elif message is None:
        message = STREAM_MESSAGE
    return AllowedToolsViolation(message, name=name, source=source, kind=kind)


def unreadable_violation(what: str) -> AllowedToolsViolation:
    """The violation for a response the guard cannot read while a policy applies (``what`` says
    which part: an unknown content type, a body that is not JSON, a stream event whose data is not
    a JSON object): it may hold a call, so it is refused like one (source ``unreadable``). Not
    counted here: the caller counts it when it refuses."""
    return AllowedToolsViolation(
        f"The response could not be checked against this turn's tools ({what}), so it was withheld "
        f"(allowed_tools_violation). This comes from how the server is set up, not from the "
        f"model: the same request sent again is refused the same way. Tell the server operator.",
        name=None, source=SOURCE_UNREADABLE, kind="unreadable")


def required_violation(requirement: str, source: str) -> AllowedToolsViolation:
    """The violation for an answer without a call on a turn that must call (``requirement`` says
    which ``tool_choice`` demanded it). An answer cut by the token limit never gets here."""
    message = (f"This turn must call a tool ({requirement}), but the model answered without a tool "
               f"call, so the answer was withheld (allowed_tools_violation, {REQUIRED_WITHOUT_CALL})."
               f" {ON_RETRY} To accept an answer in text, send `tool_choice: \"auto\"` (or "
               "`allowed_tools` in `auto` mode).")
    return AllowedToolsViolation(message, name=None, source=source, kind="no_call",
                                 reason=REQUIRED_WITHOUT_CALL)


def arguments_violation(refused: ArgumentsRefusal, name: str | None, source: str, *,
                        public_name: bool) -> AllowedToolsViolation:
    """The violation for a call whose arguments are refused; ``public_name`` as in :func:`refusal`
    (a streamed message names neither the tool nor any argument value)."""
    shown = f"function tool {name!r}" if public_name else "a function tool"
    if refused.reason == CUSTOM_INPUT_INVALID:
        shown = f"custom tool {name!r}" if public_name else "a custom tool"
        what = (f"The model produced a call to {shown} whose input its grammar does not admit"
                + (f" ({refused.detail})" if public_name and refused.detail else ""))
        after = "Custom tool inputs are checked against the tool's `format` grammar."
        message = (f"{what}. The answer was withheld (allowed_tools_violation, {refused.reason}). "
                   f"{ON_RETRY} {after}")
        return AllowedToolsViolation(message, name=name, source=source, kind="custom",
                                     reason=refused.reason)
    if refused.reason == STRICT_ARGUMENTS_INVALID:
        where = refused.detail if public_name else ", ".join(refused.paths) or "its arguments"
        what = (f"The model produced a call to {shown} with `strict: true` whose arguments do not "
                f"match its parameters schema ({where})")
        after = ("Strict arguments are constrained while decoding, so if this repeats, tell the "
                 "server operator.")
    else:
        why = refused.detail if public_name else "they do not parse as one JSON object"
        what = (f"The model produced a call to {shown} whose arguments are not a JSON object "
                f"({why}), so no client could run it")
        after = ("(Only the last call of an answer the token limit cut may be unfinished: that "
                 "answer stays incomplete, and a larger token limit lets the call finish.)")
    message = (f"{what}. The answer was withheld (allowed_tools_violation, {refused.reason}). "
               f"{ON_RETRY} {after}")
    return AllowedToolsViolation(message, name=name, source=source, reason=refused.reason)
