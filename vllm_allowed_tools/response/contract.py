"""What an answer must be beyond its calls' names: the output guard's backstops for one turn.

A :class:`CallFilter` says which names may be called; an :class:`OutputContract`, passed with it,
says whether the turn must call at all and what a call's arguments must be: always one JSON object,
and for a ``strict`` tool (every function tool under ``--tool-strict-level parameter``) valid against
its parameters schema. The rules: ``docs/response-path.md`` ("Backstops").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..arguments import (
    ArgumentsRejected,
    SchemaUnusable,
    SchemaValidators,
    error_path,
    parse_arguments_object,
    short,
)
from ..request import TurnAllowlist
from .violations import ARGUMENTS_NOT_OBJECT, CUSTOM_INPUT_INVALID, STRICT_ARGUMENTS_INVALID, ArgumentsRefusal

__all__ = ["NAMES_ONLY", "OutputContract", "is_cut"]

#: schema errors quoted in a refusal
MAX_LISTED_ERRORS = 8

#: validators of strict tools' schemas, shared by every request (bounded: catalogs change)
_VALIDATORS = SchemaValidators(max_entries=256)


def _requirement(turn: TurnAllowlist | None) -> str | None:
    """What in the turn's ``tool_choice`` demands a call, None when none does."""
    if turn is None:
        return None
    if turn.choice == "required":
        return 'tool_choice is "required"'
    if turn.choice == "named":
        return "tool_choice names a custom tool" if turn.allowed_specs[:1] and \
            turn.allowed_specs[0].kind == "custom" else "tool_choice names a function"
    if turn.choice == "allowed" and turn.mode == "required":
        return "tool_choice is allowed_tools in `required` mode"
    return None


class OutputContract:
    """One turn's backstops: :meth:`requires_call` and :meth:`arguments_refusal`.

    ``requirement``: why the turn must call (None: it need not); ``check_arguments``: a function
    call's arguments must be one JSON object; ``turn``: the catalog whose ``strict`` tools are
    validated; ``strict_all``: the server runs with ``--tool-strict-level parameter`` (every
    function tool is strict); ``max_tokens``: the output limit the request set (Chat), by which
    an answer vLLM reports as ``tool_calls`` is known to be cut. The server always builds one with
    :meth:`for_turn`; a guard built without one judges names only (:data:`NAMES_ONLY`)."""

    __slots__ = ("check_arguments", "custom_grammars", "max_tokens", "requirement", "strict_all",
                 "turn")

    def __init__(self, *, requirement: str | None = None, check_arguments: bool = True,
                 turn: TurnAllowlist | None = None, strict_all: bool = False,
                 custom_grammars: Mapping[str, Any] | None = None,
                 max_tokens: int | None = None) -> None:
        self.requirement = requirement
        self.check_arguments = check_arguments
        self.turn = turn
        self.strict_all = strict_all
        self.custom_grammars = custom_grammars or {}
        self.max_tokens = max_tokens

    @classmethod
    def for_turn(cls, turn: TurnAllowlist | None, *, strict_all: bool = False,
                 custom_grammars: Mapping[str, Any] | None = None,
                 max_tokens: int | None = None) -> OutputContract:
        """Every backstop for a resolved turn (its allowlist, or for a plain request the catalog
        :func:`~..request.resolve_callable_catalog` reads; None: no function catalog, so no call
        is required and no tool is strict, but arguments are still checked). ``custom_grammars``:
        the request's grammar custom tools by name (:mod:`~..request.custom_tools`)."""
        return cls(requirement=_requirement(turn), turn=turn, strict_all=strict_all,
                   custom_grammars=custom_grammars, max_tokens=max_tokens)

    def satisfied_by_any_call(self) -> OutputContract:
        """This contract with no call required (a server-side call satisfies the turn too)."""
        return OutputContract(requirement=None, check_arguments=self.check_arguments,
                              turn=self.turn, strict_all=self.strict_all,
                              custom_grammars=self.custom_grammars, max_tokens=self.max_tokens)

    def input_refusal(self, name: str | None, text: Any) -> ArgumentsRefusal | None:
        """Why a custom call's (complete) ``input`` may not go out, None when it may: the tool
        has a grammar (``format: {"type": "grammar"}``) that does not admit it."""
        grammar = self.custom_grammars.get(name) if name is not None else None
        if grammar is None:
            return None
        if isinstance(text, str) and grammar.admits(text):
            return None
        shown = short(text, 120) if isinstance(text, str) else type(text).__name__
        return ArgumentsRefusal(CUSTOM_INPUT_INVALID,
                                f"the {grammar.syntax} grammar does not admit {shown!r}")

    def requires_call(self) -> bool:
        """Whether an answer that is not cut by the token limit must hold at least one call."""
        return self.requirement is not None

    def is_strict(self, flat_name: str | None) -> bool:
        spec = self.turn.lookup(flat_name) if self.turn is not None and flat_name else None
        return spec is not None and (self.strict_all or spec.strict is True)

    def arguments_refusal(self, flat_name: str | None, arguments: Any) -> ArgumentsRefusal | None:
        """Why a function call's (complete) ``arguments`` may not go out, None when they may: not
        one JSON object (:data:`ARGUMENTS_NOT_OBJECT`), or a strict tool's arguments that do not
        validate against its schema (:data:`STRICT_ARGUMENTS_INVALID`)."""
        if not self.check_arguments:
            return None
        try:
            value = parse_arguments_object(arguments)
        except ArgumentsRejected as exc:
            return ArgumentsRefusal(ARGUMENTS_NOT_OBJECT, str(exc))
        if not self.is_strict(flat_name):
            return None
        spec = self.turn.lookup(flat_name)  # type: ignore[union-attr,arg-type]
        try:
            errors = _VALIDATORS.errors(spec, value)  # type: ignore[arg-type]
        except SchemaUnusable as exc:
            return ArgumentsRefusal(STRICT_ARGUMENTS_INVALID,
                                    f"its parameters schema cannot be checked: {exc}")
        except RecursionError:
            return ArgumentsRefusal(STRICT_ARGUMENTS_INVALID, "nested too deeply to validate")
        if not errors:
            return None
        listed = errors[:MAX_LISTED_ERRORS]
        detail = "; ".join(f"{error_path(e)}: {short(e.message, 200)}" for e in listed)
        if len(errors) > len(listed):
            detail += f"; ... ({len(errors) - len(listed)} more)"
        return ArgumentsRefusal(STRICT_ARGUMENTS_INVALID, detail,
                                tuple(dict.fromkeys(error_path(e) for e in listed)))


#: no backstop: what a guard given no contract judges (call names only, as before the backstops)
NAMES_ONLY = OutputContract(check_arguments=False)


def is_cut(response: Any) -> bool:
    """Whether a Responses object was cut short (``status: "incomplete"``, e.g. by
    ``max_output_tokens``): a call need not be there, and its last call may be unfinished."""
    return isinstance(response, dict) and response.get("status") == "incomplete"
