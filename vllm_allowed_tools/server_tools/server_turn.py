"""One turn's decisions over the calls vLLM would run itself: :class:`ServerTurn`.

The middleware builds a :class:`ServerTurn` for every Responses request that offers server-side
tools and registers it under a random token that rides in the request (:data:`TURN_KEY`); vLLM's
loop asks it, through the hook in ``vllm_glue/server_tool_hook.py``, before each call runs
(:meth:`ServerTurn.decide`), and the backstop at the tool session asks it again right before the
session is called (:meth:`ServerTurn.authorize`): a call it did not decide "execute" never runs.
The output guard reads what happened (executed, paused for an approval, refused) from the same
object. Blocking (a gated call asks the approval engine, which may read the grant store); no vLLM.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..approvals.digests import arguments_digest
from ..approvals.items import ToolCallApproval
from ..approvals.outcomes import Decline, ProposedCall, Release
from ..call_filter import CallFilter, CallKind
from .tools import ITEM_TYPE, ServerTarget, ServerTool, ServerTools, recipient_target

__all__ = ["TURN_KEY", "ResumedCall", "ServerDecision", "ServerSelection", "ServerTurn",
           "ServerTurnFilter", "register", "registered", "unregister"]

#: the body key under which the turn's token reaches vLLM's loop (``request.model_extra``)
TURN_KEY = "vllm_allowed_tools_server_turn"

#: execute: vLLM runs it; pause: it waits for an approval (the response ends with the approval
#: item); refuse: it may not run (the turn ends as a violation); stop: allowed, but the request's
#: max_tool_calls is reached (the response ends with the call, not run); incomplete: the call is not
#: a complete one (cut off by the token limit, ended by a stop token other than harmony's call end,
#: or arguments that do not parse): never run, never asked about, the response ends with it
Verdict = Literal["execute", "pause", "refuse", "stop", "incomplete"]
Wire = Literal["mcp", "elicitation"]


@dataclass(frozen=True)
class ServerSelection:
    """The server-side entries of an ``allowed_tools`` selection: (request tool index, tool name or
    None for every tool of it)."""

    entries: frozenset[tuple[int, str | None]]
    mode: str

    def allows(self, tool: ServerTool, tool_name: str) -> bool:
        return (tool.index, None) in self.entries or (tool.index, tool_name) in self.entries

    def recipients(self, tools: ServerTools) -> list[tuple[str, str | None]]:
        """(built-in, tool name or None) the grammar admits, in a stable order."""
        out = []
        for index, name in sorted(self.entries, key=lambda e: (e[0], e[1] or "")):
            tool = next(t for t in tools.tools if t.index == index)
            names = [name] if name is not None else (
                sorted(tool.allowed_names) if tool.allowed_names is not None else [None])
            out.extend((tool.builtin, n) for n in names if n is None or tool.offers(n))
        return out


@dataclass(frozen=True)
class ServerDecision:
    verdict: Verdict
    target: ServerTarget
    arguments: str
    reason: str
    tool: ServerTool | None = None
    #: pause: the approval item to send instead of the call, and on which wire
    approval: ToolCallApproval | None = None
    wire: Wire = "elicitation"
    #: execute of an approved call: its elicitation id (``approval_request_id``)
    elicitation_id: str | None = None


@dataclass(frozen=True)
class ResumedCall:
    """An answered approval this request carries: the recorded call to run (``accept``) or to show
    the model as refused (``refusal`` set), then generation continues."""

    elicitation_id: str
    target: ServerTarget
    arguments: str
    wire: Wire
    refusal: str | None = None


@dataclass
class ExecutedCall:
    target: ServerTarget
    arguments: str
    output: str | None = None
    elicitation_id: str | None = None
    error: str | None = None


class ServerTurn:
    """The decisions of one request over its server-side calls (see the module docstring).

    ``propose``: the approval engine's decision for one gated call (``ApprovalEngine.propose``
    bound to the principal and session), None when the server has no grant store: a gated call is
    then refused. ``resume``: the answered approval this request carries."""

    def __init__(self, tools: ServerTools, *, selection: ServerSelection | None,
                 tool_choice_none: bool = False,
                 operator_gates: Callable[[ServerTool, str], bool] = lambda tool, name: False,
                 propose: Callable[[ProposedCall], Release | ToolCallApproval | Decline] | None = None,
                 resume: ResumedCall | None = None, max_tool_calls: int | None = None,
                 store: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.tools = tools
        self.selection = selection
        self.tool_choice_none = tool_choice_none
        self.operator_gates = operator_gates
        self.propose = propose
        self.resume = resume
        self.max_tool_calls = max_tool_calls
        self.store = store
        self.clock = clock
        self.token = secrets.token_hex(16)
        #: a ``required`` turn's grammar once one of its calls ran (the same allowlist in ``auto``
        #: mode: the requirement is met, and forcing a call on every later generation of vLLM's
        #: loop would never let it end); set by the parser, applied by the hook
        self.grammar_after_a_call: str | None = None
        #: the SamplingParams vLLM's loop generates this turn with (set by the hook)
        self.sampling_params: Any = None
        self.decisions: list[ServerDecision] = []
        self.executed: list[ExecutedCall] = []
        self._decided: dict[int, tuple[Any, ServerDecision]] = {}
        self._ran: set[int] = set()
        self._lock = threading.Lock()

    # -- the decision

    def allowed(self, target: ServerTarget) -> tuple[ServerTool | None, str]:
        """The request tool that lets ``target`` run this turn, or None and why not."""
        tool = self.tools.for_builtin(target.builtin)
        if tool is None:
            return None, f"the request offers no tool that runs {target.builtin!r}"
        if self.tool_choice_none:
            return None, "tool_choice is \"none\""
        if not tool.offers(target.tool_name):
            return None, (f"{target.tool_name!r} is not in the allowed_tools of "
                          f"{tool.param} ({tool.namespace})")
        if self.selection is not None and not self.selection.allows(tool, target.tool_name):
            return None, f"{tool.namespace}.{target.tool_name} is not in this turn's allowed_tools"
        return tool, ""

    def gated(self, tool: ServerTool, tool_name: str) -> tuple[bool, Wire]:
        """Whether a call needs an approval, and on which wire it is asked: the client's
        ``require_approval`` (an mcp tool: OpenAI's mcp_approval_request) or the operator's policy
        (an elicitation); the client's setting can only add to the operator's."""
        by_client = tool.require_approval is not None and tool.require_approval.gates(tool_name)
        if by_client:
            return True, "mcp"
        return self.operator_gates(tool, tool_name), "elicitation"

    def decide(self, recipient: Any, arguments: Any, message: Any = None) -> ServerDecision | None:
        """Decide the call vLLM is about to run (``message``: the harmony message it would
        dispatch, remembered for :meth:`authorize`); None: vLLM runs nothing for this recipient."""
        target = recipient_target(recipient)
        if target is None:
            return None
        text = arguments if isinstance(arguments, str) else ""
        decision = self._decide(target, text)
        with self._lock:
            self.decisions.append(decision)
            if message is not None:
                self._decided[id(message)] = (message, decision)
        return decision

    def _decide(self, target: ServerTarget, arguments: str) -> ServerDecision:
        tool, why = self.allowed(target)
        if tool is None:
            return ServerDecision("refuse", target, arguments, why)
        if self.max_tool_calls is not None and sum(
                d.verdict == "execute" for d in self.decisions) >= self.max_tool_calls:
            return ServerDecision("stop", target, arguments, "max_tool_calls reached", tool)
        gated, wire = self.gated(tool, target.tool_name)
        if not gated:
            return ServerDecision("execute", target, arguments, "not gated", tool)
        if self.propose is None:
            return ServerDecision("refuse", target, arguments,
                                  "it needs an approval and this server keeps no grant store", tool)
        call = ProposedCall(call_id=f"call_{secrets.token_hex(8)}",
                            identity=tool.identity(target.tool_name), arguments=arguments,
                            definition_digest=tool.definition_digest(target.tool_name),
                            hint={"required": True} if wire == "mcp" else None)
        try:
            result = self.propose(call)
        except Exception as exc:   # noqa: BLE001 - the store is down, a bad hint: fail closed
            return ServerDecision("refuse", target, arguments,
                                  f"its approval could not be decided ({type(exc).__name__})", tool)
        if isinstance(result, Release):
            return ServerDecision("execute", target, arguments, f"released by {result.via}", tool)
        if isinstance(result, ToolCallApproval):
            return ServerDecision("pause", target, arguments, "needs an approval", tool,
                                  approval=result, wire=wire)
        return ServerDecision("refuse", target, arguments, "it can never be approved here", tool)

    def incomplete(self, recipient: Any, arguments: Any, reason: str) -> ServerDecision | None:
        """Record a call vLLM's loop would run that is not complete (see :data:`Verdict`): it is
        never decided, so it never runs and is never put before a person; None: vLLM runs nothing
        for this recipient anyway."""
        target = recipient_target(recipient)
        if target is None:
            return None
        decision = ServerDecision("incomplete", target, arguments if isinstance(arguments, str)
                                  else "", reason, self.tools.for_builtin(target.builtin))
        with self._lock:
            self.decisions.append(decision)
        return decision

    def resumed_decision(self, message: Any) -> ServerDecision:
        """The decision for the call this request resumes (an accepted approval), remembered for
        :meth:`authorize` like any other."""
        assert self.resume is not None and self.resume.refusal is None
        tool, why = self.allowed(self.resume.target)
        decision = (ServerDecision("execute", self.resume.target, self.resume.arguments,
                                   "approved", tool, elicitation_id=self.resume.elicitation_id)
                    if tool is not None else
                    ServerDecision("refuse", self.resume.target, self.resume.arguments, why))
        with self._lock:
            self.decisions.append(decision)
            self._decided[id(message)] = (message, decision)
        return decision

    # -- the backstop

    def authorize(self, message: Any, recipient: Any, arguments: Any) -> ServerDecision | None:
        """The execute decision for exactly this message, taken once: None when it was not decided
        "execute" (or already ran, or changed since): then it must not run."""
        with self._lock:
            entry = self._decided.get(id(message))
            if entry is None or entry[0] is not message or id(message) in self._ran:
                return None
            decision = entry[1]
            if decision.verdict != "execute" or decision.target.recipient != recipient \
                    or decision.arguments != (arguments if isinstance(arguments, str) else ""):
                return None
            self._ran.add(id(message))
            return decision

    def record(self, decision: ServerDecision, output: str | None, error: str | None = None) -> None:
        with self._lock:
            self.executed.append(ExecutedCall(decision.target, decision.arguments, output,
                                              decision.elicitation_id, error))

    # -- what the output guard reads

    @property
    def paused(self) -> ServerDecision | None:
        return next((d for d in self.decisions if d.verdict == "pause"), None)

    @property
    def stopped(self) -> ServerDecision | None:
        """The call the loop ended at without running it (max_tool_calls, or not complete)."""
        return next((d for d in self.decisions if d.verdict in ("stop", "incomplete")), None)

    @property
    def refused(self) -> ServerDecision | None:
        return next((d for d in self.decisions if d.verdict == "refuse"), None)

    def claim(self, elicitation_id: str, target: ServerTarget, arguments: str) -> Any:
        """The store's claim on the one execution of an approved call (None: claimed now)."""
        return self.store.claim_execution(elicitation_id, recipient=target.recipient,
                                          arguments_digest=arguments_digest(arguments),
                                          now=self.clock())

    def finish(self, elicitation_id: str, output: str) -> None:
        self.store.finish_execution(elicitation_id, output=output, now=self.clock())


class ServerTurnFilter(CallFilter):
    """The guard's filter on a turn with server-side tools: the inner filter for functions (none
    allowed when the selection names server-side tools only), and the built-in call items of the
    server-side tools this turn may run (the hook decided each call before it ran)."""

    def __init__(self, inner: CallFilter | None, turn: ServerTurn, *, functions: bool) -> None:
        self.inner = inner
        self.turn = turn
        self.functions = functions
        kinds = set()
        for tool in turn.tools.tools:
            if turn.selection is None or any(index == tool.index
                                             for index, _ in turn.selection.entries):
                kinds.add(ITEM_TYPE[tool.builtin])
                if tool.builtin in ("python", "browser"):   # a resumed call; a streamed browser
                    kinds.add("mcp_call")                    # call's twin (server_tools.response)
        self.item_types = frozenset(kinds)

    def allows(self, kind: CallKind, name: str | None) -> bool:
        if kind == "builtin":
            if name in self.item_types:
                return True
            return self.inner is not None and self.inner.allows(kind, name)
        return self.functions and self.inner is not None and self.inner.allows(kind, name)

    def knows(self, kind: CallKind, name: str) -> bool | None:
        return self.inner.knows(kind, name) if self.inner is not None else None

    # the allowlist's own attributes, for code that reads them from the guard's filter
    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


# -- the process's registry of live turns

_TURNS: dict[str, ServerTurn] = {}
_TURNS_LOCK = threading.Lock()


def register(turn: ServerTurn) -> dict[str, Any]:
    """Make ``turn`` findable by vLLM's loop; the body entry that carries its token."""
    with _TURNS_LOCK:
        _TURNS[turn.token] = turn
    return {TURN_KEY: turn.token}


def unregister(turn: ServerTurn) -> None:
    with _TURNS_LOCK:
        _TURNS.pop(turn.token, None)


def registered(extra: Mapping[str, Any] | None) -> ServerTurn | None:
    """The turn a request's extra fields name (None: no token, or one this process never issued)."""
    token = (extra or {}).get(TURN_KEY)
    if not isinstance(token, str):
        return None
    with _TURNS_LOCK:
        return _TURNS.get(token)


@dataclass(frozen=True)
class HookStatus:
    """Whether the hook in vLLM's loop is installed in this process (set by the glue)."""

    installed: bool = False
    reason: str = "the server-side tool hook is not installed (no allowed_* tool parser)"
    versions: tuple[str, ...] = field(default_factory=tuple)


_HOOK = [HookStatus()]


def set_hook_status(status: HookStatus) -> None:
    _HOOK[0] = status


def hook_status() -> HookStatus:
    return _HOOK[0]
