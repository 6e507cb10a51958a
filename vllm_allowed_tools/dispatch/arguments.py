"""A call's arguments, read strictly and checked against the tool's JSON schema, so the validator
and the handler can never read different values; and the digest that grants and idempotency keys
bind to."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from ..request import FunctionSpec, NotStrictJSON, strict_json_loads
from .calls import ToolCall
from .errors import InvalidArgumentsError, SchemaViolationError, ToolUnavailableError
from .messages import short

logger = logging.getLogger(__name__)

DEFAULT_MAX_ARGUMENT_CHARS = 1_000_000
MAX_SCHEMA_ERRORS = 8


def arguments_digest(arguments: Any) -> str:
    """sha256 of the canonical JSON of parsed arguments (what grants and idempotency bind to).

    Canonical here is sorted keys, no whitespace and ASCII only, so any string the value holds can
    be hashed. Unlike :func:`vllm_allowed_tools.approvals.digests.arguments_digest` it takes parsed
    arguments only and has no ``sha256:`` prefix: the two digests are not interchangeable."""
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


class ArgumentChecker:
    """Parses a call's arguments and validates them against its tool's schema; thread-safe, and
    each schema's validator is built once."""

    def __init__(self, max_argument_chars: int = DEFAULT_MAX_ARGUMENT_CHARS) -> None:
        self._max_chars = max_argument_chars
        self._validators: dict[str, Any] = {}
        self._lock = threading.Lock()

    def check(self, call: ToolCall, spec: FunctionSpec) -> dict[str, Any]:
        """The parsed arguments of ``call``. Raises :class:`InvalidArgumentsError`,
        :class:`SchemaViolationError`, or :class:`ToolUnavailableError` for an unusable schema."""
        try:
            arguments = _parse_arguments(call.arguments, self._max_chars)
        except _Rejected as exc:
            raise InvalidArgumentsError(
                f"The arguments for {spec.flat_name!r} were refused: {exc}. Call the tool again "
                "with arguments that are a single JSON object matching its parameters schema.",
                call_id=call.call_id, tool=spec.flat_name) from None
        validator = self._validator(spec, call)
        try:
            errors = sorted(validator.iter_errors(arguments),
                            key=lambda e: (list(map(str, e.absolute_path)), e.message))
        except RecursionError:
            raise SchemaViolationError(
                f"The arguments for {spec.flat_name!r} do not match its parameters schema: "
                "the arguments are nested too deeply to validate.", call_id=call.call_id,
                tool=spec.flat_name) from None
        if errors:
            listed = [{"path": _error_path(e), "message": short(e.message, 200)}
                      for e in errors[:MAX_SCHEMA_ERRORS]]
            text = "; ".join(f"{item['path']}: {item['message']}" for item in listed)
            if len(errors) > MAX_SCHEMA_ERRORS:
                text += f"; ... ({len(errors) - MAX_SCHEMA_ERRORS} more)"
            raise SchemaViolationError(
                f"The arguments for {spec.flat_name!r} do not match its parameters schema: {text}. "
                "Fix them and call the tool again. Nothing was run.",
                call_id=call.call_id, tool=spec.flat_name, details={"errors": listed})
        return arguments

    def _validator(self, spec: FunctionSpec, call: ToolCall) -> Any:
        with self._lock:
            validator = self._validators.get(spec.digest)
        if validator is not None:
            return validator
        schema = spec.parameters
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls.check_schema(schema)
            validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        except (SchemaError, TypeError, ValueError, LookupError) as exc:
            logger.error("tool %s has an unusable parameters schema: %s", spec.flat_name, exc)
            raise ToolUnavailableError(
                f"The tool {spec.flat_name!r} is not available: its parameters schema is invalid, "
                "so its arguments cannot be checked. Do not call it again.",
                call_id=call.call_id, tool=spec.flat_name) from None
        with self._lock:
            self._validators.setdefault(spec.digest, validator)
        return validator


class _Rejected(ValueError):
    pass


def _parse_arguments(raw: Any, max_chars: int) -> dict[str, Any]:
    """One JSON object, strictly; raises ``_Rejected`` with a short reason."""
    if isinstance(raw, Mapping):
        try:
            raw = json.dumps(raw, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise _Rejected(f"the arguments object is not JSON-serializable ({exc})") from None
    if raw is None:
        raise _Rejected("the arguments are missing")
    if not isinstance(raw, str):
        raise _Rejected(f"the arguments must be a JSON string, got {type(raw).__name__}")
    if len(raw) > max_chars:
        raise _Rejected(f"the arguments are {len(raw)} characters long, over the limit of "
                        f"{max_chars}")
    try:
        value = strict_json_loads(raw)
    except NotStrictJSON as exc:
        raise _Rejected(str(exc)) from None
    except RecursionError:
        raise _Rejected("the arguments are nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int conversion limits
        raise _Rejected(f"not valid JSON ({short(str(exc), 160)})") from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(value), "a number")
        raise _Rejected(f"the arguments must be a JSON object, got {kind}")
    try:  # lone surrogates ("\ud800") decode but are not text: the handler could not use them
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _Rejected("the arguments contain invalid Unicode (an unpaired surrogate escape)") \
            from None
    except RecursionError:
        raise _Rejected("the arguments are nested too deeply") from None
    return value


def _error_path(error: jsonschema.ValidationError) -> str:
    path = "$"
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path
