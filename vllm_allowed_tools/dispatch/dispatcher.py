"""The dispatcher: checks a returned call against this turn's allowlist, the caller's authorization,
grants and idempotency, in that order, then runs the application's handler. The order and every
refusal are specified in docs/dispatch.md."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ..request import FunctionSpec, ToolIdentity
from .call_arguments import DEFAULT_MAX_ARGUMENT_CHARS, ArgumentChecker
from .tool_calls import ToolCall, TurnContext
from .dispatch_errors import (
    AuthorizationDeniedError,
    DispatchError,
    GrantRequiredError,
    ToolFailedError,
    ToolFailure,
    ToolNotAllowedError,
    ToolUnavailableError,
    UnknownToolError,
)
from .hooks import AuthorizationDecision, Authorizer, GrantChecker, Handler, Invocation
from .idempotency import IdempotencyStore, InMemoryIdempotencyStore, run_once
from .messages import listed_names, short
from .results import DispatchResult

logger = logging.getLogger(__name__)


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
        self._arguments = ArgumentChecker(max_argument_chars)

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
        arguments = self._arguments.check(call, spec)
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
        return run_once(self._store, invocation, key, lambda: self._run(handler, invocation))

    def _check_name(self, call: ToolCall, turn: TurnContext) -> FunctionSpec:
        spec = turn.find(call)
        shown = call.flat_name
        if spec is None:
            allowed = turn.allowed_names()
            hint = (f"This turn you may call: {listed_names(allowed)}. Call one of those, or "
                    "answer without a tool." if allowed else "No tool may be called this turn; "
                    "answer without calling a tool.")
            raise UnknownToolError(f"There is no tool named {short(shown)!r}. {hint} "
                                   "Nothing was run.", call_id=call.call_id, tool=short(shown))
        if not turn.allows(spec):
            allowed = turn.allowed_names()
            hint = (f"This turn you may call only: {listed_names(allowed)}." if allowed
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

    @staticmethod
    def _run(handler: Handler, invocation: Invocation) -> DispatchResult:
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
