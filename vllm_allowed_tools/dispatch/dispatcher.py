"""The application-side dispatch guard: the last check before an application runs a tool call.

Model-side restriction (the grammar, the parser wrappers, the server's output guard) narrows what
the model *proposes*; it is not the security boundary. Before an application executes a returned
call it must check it again against **this turn's** policy, for **this** tenant, session and caller.
:class:`Dispatcher` does that, in this order, and refuses with a typed error at the first failure:

1. the call is well formed (a Responses ``function_call`` item or a Chat ``tool_calls`` entry);
2. the name is a function of the request's catalog (:class:`UnknownToolError`) and in the turn's
   allowed set (:class:`ToolNotAllowedError`); a handler is registered for it
   (:class:`ToolUnavailableError`);
3. the arguments are one JSON object (:class:`InvalidArgumentsError`; duplicate keys, ``NaN`` /
   ``Infinity`` and lone surrogates are refused too, so the validator and the handler can never read
   different values) that validates against the tool's JSON schema with ``jsonschema``
   (:class:`SchemaViolationError`);
4. the authorization hook, given the caller's identity and the parsed arguments, allows it
   (:class:`AuthorizationDeniedError`; a hook that raises or returns anything but an allow is a
   denial);
5. a gated tool has a live grant for (subject, session, tool, arguments)
   (:class:`GrantRequiredError`);
6. idempotency: the key (by default the call id) was not used before in this (tenant, session) for a
   different call (:class:`IdempotencyConflictError`) and is not running right now
   (:class:`CallInProgressError`); a key already completed with the same tool and arguments returns
   the stored outcome, marked ``replayed``, and **does not run the handler again**;
7. the handler runs; what it returns is a :class:`DispatchResult`. A handler raises
   :class:`ToolFailure` to report a failure whose message the model may see; any other exception
   becomes a :class:`ToolFailedError` with a generic message (the original is chained as
   ``__cause__`` for your logs, never shown to the model).

Every error has a stable ``code``, a message that tells the model (or the developer) what to do,
and ``to_tool_output()``: the string to send back to the model as the tool result, so an agent loop
can feed refusals back instead of crashing. :meth:`Dispatcher.try_dispatch` returns the result or
the error; :meth:`Dispatcher.dispatch` raises the error.

Decisions taken where the contract is silent:

* The policy comes from :func:`~vllm_allowed_tools.request.allowlist.resolve_allowlist` on the **same request
  body** the application sent to the server (:meth:`TurnContext.from_request`), so the application
  and the server agree on catalog, identities and allowed set. A body without tools allows nothing;
  ``tool_choice: "none"`` allows nothing; plain ``auto`` / ``required`` allow the whole catalog (no
  allowlist was asked for); a named choice allows that one function.
* Responses calls carry ``namespace`` separately: the call's identity is ``(namespace, name)``
  exactly. Without a namespace the name is looked up as the flat name the model emits. Names are
  never split on ``__``.
* Checks 1-5 run on every call, replays included: a stored outcome is only handed to a caller who
  may still make the same call now. Refusals in 1-5 never consume an idempotency key.
* The outcome of a handler that ran is stored under its key whether it succeeded or failed
  (at-most-once execution: a failed side effect may have half happened). A ``BaseException`` that is
  not an ``Exception`` (``KeyboardInterrupt``) releases the key instead.
* The idempotency fingerprint is (tool identity, canonical JSON of the parsed arguments); the same
  key with any other tool or arguments is a conflict, and nothing runs.
* A call without a call id and without an explicit key runs without idempotency protection.
* Gated tools with no grant checker configured are always refused (fail closed).

No vLLM imports here.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import jsonschema
from jsonschema.exceptions import SchemaError

from ..request import flat_name
from ..request import (Api, FunctionSpec, NotStrictJSON, ToolIdentity, TurnAllowlist,
                     resolve_allowlist, strict_json_loads)

__all__ = [
    "AuthorizationDecision",
    "AuthorizationDeniedError",
    "CallInProgressError",
    "CallRefusedError",
    "DispatchError",
    "DispatchResult",
    "Dispatcher",
    "GrantChecker",
    "GrantRequiredError",
    "IdempotencyConflictError",
    "IdempotencyStore",
    "InMemoryGrantChecker",
    "InMemoryIdempotencyStore",
    "InvalidArgumentsError",
    "Invocation",
    "MalformedCallError",
    "Reservation",
    "SchemaViolationError",
    "StoredOutcome",
    "ToolCall",
    "ToolFailedError",
    "ToolFailure",
    "ToolNotAllowedError",
    "ToolUnavailableError",
    "TurnContext",
    "UnknownToolError",
    "allow",
    "allow_all",
    "arguments_digest",
    "deny",
]

logger = logging.getLogger(__name__)

_MAX_LISTED_NAMES = 20
_MAX_SCHEMA_ERRORS = 8
_MAX_QUOTED = 120
DEFAULT_MAX_ARGUMENT_CHARS = 1_000_000


def _short(value: Any, limit: int = _MAX_QUOTED) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED_NAMES])
    if len(names) > _MAX_LISTED_NAMES:
        shown += f", ... ({len(names) - _MAX_LISTED_NAMES} more)"
    return shown


def _ascii_json(value: Any) -> str:
    """Canonical JSON, ASCII only (hashable whatever strings the value holds)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def arguments_digest(arguments: Any) -> str:
    """sha256 of the canonical JSON of parsed arguments (what grants and idempotency bind to)."""
    return hashlib.sha256(_ascii_json(arguments).encode("ascii")).hexdigest()


# --------------------------------------------------------------------------------------------------
# the turn: policy bound to tenant, session and caller


@dataclass(frozen=True)
class TurnContext:
    """One turn's policy, bound to who is asking: never a process-wide constant.

    ``tenant`` and ``session`` scope idempotency keys and grants; ``subject`` is the authenticated
    caller the authorization hook and the grant checker judge (take it from your own auth layer,
    never from anything the model or the client body says). ``policy`` is what
    :func:`resolve_allowlist` made of the request body sent to the server (None: no tools at all).
    """

    tenant: str
    session: str
    subject: str
    policy: TurnAllowlist | None
    turn_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("tenant", "session", "subject"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"TurnContext.{name} must be a non-empty string, got {value!r}: "
                                 "a policy must be bound to a tenant, a session and a caller")
        if self.policy is not None and not isinstance(self.policy, TurnAllowlist):
            raise TypeError(f"TurnContext.policy must be a TurnAllowlist or None, got "
                            f"{type(self.policy).__name__}")

    @classmethod
    def from_request(cls, body: Mapping[str, Any], api: Api, *, tenant: str, session: str,
                     subject: str, turn_id: str | None = None) -> TurnContext:
        """Resolve the request body you send to the server (``/v1/responses`` or
        ``/v1/chat/completions`` JSON, ``api`` ``"responses"`` or ``"chat"``) into this turn's
        context. Raises :class:`~vllm_allowed_tools.errors.InvalidSelectionError` for a selection
        the server would reject with a 400 too."""
        return cls(tenant=tenant, session=session, subject=subject,
                   policy=resolve_allowlist(body, api), turn_id=turn_id)

    @property
    def scope(self) -> tuple[str, str]:
        """What idempotency keys are unique within: (tenant, session)."""
        return (self.tenant, self.session)

    def allowed_specs(self) -> tuple[FunctionSpec, ...]:
        return () if self.policy is None else self.policy.allowed_specs

    def allowed_names(self) -> list[str]:
        """Flat names callable this turn, in catalog order."""
        return [spec.flat_name for spec in self.allowed_specs()]

    def find(self, call: ToolCall) -> FunctionSpec | None:
        """The catalog function ``call`` names (exact identity; never splits on ``__``)."""
        policy = self.policy
        if policy is None:
            return None
        if call.namespace is not None:
            wanted = ToolIdentity(call.namespace, call.name)
            spec = policy.lookup(wanted.flat_name)
            if spec is not None and spec.identity == wanted:
                return spec
            return next((s for s in policy.catalog if s.identity == wanted), None)
        return policy.lookup(call.name)

    def allows(self, spec: FunctionSpec) -> bool:
        """Is this catalog function callable this turn (identity-exact, like the server's guard)?"""
        policy = self.policy
        if policy is None or policy.choice == "none":
            return False
        return policy.allowed is None or spec.identity in policy.allowed


# --------------------------------------------------------------------------------------------------
# calls


def _as_mapping(obj: Any) -> Mapping[str, Any] | None:
    if isinstance(obj, Mapping):
        return obj
    dump = getattr(obj, "model_dump", None)  # openai SDK objects (pydantic)
    if callable(dump):
        try:
            dumped = dump()
        except Exception:  # noqa: BLE001 - an object we cannot read is a malformed call
            return None
        return dumped if isinstance(dumped, Mapping) else None
    return None


@dataclass(frozen=True)
class ToolCall:
    """A returned call in either API's shape, normalized.

    ``arguments`` is what the model returned: JSON text (both APIs send a string), or a mapping
    when a caller already decoded it. Build one with :meth:`from_any`.
    """

    name: str
    arguments: Any
    call_id: str | None = None
    namespace: str | None = None
    source: Literal["responses", "chat", "direct"] = "direct"

    @property
    def flat_name(self) -> str:
        return flat_name(self.name, self.namespace) or self.name

    @classmethod
    def from_any(cls, call: Any) -> ToolCall:
        """Accept a Responses ``function_call`` output item (``name``, ``namespace``,
        ``arguments``, ``call_id``), a Chat ``tool_calls`` entry (``id``, ``function.name``,
        ``function.arguments``), as dicts or ``openai`` SDK objects, or a :class:`ToolCall`.
        Raises :class:`MalformedCallError`."""
        if isinstance(call, ToolCall):
            return call
        data = _as_mapping(call)
        if data is None:
            raise MalformedCallError(
                f"expected a Responses function_call item or a Chat tool_calls entry, got "
                f"{type(call).__name__}")
        call_type = data.get("type")
        function = data.get("function")
        if isinstance(function, Mapping) or call_type == "function":
            if not isinstance(function, Mapping):
                raise MalformedCallError("a Chat tool call needs a \"function\" object with "
                                         "\"name\" and \"arguments\"",
                                         call_id=_opt_str(data.get("id")))
            name, arguments, call_id = function.get("name"), function.get("arguments"), data.get("id")
            namespace, source = None, "chat"
        elif call_type in (None, "function_call"):
            name, arguments = data.get("name"), data.get("arguments")
            call_id, namespace, source = data.get("call_id"), data.get("namespace"), "responses"
        else:
            raise MalformedCallError(
                f"a {_short(call_type)!s} item is not a function call; only function tools can be "
                "dispatched", call_id=_opt_str(data.get("call_id") or data.get("id")))
        call_id = _opt_str(call_id)
        if not isinstance(name, str) or not name:
            raise MalformedCallError("the call has no function name", call_id=call_id)
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise MalformedCallError("the call's namespace must be a non-empty string",
                                     call_id=call_id)
        return cls(name=name, arguments=arguments, call_id=call_id, namespace=namespace,
                   source=source)  # type: ignore[arg-type]


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# --------------------------------------------------------------------------------------------------
# results and errors


class _ToolOutputMixin:
    call_id: str | None

    def to_tool_output(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def to_responses_item(self) -> dict[str, Any]:
        """The ``function_call_output`` input item that answers the call (Responses API)."""
        if self.call_id is None:
            raise ValueError("this call has no call_id to answer")
        return {"type": "function_call_output", "call_id": self.call_id,
                "output": self.to_tool_output()}

    def to_chat_message(self) -> dict[str, Any]:
        """The ``role: tool`` message that answers the call (Chat Completions)."""
        if self.call_id is None:
            raise ValueError("this call has no call_id to answer")
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.to_tool_output()}


@dataclass(frozen=True)
class DispatchResult(_ToolOutputMixin):
    """A call that passed every check and ran (or was replayed from its idempotency key)."""

    ok: ClassVar[bool] = True

    call_id: str | None
    tool: ToolIdentity
    arguments: dict[str, Any]
    output: Any
    idempotency_key: str | None = None
    replayed: bool = False

    @property
    def name(self) -> str:
        """The flat name (what the model called)."""
        return self.tool.flat_name

    def to_tool_output(self) -> str:
        """The tool result for the model: a string output as is, anything else as JSON."""
        if isinstance(self.output, str):
            return self.output
        return json.dumps(self.output, ensure_ascii=False, default=str)


class DispatchError(_ToolOutputMixin, Exception):
    """Base of every typed dispatch error.

    ``code`` is stable (branch on it); ``message`` says what went wrong and what to do;
    ``retryable`` tells whether the model can fix the call and try again; ``executed`` whether the
    handler ran. ``to_tool_output()`` is the JSON string to send to the model as the tool result.
    """

    ok: ClassVar[bool] = False
    code: ClassVar[str] = "dispatch_error"
    retryable: ClassVar[bool] = False
    executed: ClassVar[bool] = False

    def __init__(self, message: str, *, call_id: str | None = None, tool: str | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.call_id = call_id
        self.tool = tool
        self.details: dict[str, Any] = dict(details or {})
        self.replayed = False

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message,
                                "retryable": self.retryable}
        if self.tool is not None:
            body["tool"] = self.tool
        body.update(self.details)
        return body

    def to_tool_output(self) -> str:
        return json.dumps({"error": self.to_dict()}, ensure_ascii=False, default=str)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, tool={self.tool!r}, message={self.message!r})"


class CallRefusedError(DispatchError):
    """The call was refused before its handler ran: nothing was executed."""

    code = "call_refused"


class MalformedCallError(CallRefusedError):
    code = "malformed_call"

    def __init__(self, detail: str, **kwargs: Any) -> None:
        super().__init__(f"The tool call is malformed: {detail}. Nothing was run.", **kwargs)


class UnknownToolError(CallRefusedError):
    """The name is not a function of this turn's catalog."""

    code = "unknown_tool"


class ToolNotAllowedError(CallRefusedError):
    """The function exists in the catalog but is not in this turn's allowed set."""

    code = "tool_not_allowed"


class ToolUnavailableError(CallRefusedError):
    """Allowed, but this application cannot run it (no handler, or an unusable schema)."""

    code = "tool_unavailable"


class InvalidArgumentsError(CallRefusedError):
    """The arguments are not one JSON object."""

    code = "invalid_arguments"
    retryable = True


class SchemaViolationError(CallRefusedError):
    """The arguments do not validate against the tool's JSON schema."""

    code = "schema_violation"
    retryable = True


class AuthorizationDeniedError(CallRefusedError):
    code = "authorization_denied"


class GrantRequiredError(CallRefusedError):
    """A gated tool without a live grant for this subject, session, tool and arguments."""

    code = "grant_required"


class IdempotencyConflictError(CallRefusedError):
    """The idempotency key was already used in this session for a different call."""

    code = "idempotency_conflict"


class CallInProgressError(CallRefusedError):
    """A call with the same idempotency key is running right now."""

    code = "call_in_progress"


class ToolFailedError(DispatchError):
    """The handler ran and failed."""

    code = "tool_failed"
    executed = True


class ToolFailure(Exception):
    """Raise from a handler to report a failure; its message is shown to the model as is.

    ``details`` (JSON-serializable) are added to the error the model sees.
    """

    def __init__(self, message: str, *, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})


# --------------------------------------------------------------------------------------------------
# hooks: authorization, grants, idempotency


@dataclass(frozen=True)
class Invocation:
    """Everything known about a checked call: what hooks and handlers receive."""

    turn: TurnContext
    call: ToolCall
    spec: FunctionSpec
    arguments: dict[str, Any]
    idempotency_key: str | None

    @property
    def subject(self) -> str:
        return self.turn.subject

    @property
    def tenant(self) -> str:
        return self.turn.tenant

    @property
    def session(self) -> str:
        return self.turn.session

    @property
    def tool(self) -> ToolIdentity:
        return self.spec.identity

    @property
    def name(self) -> str:
        return self.spec.flat_name


@dataclass(frozen=True)
class AuthorizationDecision:
    allowed: bool
    reason: str | None = None


def allow() -> AuthorizationDecision:
    return AuthorizationDecision(True)


def deny(reason: str | None = None) -> AuthorizationDecision:
    """A denial; ``reason`` is shown to the model, so keep secrets out of it."""
    return AuthorizationDecision(False, reason)


#: ``authorize(invocation)`` -> ``True`` / :func:`allow` to allow; anything else denies.
Authorizer = Callable[[Invocation], bool | AuthorizationDecision]
#: ``handler(arguments, invocation)`` -> the tool's output (a string, or anything JSON-serializable).
Handler = Callable[[dict[str, Any], Invocation], Any]


def allow_all(invocation: Invocation) -> bool:
    """An authorizer that allows everything the policy allows (tests and demos only)."""
    return True


@runtime_checkable
class GrantChecker(Protocol):
    """Answers whether a gated call may run now (the approvals layer implements this)."""

    def has_live_grant(self, subject: str, session: str, tool_identity: ToolIdentity,
                       arguments: Mapping[str, Any]) -> bool: ...


@dataclass
class _Grant:
    subject: str
    session: str
    tool: ToolIdentity
    arguments_digest: str | None
    expires_at: float | None


class InMemoryGrantChecker:
    """A thread-safe in-memory :class:`GrantChecker` (tests and single-process demos).

    A grant binds subject, session, tool identity and, optionally, the exact arguments (by digest of
    their canonical JSON); it may expire (``clock()`` seconds) and be revoked.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[str, _Grant] = {}

    def grant(self, subject: str, session: str, tool: ToolIdentity | str, *,
              arguments: Mapping[str, Any] | None = None, expires_at: float | None = None,
              ttl_s: float | None = None) -> str:
        """Record a grant; returns its id (for :meth:`revoke`). ``tool`` as a string is a top-level
        function name. ``arguments=None`` grants any arguments."""
        identity = tool if isinstance(tool, ToolIdentity) else ToolIdentity(None, tool)
        if ttl_s is not None:
            expires_at = self._clock() + ttl_s
        grant_id = uuid.uuid4().hex
        digest = None if arguments is None else arguments_digest(dict(arguments))
        with self._lock:
            self._grants[grant_id] = _Grant(subject, session, identity, digest, expires_at)
        return grant_id

    def revoke(self, grant_id: str) -> bool:
        with self._lock:
            return self._grants.pop(grant_id, None) is not None

    def has_live_grant(self, subject: str, session: str, tool_identity: ToolIdentity,
                       arguments: Mapping[str, Any]) -> bool:
        now = self._clock()
        digest = arguments_digest(dict(arguments))
        with self._lock:
            for grant in self._grants.values():
                if (grant.subject == subject and grant.session == session
                        and grant.tool == tool_identity
                        and (grant.arguments_digest is None or grant.arguments_digest == digest)
                        and (grant.expires_at is None or now < grant.expires_at)):
                    return True
        return False


@dataclass(frozen=True)
class StoredOutcome:
    """What a completed key stored: the fingerprint of its call and its result or error."""

    fingerprint: str
    result: DispatchResult | None = None
    error: DispatchError | None = None


class Reservation(NamedTuple):
    """``new``: the key is reserved for the caller, which must :meth:`IdempotencyStore.complete` or
    :meth:`IdempotencyStore.release` it. ``done``: ``outcome`` holds the stored outcome.
    ``running``: the same call is in flight. ``conflict``: the key belongs to a different call."""

    state: Literal["new", "done", "running", "conflict"]
    outcome: StoredOutcome | None = None


class IdempotencyStore(Protocol):
    """Pluggable store of idempotency keys, unique within a (tenant, session) scope.

    ``reserve`` must be atomic: of two concurrent reservations of a new key exactly one gets
    ``new``."""

    def reserve(self, scope: tuple[str, str], key: str, fingerprint: str) -> Reservation: ...

    def complete(self, scope: tuple[str, str], key: str, outcome: StoredOutcome) -> None: ...

    def release(self, scope: tuple[str, str], key: str) -> None: ...


@dataclass
class _KeyEntry:
    fingerprint: str
    outcome: StoredOutcome | None  # None while running
    at: float


class InMemoryIdempotencyStore:
    """A thread-safe in-memory :class:`IdempotencyStore`.

    Completed keys are kept for ``ttl_s`` seconds (None: forever) and at most ``max_entries`` of
    them (the oldest completed ones are forgotten first); running keys are never evicted.
    """

    def __init__(self, max_entries: int = 100_000, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max = max_entries
        self._ttl = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str, str], _KeyEntry] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def reserve(self, scope: tuple[str, str], key: str, fingerprint: str) -> Reservation:
        full = (scope[0], scope[1], key)
        with self._lock:
            now = self._clock()
            entry = self._entries.get(full)
            if (entry is not None and entry.outcome is not None and self._ttl is not None
                    and now - entry.at >= self._ttl):
                del self._entries[full]
                entry = None
            if entry is None:
                self._entries[full] = _KeyEntry(fingerprint, None, now)
                self._evict()
                return Reservation("new")
            if entry.fingerprint != fingerprint:
                return Reservation("conflict", entry.outcome)
            if entry.outcome is None:
                return Reservation("running")
            return Reservation("done", entry.outcome)

    def complete(self, scope: tuple[str, str], key: str, outcome: StoredOutcome) -> None:
        full = (scope[0], scope[1], key)
        with self._lock:
            self._entries[full] = _KeyEntry(outcome.fingerprint, outcome, self._clock())
            self._entries.move_to_end(full)
            self._evict()

    def release(self, scope: tuple[str, str], key: str) -> None:
        with self._lock:
            entry = self._entries.get((scope[0], scope[1], key))
            if entry is not None and entry.outcome is None:
                del self._entries[(scope[0], scope[1], key)]

    def _evict(self) -> None:
        if len(self._entries) <= self._max:
            return
        for full in [k for k, e in self._entries.items() if e.outcome is not None]:
            if len(self._entries) <= self._max:
                break
            del self._entries[full]


# --------------------------------------------------------------------------------------------------
# argument parsing and validation


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
        raise _Rejected(f"not valid JSON ({_short(str(exc), 160)})") from None
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


# --------------------------------------------------------------------------------------------------
# the dispatcher


class Dispatcher:
    """Checks returned calls against the turn's policy and runs the registered handler.

    Args:
        handlers: tool -> ``handler(arguments, invocation)``; keys are flat names (what the model
            calls, ``crm__lookup`` for a namespace member) or :class:`ToolIdentity` objects.
        authorize: ``authorize(invocation)`` -> ``True`` / :func:`allow` to allow, ``False`` /
            :func:`deny` to refuse (required: pass :func:`allow_all` explicitly if every caller may
            do everything the policy allows).
        gated: tools (flat names or identities) that need a live grant to run.
        grants: the :class:`GrantChecker` consulted for gated tools.
        idempotency_store: where keys live (default: a fresh :class:`InMemoryIdempotencyStore`).
        max_argument_chars: longer argument strings are refused without being parsed.

    Thread-safe: one dispatcher may serve many sessions concurrently.
    """

    def __init__(self, handlers: Mapping[str | ToolIdentity, Handler], *, authorize: Authorizer,
                 gated: Iterable[str | ToolIdentity] = (), grants: GrantChecker | None = None,
                 idempotency_store: IdempotencyStore | None = None,
                 max_argument_chars: int = DEFAULT_MAX_ARGUMENT_CHARS) -> None:
        if not callable(authorize):
            raise TypeError("authorize must be a callable: pass allow_all to allow every call the "
                            "policy allows")
        self._by_identity: dict[ToolIdentity, Handler] = {}
        self._by_flat: dict[str, Handler] = {}
        for key, handler in handlers.items():
            if not callable(handler):
                raise TypeError(f"the handler for {key!r} is not callable")
            if isinstance(key, ToolIdentity):
                self._by_identity[key] = handler
            elif isinstance(key, str) and key:
                self._by_flat[key] = handler
            else:
                raise TypeError(f"handler keys must be flat names or ToolIdentity, got {key!r}")
        self._gated_identities = {g for g in gated if isinstance(g, ToolIdentity)}
        self._gated_flat = {g for g in gated if isinstance(g, str)}
        if grants is not None and not isinstance(grants, GrantChecker):
            raise TypeError("grants must implement has_live_grant(subject, session, "
                            "tool_identity, arguments)")
        self._grants = grants
        self._authorize = authorize
        self._store: IdempotencyStore = (idempotency_store if idempotency_store is not None
                                         else InMemoryIdempotencyStore())
        self._max_chars = max_argument_chars
        self._validators: dict[str, Any] = {}
        self._validators_lock = threading.Lock()

    # ---------------------------------------------------------------------------------- public

    def try_dispatch(self, call: Any, turn: TurnContext, *,
                     idempotency_key: str | None = None) -> DispatchResult | DispatchError:
        """Like :meth:`dispatch`, but returns the typed error instead of raising it."""
        try:
            return self.dispatch(call, turn, idempotency_key=idempotency_key)
        except DispatchError as error:
            return error

    def dispatch(self, call: Any, turn: TurnContext, *,
                 idempotency_key: str | None = None) -> DispatchResult:
        """Check ``call`` (a Responses ``function_call`` item or a Chat ``tool_calls`` entry)
        against ``turn`` and run its handler. ``idempotency_key`` defaults to the call id.
        Raises a :class:`DispatchError` subclass."""
        if not isinstance(turn, TurnContext):
            raise TypeError("turn must be a TurnContext (the policy bound to tenant, session and "
                            "caller)")
        try:
            return self._dispatch(call, turn, idempotency_key)
        except DispatchError as error:
            logger.info("tool call refused: code=%s tool=%s tenant=%s session=%s subject=%s "
                        "call_id=%s", error.code, error.tool, turn.tenant, turn.session,
                        turn.subject, error.call_id)
            raise

    def is_gated(self, spec: FunctionSpec) -> bool:
        return spec.identity in self._gated_identities or spec.flat_name in self._gated_flat

    # -------------------------------------------------------------------------------- the checks

    def _dispatch(self, raw_call: Any, turn: TurnContext, key: str | None) -> DispatchResult:
        call = ToolCall.from_any(raw_call)
        spec = self._check_name(call, turn)
        handler = self._handler_for(spec, call)
        arguments = self._check_arguments(call, spec)
        if key is None:
            key = call.call_id
        elif not isinstance(key, str) or not key:
            raise TypeError("idempotency_key must be a non-empty string or None")
        invocation = Invocation(turn=turn, call=call, spec=spec, arguments=arguments,
                                idempotency_key=key)
        self._check_authorization(invocation)
        self._check_grant(invocation)
        if key is None:
            return self._run(handler, invocation)
        return self._run_once(handler, invocation, key)

    def _check_name(self, call: ToolCall, turn: TurnContext) -> FunctionSpec:
        spec = turn.find(call)
        shown = call.flat_name
        if spec is None:
            allowed = turn.allowed_names()
            hint = (f"This turn you may call: {_names(allowed)}. Call one of those, or answer "
                    "without a tool." if allowed else "No tool may be called this turn; answer "
                    "without calling a tool.")
            raise UnknownToolError(f"There is no tool named {_short(shown)!r}. {hint} "
                                   "Nothing was run.", call_id=call.call_id, tool=_short(shown))
        if not turn.allows(spec):
            allowed = turn.allowed_names()
            hint = (f"This turn you may call only: {_names(allowed)}." if allowed
                    else "No tool may be called this turn; answer without calling a tool.")
            raise ToolNotAllowedError(f"The tool {spec.flat_name!r} is not allowed in this turn. "
                                      f"{hint} Nothing was run.", call_id=call.call_id,
                                      tool=spec.flat_name, details={"allowed": allowed})
        return spec

    def _handler_for(self, spec: FunctionSpec, call: ToolCall) -> Handler:
        handler = self._by_identity.get(spec.identity) or self._by_flat.get(spec.flat_name)
        if handler is None:
            raise ToolUnavailableError(f"The tool {spec.flat_name!r} is not available here (this "
                                       "application has no handler for it). Do not call it again; "
                                       "use another allowed tool or answer without it.",
                                       call_id=call.call_id, tool=spec.flat_name)
        return handler

    def _check_arguments(self, call: ToolCall, spec: FunctionSpec) -> dict[str, Any]:
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
            errors_text = "the arguments are nested too deeply to validate"
            raise SchemaViolationError(
                f"The arguments for {spec.flat_name!r} do not match its parameters schema: "
                f"{errors_text}.", call_id=call.call_id, tool=spec.flat_name) from None
        if errors:
            listed = [{"path": _error_path(e), "message": _short(e.message, 200)}
                      for e in errors[:_MAX_SCHEMA_ERRORS]]
            text = "; ".join(f"{item['path']}: {item['message']}" for item in listed)
            if len(errors) > _MAX_SCHEMA_ERRORS:
                text += f"; ... ({len(errors) - _MAX_SCHEMA_ERRORS} more)"
            raise SchemaViolationError(
                f"The arguments for {spec.flat_name!r} do not match its parameters schema: {text}. "
                "Fix them and call the tool again. Nothing was run.",
                call_id=call.call_id, tool=spec.flat_name, details={"errors": listed})
        return arguments

    def _validator(self, spec: FunctionSpec, call: ToolCall) -> Any:
        with self._validators_lock:
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
        with self._validators_lock:
            self._validators.setdefault(spec.digest, validator)
        return validator

    def _check_authorization(self, invocation: Invocation) -> None:
        reason: str | None = None
        try:
            decision = self._authorize(invocation)
        except Exception:  # a broken hook denies (fail closed)
            logger.exception("authorization hook failed for %s; denying", invocation.name)
            decision, reason = False, "the authorization check failed"
        if isinstance(decision, AuthorizationDecision):
            allowed, reason = decision.allowed is True, decision.reason
        else:
            allowed = decision is True
        if not allowed:
            because = f": {reason}" if reason else ""
            raise AuthorizationDeniedError(
                f"You are not permitted to call {invocation.name!r} with these arguments"
                f"{because}. Nothing was run. Do not retry the same call; tell the user it was "
                "refused.", call_id=invocation.call.call_id, tool=invocation.name,
                details={"reason": reason} if reason else None)

    def _check_grant(self, invocation: Invocation) -> None:
        if not self.is_gated(invocation.spec):
            return
        granted = False
        if self._grants is not None:
            try:
                granted = self._grants.has_live_grant(invocation.subject, invocation.session,
                                                      invocation.tool, invocation.arguments) is True
            except Exception:  # a broken grant store refuses (fail closed)
                logger.exception("grant check failed for %s; refusing", invocation.name)
        if not granted:
            raise GrantRequiredError(
                f"The tool {invocation.name!r} needs the user's approval before it can run, and "
                "there is no live approval for this call. Nothing was run. Ask the user to approve "
                "it; do not retry until they have.", call_id=invocation.call.call_id,
                tool=invocation.name)

    # ----------------------------------------------------------------------------- running

    def _run(self, handler: Handler, invocation: Invocation) -> DispatchResult:
        try:
            output = handler(invocation.arguments, invocation)
        except ToolFailure as failure:
            raise ToolFailedError(
                f"The tool {invocation.name!r} failed: {failure.message}",
                call_id=invocation.call.call_id, tool=invocation.name,
                details=failure.details) from failure
        except Exception as exc:
            logger.exception("handler for %s raised", invocation.name)
            raise ToolFailedError(
                f"The tool {invocation.name!r} failed with an internal error. Tell the user it "
                "failed; retrying the same call may not help.",
                call_id=invocation.call.call_id, tool=invocation.name) from exc
        return DispatchResult(call_id=invocation.call.call_id, tool=invocation.tool,
                              arguments=invocation.arguments, output=output,
                              idempotency_key=invocation.idempotency_key)

    def _run_once(self, handler: Handler, invocation: Invocation, key: str) -> DispatchResult:
        scope = invocation.turn.scope
        fingerprint = arguments_digest({"tool": invocation.tool.as_json(),
                                        "arguments": invocation.arguments})
        reservation = self._store.reserve(scope, key, fingerprint)
        call_id = invocation.call.call_id
        if reservation.state == "conflict":
            raise IdempotencyConflictError(
                f"The idempotency key {_short(key)!r} was already used in this session for a "
                f"different call (another tool or other arguments). Nothing was run. Every new "
                "call needs a new call id.", call_id=call_id, tool=invocation.name,
                details={"idempotency_key": key})
        if reservation.state == "running":
            raise CallInProgressError(
                f"A call with idempotency key {_short(key)!r} is still running. Nothing was run "
                "again; wait for its result instead of calling again.", call_id=call_id,
                tool=invocation.name, details={"idempotency_key": key})
        if reservation.state == "done":
            return self._replay(reservation.outcome, call_id)
        try:
            result = self._run(handler, invocation)
        except ToolFailedError as error:
            self._store.complete(scope, key, StoredOutcome(fingerprint, error=error))
            raise
        except BaseException:
            self._store.release(scope, key)
            raise
        self._store.complete(scope, key, StoredOutcome(fingerprint, result=result))
        return result

    @staticmethod
    def _replay(outcome: StoredOutcome | None, call_id: str | None) -> DispatchResult:
        if outcome is None or (outcome.result is None and outcome.error is None):
            raise RuntimeError("the idempotency store returned a completed key without an outcome")
        if outcome.result is not None:
            stored = outcome.result
            try:  # the caller may mutate what it gets; the stored outcome must not change
                output, arguments = copy.deepcopy(stored.output), copy.deepcopy(stored.arguments)
            except Exception:  # noqa: BLE001 - an output that cannot be copied is shared as is
                output, arguments = stored.output, stored.arguments
            return dataclasses.replace(stored, replayed=True, call_id=call_id, output=output,
                                       arguments=arguments)
        error = copy.copy(outcome.error)
        error.replayed = True
        error.call_id = call_id
        error.details = {**error.details, "replayed": True}
        raise error
