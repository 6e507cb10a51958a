"""The guard for a whole (unary) answer: refuse it when it holds a call outside the policy, a call
whose arguments are refused, or no call on a turn that must call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..arguments import ArgumentsRejected, parse_arguments_object
from ..metrics import record_violation
from ..request import flat_name
from .call_names import chat_call_identity, item_identity
from .contract import NAMES_ONLY, OutputContract, is_cut
from .violations import (
    ARGUMENTS_NOT_OBJECT,
    AllowedToolsViolation,
    CallFilter,
    arguments_violation,
    record_reason,
    refusal,
    required_violation,
)


def _item_name(item: Mapping[str, Any]) -> str | None:
    return flat_name(item.get("name"), item.get("namespace"))


def cut_call(body: Any, contract: OutputContract = NAMES_ONLY) -> Mapping[str, Any] | None:
    """The call an incomplete Responses object was cut inside: its last output item, when that is a
    ``function_call`` whose arguments are not one JSON object (the token limit ended it there)."""
    output = body.get("output") if is_cut(body) else None
    last = output[-1] if isinstance(output, list) and output else None
    if not isinstance(last, Mapping) or last.get("type") != "function_call":
        return None
    refused = contract.arguments_refusal(_item_name(last), last.get("arguments"))
    return last if refused is not None and refused.reason == ARGUMENTS_NOT_OBJECT else None


def close_cut_call(body: Any, contract: OutputContract = NAMES_ONLY) -> bool:
    """Mark :func:`cut_call` ``status: "incomplete"`` in place (it must not read as a completed
    call); True when that changed the body."""
    call = cut_call(body, contract)
    if not isinstance(call, dict) or call.get("status") == "incomplete":
        return False
    call["status"] = "incomplete"
    return True


def responses_violation(body: Any, call_filter: CallFilter, source: str, *, public_name: bool,
                        contract: OutputContract = NAMES_ONLY,
                        called: bool = False) -> AllowedToolsViolation | None:
    """The violation of a Responses object's ``output``, else None: the first refused call, then
    the first function call whose arguments are refused (the :func:`cut_call` of an incomplete
    object excepted), then no call at all where the contract requires one (``called``: a stream
    already saw one) and the object is not incomplete."""
    output = body.get("output") if isinstance(body, Mapping) else None
    items = [item for item in (output if isinstance(output, list) else ()) if isinstance(item, Mapping)]
    identities = [(item, item_identity(item)) for item in items]
    for _, identity in identities:
        if identity is not None and not call_filter.allows(identity[0], identity[1]):
            return refusal(call_filter, identity[1], identity[0], source, public_name=public_name)
    cut = cut_call(body, contract)
    for item in items:
        refused = None
        if item.get("type") == "function_call" and item is not cut:
            refused = contract.arguments_refusal(_item_name(item), item.get("arguments"))
        elif item.get("type") == "custom_tool_call" and not is_cut(body):
            refused = contract.input_refusal(_item_name(item), item.get("input"))
        if refused is not None:
            return arguments_violation(refused, _item_name(item), source, public_name=public_name)
    if contract.requires_call() and not called and not is_cut(body) \
            and all(identity is None for _, identity in identities):
        return required_violation(contract.requirement or "", source)
    return None


def _raise(violation: AllowedToolsViolation, source: str) -> None:
    record_violation(source)
    record_reason(violation)
    raise violation


def check_responses_object(body: Mapping[str, Any], call_filter: CallFilter, *,
                           source: str = "unary_guard",
                           contract: OutputContract = NAMES_ONLY) -> bool:
    """Raise :class:`AllowedToolsViolation` if a Responses object's ``output`` holds a refused call
    (``function_call`` by flat name; ``custom_tool_call`` per the filter's ``allows("custom", name)``), refused
    arguments, or no call where ``contract`` requires one. Returns True when it marked the call an
    incomplete object was cut inside as incomplete (:func:`close_cut_call`): the body changed."""
    violation = responses_violation(body, call_filter, source, public_name=True, contract=contract)
    if violation is not None:
        _raise(violation, source)
    return close_cut_call(body, contract)


def _chat_calls(message: Mapping[str, Any]) -> list[tuple[str, str | None, Any]]:
    """(kind, name, arguments) of a Chat message's calls (``tool_calls``, then the legacy
    ``function_call``); ``arguments`` is a custom call's input."""
    calls = message.get("tool_calls")
    found = []
    for call in calls if isinstance(calls, list) else ():
        kind, name = chat_call_identity(call)
        body = call.get("custom" if kind == "custom" else "function") if isinstance(call, Mapping) else None
        found.append((kind, name, body.get("input" if kind == "custom" else "arguments")
                      if isinstance(body, Mapping) else None))
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping):
        found.append(("function", flat_name(legacy.get("name")), legacy.get("arguments")))
    return found


def chat_choice_violation(choice: Mapping[str, Any], call_filter: CallFilter, source: str, *,
                          contract: OutputContract) -> AllowedToolsViolation | None:
    """The violation of one ``choices[]`` entry of a chat completion, else None. A choice cut by
    the token limit (``finish_reason: "length"``) need not call, and its last call's arguments may
    be unfinished (not one JSON object): that call is the one the limit cut."""
    message = choice.get("message")
    if not isinstance(message, Mapping):
        return None
    calls = _chat_calls(message)
    for kind, name, _ in calls:
        if not call_filter.allows(kind, name):
            return refusal(call_filter, name, kind, source, public_name=True)
    length = choice.get("finish_reason") == "length"
    for position, (kind, name, arguments) in enumerate(calls):
        last_cut = length and position == len(calls) - 1
        if kind == "custom":   # a custom input its grammar does not admit (unless the limit cut it)
            refused = None if last_cut else contract.input_refusal(name, arguments)
        else:
            refused = contract.arguments_refusal(name, arguments)
        if refused is None or (last_cut and refused.reason == ARGUMENTS_NOT_OBJECT):
            continue
        return arguments_violation(refused, name, source, public_name=True)
    if contract.requires_call() and not calls and not length:
        return required_violation(contract.requirement or "", source)
    return None


def mark_cut_choice(body: Any, contract: OutputContract = NAMES_ONLY) -> bool:
    """A one-choice completion vLLM reports as ``tool_calls`` although the request's output limit
    cut its last call (vLLM's unary Chat says ``tool_calls`` whenever an auto turn holds a call;
    its stream and the Responses API say ``length``/``incomplete`` for the same generation):
    marked ``finish_reason: "length"`` in place, as OpenAI reports a cut; True when it was."""
    choices = body.get("choices") if isinstance(body, dict) else None
    usage = body.get("usage") if isinstance(body, dict) else None
    used = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
    if contract.max_tokens is None or not isinstance(used, int) or used < contract.max_tokens \
            or not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    message = choice.get("message")
    calls = _chat_calls(message) if choice.get("finish_reason") == "tool_calls" \
        and isinstance(message, Mapping) else []
    if not calls:
        return False
    kind, name, arguments = calls[-1]
    unfinished = contract.input_refusal(name, arguments) is not None if kind == "custom" else \
        _not_an_object(arguments)
    if unfinished:
        choice["finish_reason"] = "length"
    return unfinished


def _not_an_object(arguments: Any) -> bool:
    try:
        parse_arguments_object(arguments)
    except ArgumentsRejected:
        return True
    return False


def check_chat_completion(body: Mapping[str, Any], call_filter: CallFilter, *,
                          source: str = "unary_guard",
                          contract: OutputContract = NAMES_ONLY) -> bool:
    """Raise :class:`AllowedToolsViolation` if any ``choices[].message`` calls a refused tool
    (``tool_calls[].function.name`` / ``.custom.name``, and the legacy ``function_call.name``), a
    function call's arguments or a custom call's input are refused, or a choice has no call where
    ``contract`` requires one. True when the body was changed (:func:`mark_cut_choice`)."""
    changed = mark_cut_choice(body, contract)
    choices = body.get("choices") if isinstance(body, Mapping) else None
    choices = [choice for choice in (choices if isinstance(choices, list) else ())
               if isinstance(choice, Mapping)]
    for choice in choices:
        violation = chat_choice_violation(choice, call_filter, source, contract=contract)
        if violation is not None:
            _raise(violation, source)
    if not choices and contract.requires_call():   # no choice at all: no call either
        _raise(required_violation(contract.requirement or "", source), source)
    return changed
