"""The guard for a whole (unary) answer: refuse it when it holds a call outside the policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..metrics import record_violation
from ..request import flat_name
from .calls import chat_call_identity, item_identity
from .violations import AllowedToolsViolation, CallFilter, is_call_allowed, refusal


def responses_violation(body: Any, call_filter: Any, source: str, *,
                        public_name: bool) -> AllowedToolsViolation | None:
    """The violation of the first refused call in a Responses object's ``output``, else None."""
    output = body.get("output") if isinstance(body, Mapping) else None
    for item in output if isinstance(output, list) else ():
        if isinstance(item, Mapping):
            identity = item_identity(item)
            if identity is not None and not is_call_allowed(call_filter, identity[1], identity[0]):
                return refusal(call_filter, identity[1], identity[0], source, public_name=public_name)
    return None


def check_responses_object(body: Mapping[str, Any], call_filter: CallFilter, *,
                           source: str = "unary_guard") -> None:
    """Raise :class:`AllowedToolsViolation` if a Responses object's ``output`` holds a refused call
    (``function_call`` by flat name; ``custom_tool_call`` per ``is_custom_allowed``)."""
    violation = responses_violation(body, call_filter, source, public_name=True)
    if violation is not None:
        record_violation(source)
        raise violation


def check_chat_completion(body: Mapping[str, Any], call_filter: CallFilter, *,
                          source: str = "unary_guard") -> None:
    """Raise :class:`AllowedToolsViolation` if any ``choices[].message`` calls a refused tool
    (``tool_calls[].function.name``, and the legacy ``function_call.name``)."""
    choices = body.get("choices") if isinstance(body, Mapping) else None
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, Mapping) else None
        if not isinstance(message, Mapping):
            continue
        calls = message.get("tool_calls")
        identities = [chat_call_identity(call) for call in (calls if isinstance(calls, list) else ())]
        legacy = message.get("function_call")
        if isinstance(legacy, Mapping):
            identities.append(("function", flat_name(legacy.get("name"))))
        for kind, name in identities:
            if not is_call_allowed(call_filter, name, kind):
                record_violation(source)
                raise refusal(call_filter, name, kind, source, public_name=True)
