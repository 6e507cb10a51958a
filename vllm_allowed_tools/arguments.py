"""A call's arguments as every checker reads them: one JSON object, read strictly, validated against
its tool's JSON schema. Shared by the output guard (``response/``) and the dispatch guard
(``dispatch/``), so the server and the application refuse the same arguments for the same reasons.

No vLLM here; ``jsonschema`` is imported when the first validator is built.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .request import FunctionSpec, NotStrictJSON, strict_json_loads

__all__ = ["ArgumentsRejected", "SchemaUnusable", "SchemaValidators", "error_path",
           "parse_arguments_object", "short"]


class ArgumentsRejected(ValueError):
    """The arguments are not one JSON object; ``str(exc)`` says why, in a few words."""


class SchemaUnusable(ValueError):
    """The tool's parameters schema is not a JSON schema a validator can be built from."""


def short(value: Any, limit: int = 120) -> str:
    """``value`` (a string as is, anything else as its repr), cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_arguments_object(raw: Any, max_chars: int | None = None) -> dict[str, Any]:
    """The arguments as one JSON object, strictly (no repeated keys, no NaN, no lone surrogates);
    a mapping is read as its JSON text. Raises :class:`ArgumentsRejected` with a short reason."""
    if isinstance(raw, Mapping):
        try:
            raw = json.dumps(raw, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ArgumentsRejected(f"the arguments object is not JSON-serializable ({exc})") from None
    if raw is None:
        raise ArgumentsRejected("the arguments are missing")
    if not isinstance(raw, str):
        raise ArgumentsRejected(f"the arguments must be a JSON string, got {type(raw).__name__}")
    if max_chars is not None and len(raw) > max_chars:
        raise ArgumentsRejected(f"the arguments are {len(raw)} characters long, over the limit of "
                                f"{max_chars}")
    try:
        value = strict_json_loads(raw)
    except NotStrictJSON as exc:
        raise ArgumentsRejected(str(exc)) from None
    except RecursionError:
        raise ArgumentsRejected("the arguments are nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int conversion limits
        raise ArgumentsRejected(f"not valid JSON ({short(str(exc), 160)})") from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(value), "a number")
        raise ArgumentsRejected(f"the arguments must be a JSON object, got {kind}")
    try:  # lone surrogates ("\ud800") decode but are not text: a handler could not use them
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ArgumentsRejected("the arguments contain invalid Unicode (an unpaired surrogate "
                                "escape)") from None
    except RecursionError:
        raise ArgumentsRejected("the arguments are nested too deeply") from None
    return value


class SchemaValidators:
    """One jsonschema validator per parameters schema (keyed by the spec's digest), built once;
    thread-safe. ``max_entries`` bounds the cache (least recently used first out); None: unbounded."""

    def __init__(self, max_entries: int | None = None) -> None:
        self._max = max_entries
        self._validators: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def errors(self, spec: FunctionSpec, arguments: Any) -> list[Any]:
        """The schema's validation errors for ``arguments`` (``jsonschema.ValidationError``), sorted
        by path then message. Raises :class:`SchemaUnusable`, and ``RecursionError`` for arguments
        nested too deeply to validate."""
        validator = self.validator(spec)
        return sorted(validator.iter_errors(arguments),
                      key=lambda e: (list(map(str, e.absolute_path)), e.message))

    def validator(self, spec: FunctionSpec) -> Any:
        with self._lock:
            validator = self._validators.get(spec.digest)
            if validator is not None:
                self._validators.move_to_end(spec.digest)
                return validator
        validator = _build(spec.parameters)
        with self._lock:
            validator = self._validators.setdefault(spec.digest, validator)
            if self._max is not None:
                while len(self._validators) > self._max:
                    self._validators.popitem(last=False)
        return validator


def _build(schema: Any) -> Any:
    import jsonschema
    from jsonschema.exceptions import SchemaError
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema, format_checker=cls.FORMAT_CHECKER)
    except (SchemaError, TypeError, ValueError, LookupError) as exc:
        raise SchemaUnusable(short(str(exc), 200)) from None


def error_path(error: Any) -> str:
    """A validation error's place in the arguments, as ``$.a[0].b``."""
    path = "$"
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path
