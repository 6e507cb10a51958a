"""A call's arguments, read strictly and checked against the tool's JSON schema, so the validator
and the handler can never read different values; and the digest that grants and idempotency keys
bind to. The reading and the validators are :mod:`vllm_allowed_tools.arguments`, which the output
guard shares."""

from __future__ import annotations

import logging
from typing import Any

from ..arguments import (
    ArgumentsRejected,
    SchemaUnusable,
    SchemaValidators,
    error_path,
    parse_arguments_object,
)
from ..request import FunctionSpec, value_digest
from .tool_calls import ToolCall
from .dispatch_errors import InvalidArgumentsError, SchemaViolationError, ToolUnavailableError
from .messages import short

logger = logging.getLogger(__name__)

DEFAULT_MAX_ARGUMENT_CHARS = 1_000_000
MAX_SCHEMA_ERRORS = 8


def arguments_digest(arguments: Any) -> str:
    """Hex SHA-256 of the RFC 8785 JSON of parsed arguments (what grants and idempotency bind to);
    a value RFC 8785 cannot represent (an integer beyond +/-(2**53 - 1), an overflowing number) is
    hashed under the fallback of :func:`vllm_allowed_tools.request.value_digest`, never an error.

    For an arguments object RFC 8785 can represent it is the approvals layer's ``arguments_digest``
    without its ``sha256:`` prefix; that one also digests argument text that is not JSON."""
    return value_digest(arguments)


class ArgumentChecker:
    """Parses a call's arguments and validates them against its tool's schema; thread-safe, and
    each schema's validator is built once."""

    def __init__(self, max_argument_chars: int = DEFAULT_MAX_ARGUMENT_CHARS) -> None:
        self._max_chars = max_argument_chars
        self._validators = SchemaValidators()

    def check(self, call: ToolCall, spec: FunctionSpec) -> dict[str, Any]:
        """The parsed arguments of ``call``. Raises :class:`InvalidArgumentsError`,
        :class:`SchemaViolationError`, or :class:`ToolUnavailableError` for an unusable schema."""
        try:
            arguments = parse_arguments_object(call.arguments, self._max_chars)
        except ArgumentsRejected as exc:
            raise InvalidArgumentsError(
                f"The arguments for {spec.flat_name!r} were refused: {exc}. Call the tool again "
                "with arguments that are a single JSON object matching its parameters schema.",
                call_id=call.call_id, tool=spec.flat_name) from None
        try:
            errors = self._validators.errors(spec, arguments)
        except SchemaUnusable as exc:
            logger.error("tool %s has an unusable parameters schema: %s", spec.flat_name, exc)
            raise ToolUnavailableError(
                f"The tool {spec.flat_name!r} is not available: its parameters schema is invalid, "
                "so its arguments cannot be checked. Do not call it again.",
                call_id=call.call_id, tool=spec.flat_name) from None
        except RecursionError:
            raise SchemaViolationError(
                f"The arguments for {spec.flat_name!r} do not match its parameters schema: "
                "the arguments are nested too deeply to validate.", call_id=call.call_id,
                tool=spec.flat_name) from None
        if errors:
            listed = [{"path": error_path(e), "message": short(e.message, 200)}
                      for e in errors[:MAX_SCHEMA_ERRORS]]
            text = "; ".join(f"{item['path']}: {item['message']}" for item in listed)
            if len(errors) > MAX_SCHEMA_ERRORS:
                text += f"; ... ({len(errors) - MAX_SCHEMA_ERRORS} more)"
            raise SchemaViolationError(
                f"The arguments for {spec.flat_name!r} do not match its parameters schema: {text}. "
                "Fix them and call the tool again. Nothing was run.",
                call_id=call.call_id, tool=spec.flat_name, details={"errors": listed})
        return arguments
