"""A returned call and the turn it is judged against: either API's call shape read into one
:class:`ToolCall`, and the turn's allowlist bound to a tenant, a session and a caller."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..request import Api, FunctionSpec, ToolIdentity, TurnAllowlist, flat_name, resolve_allowlist
from .dispatch_errors import MalformedCallError
from .messages import short


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


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


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
                f"a {short(call_type)!s} item is not a function call; only function tools can be "
                "dispatched", call_id=_opt_str(data.get("call_id") or data.get("id")))
        call_id = _opt_str(call_id)
        if not isinstance(name, str) or not name:
            raise MalformedCallError("the call has no function name", call_id=call_id)
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise MalformedCallError("the call's namespace must be a non-empty string",
                                     call_id=call_id)
        return cls(name=name, arguments=arguments, call_id=call_id, namespace=namespace,
                   source=source)  # type: ignore[arg-type]
