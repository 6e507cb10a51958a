"""The output guard: one place that decides whether a model's tool call may reach the client.

Used at the API boundary for both APIs, unary and streaming, whatever produced the call (structured
``required``-mode output, text parsed by a tool parser, streamed deltas, parallel calls, calls next
to reasoning items). No vLLM import: it works on the JSON bodies and SSE events vLLM sends.

Identity
    A call is identified by its **flat name**, the name the model sees and emits: a Chat
    ``tool_calls[].function.name`` as is; a Responses ``function_call`` item's ``name``, prefixed by
    ``f"{namespace}__"`` when the item carries a ``namespace`` (vLLM 0.32 resolves a flattened model
    output back to ``(namespace, name)``; we flatten again, never split on ``__``). That is the
    identity the request side resolved (``policy.py``), so both sides agree, namespaces included.

Policy (:class:`CallFilter`)
    Anything with ``is_allowed(flat_name: str | None) -> bool``:

    * an ``allowed_tools`` request: :class:`~vllm_allowed_tools.request.rewrite.WireAllowlist` or
      :class:`~vllm_allowed_tools.request.allowlist.TurnAllowlist` (only the allowlist is callable);
    * a plain request with tools: :class:`AllowedNames` (``AllowedNames.from_request(body, api)``):
      every catalog function is callable, a name outside the catalog is a violation in every mode,
      plain ``auto`` included; the request's own ``custom`` tools may be called.

    Responses ``custom_tool_call`` items are checked with the optional ``is_custom_allowed(name)``;
    a policy without that method (every allowlist policy: ``allowed_tools`` selects functions only)
    refuses them. Do not pass a plain request's ``TurnAllowlist``: for ``tool_choice: "none"`` it
    refuses every name, and it does not know the request's custom tools; use ``AllowedNames``.

Unary (source ``unary_guard``)
    :func:`check_chat_completion` / :func:`check_responses_object` raise
    :class:`AllowedToolsViolation` (HTTP 500, ``type: server_error``, ``code:
    allowed_tools_violation``, the offending name in the message; send ``exc.to_openai()`` with
    ``exc.status`` instead of the body). They count the violation in metrics once, when raising.
    Calls still in the text (a parser that failed to parse them) are not tool calls and not checked.

Text is not searched for call markup (a decision)
    A call cut off by the token limit comes back from vLLM's parsers as text (``<tool_call>{"name":
    ...``). That channel is closed where the format and the mode are known, in the parser wrappers
    (``vllm_glue/parsers.py``: with a policy no text from a call trigger on; the response stays
    ``incomplete`` / ``length``). The guard does not refuse text holding a trigger as a backstop:
    it is format-agnostic (``[TOOL_CALLS]`` is prose to a hermes model), it also guards plain
    requests, where nothing makes a trigger start a call (``tool_choice: "none"`` text may quote
    one, and vanilla vLLM returns it), and for an allowlist turn, where our grammar does make every
    trigger the start of a call, refusing would turn a truncated answer into a 500 instead of the
    ``incomplete`` answer the client can act on. Markup in text is not a call: no OpenAI client
    runs it.

Streaming (source ``stream_guard``)
    Guards are push-based: ``feed(event_dict) -> list[dict]`` returns what to send now, in order;
    ``finish() -> list[dict]`` when upstream ended. After a violation ``terminal`` is True (set before
    the terminal event is returned), ``violation`` holds the error (its ``.name`` is for server
    logs), and every later call returns ``[]``: the caller must stop reading upstream and close it
    (that aborts the engine request). An event returned unchanged is the very object fed, so a
    byte-level caller can forward the original bytes (:class:`GuardedSSE` does). Output is always a
    delayed prefix of the input plus, on a violation, the guard's own closing events, so
    ``output_index`` es stay consistent and nothing of a refused call (its ``added`` event, argument
    deltas, ``done`` events, its name, its arguments) is ever emitted. Streamed error messages do not
    name the refused tool (its name is a byte of the call).

    :class:`ResponsesStreamGuard` works on the JSON ``data`` of each Responses event (event name ==
    ``data["type"]``). A ``function_call`` item's identity is known at ``response.output_item.added``
    (vLLM sets the name there); if the name is missing or empty there, the item's events (and all
    later ones, to keep the order) are held until ``response.function_call_arguments.done`` or
    ``response.output_item.done`` names it. Names in ``arguments.done``, ``output_item.done`` and the
    final ``response.completed`` / ``response.incomplete`` object are checked too. On a violation it
    returns ``response.output_item.done`` with ``status: "incomplete"`` for every item already sent
    as added and not yet done (ascending ``output_index``; partial text / arguments filled in), then
    exactly one ``response.failed`` whose ``response`` is the last ``response.created`` /
    ``in_progress`` snapshot with ``status: "failed"``, ``error: {"code": "allowed_tools_violation",
    "message": ...}`` and ``output`` = the items sent so far (closed ones as incomplete).
    ``sequence_number`` is rewritten to the guard's own counter (it starts at the first upstream
    value and increases by one per emitted event), which leaves vLLM's numbering untouched unless
    the guard adds events.

    :class:`ChatStreamGuard` works on ``chat.completion.chunk`` dicts. A tool call's name may be split
    over several deltas, so chunks are held from the first delta of a call, keyed by (choice
    ``index``, tool ``index``), until its name is complete: a delta for it carries non-empty
    ``arguments`` (arguments follow the name in every format), another tool index of the same
    choice starts, the choice gets a ``finish_reason``, or the stream ends (``finish``). Then the
    name is checked: allowed releases the held chunks unchanged and in order; refused drops them and
    returns one error chunk ``{"error": {"message", "type": "server_error", "param": null,
    "code": "allowed_tools_violation"}}`` (what vLLM itself streams on a generation error, and what
    the OpenAI SDKs raise ``APIError`` on). **Chat termination choice**: after that chunk the stream
    ends with ``data: [DONE]`` (vLLM's own behaviour after a streamed error; OpenAI clients stop at
    the error chunk either way); upstream's own ``[DONE]`` and everything else is dropped. vLLM sends
    a name in one delta, so an allowed call's name chunk is delayed by exactly one chunk.

:class:`GuardedSSE` wraps either guard for raw SSE bytes in any chunking (``feed(bytes) -> bytes``,
``close() -> bytes``, ``terminal``, ``violation``), which is what an ASGI ``send`` wrapper needs:
events nobody rewrote keep their exact bytes, so a stream of allowed calls passes byte for byte.

Not enforced here: ``parallel_tool_calls: false`` (vLLM itself drops calls after the first).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import AllowedToolsError
from ..metrics import record_violation
from ..request import flat_name
from .sse import SSEEvent, SSEFramer

__all__ = [
    "CODE_VIOLATION",
    "AllowedToolsViolation",
    "CallFilter",
    "AllowedNames",
    "ChatStreamGuard",
    "GuardedSSE",
    "ResponsesStreamGuard",
    "SOURCE_UNREADABLE",
    "check_chat_completion",
    "check_responses_object",
    "flat_name",
    "request_tools",
    "unreadable_violation",
]

CODE_VIOLATION = "allowed_tools_violation"

_STREAM_MESSAGE = ("The model produced a tool call outside this turn's allowed tools. The call was "
                   "withheld and the response stopped (allowed_tools_violation); retry the request.")

SOURCE_UNREADABLE = "unreadable"   # metrics source of a response the guard could not read


@runtime_checkable
class CallFilter(Protocol):
    """What the guard needs from a policy. WireAllowlist, TurnAllowlist and AllowedNames satisfy it."""

    def is_allowed(self, flat_name: str | None) -> bool: ...


def request_tools(body: Mapping[str, Any], api: str) -> Iterator[tuple[str, str, str | None, str]]:
    """(param, kind, namespace, name) of each named function or custom tool a request body offers
    (``kind``: ``"function"`` or ``"custom"``; Chat's nested shape, Responses' flat one and its
    namespace members); entries it cannot read are skipped."""
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, Mapping):
            continue
        kind, param = tool.get("type"), f"tools[{index}]"
        if api == "chat":
            fn = tool.get("function") if kind == "function" else tool.get("custom")
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                yield param, "function" if kind == "function" else "custom", None, fn["name"]
        elif kind in ("function", "custom") and isinstance(tool.get("name"), str):
            yield param, kind, None, tool["name"]
        elif kind == "namespace" and isinstance(tool.get("name"), str):
            members = tool.get("tools")
            for j, member in enumerate(members if isinstance(members, list) else ()):
                if isinstance(member, Mapping) and isinstance(member.get("name"), str):
                    member_kind = "custom" if member.get("type") == "custom" else "function"
                    yield f"{param}.tools[{j}]", member_kind, tool["name"], member["name"]


class AllowedNames:
    """"Catalog only": every catalog function (flat name) may be called, anything else may not.

    For plain requests (``auto`` / ``required`` / named without ``allowed_tools``): the guard still
    stops calls to names that are not in the request at all. ``custom_names`` are the request's
    Responses ``custom`` tools, which vLLM may emit as ``custom_tool_call`` items.
    """

    __slots__ = ("catalog", "custom_names")

    def __init__(self, names: Iterable[str], custom_names: Iterable[str] = ()) -> None:
        self.catalog = frozenset(names)
        self.custom_names = frozenset(custom_names)

    def is_allowed(self, flat_name: str | None) -> bool:
        return flat_name is not None and flat_name in self.catalog

    def is_custom_allowed(self, name: str | None) -> bool:
        return name is not None and name in self.custom_names

    @classmethod
    def from_request(cls, body: Mapping[str, Any], api: str) -> AllowedNames:
        """The catalog of a request body (``api``: ``"chat"`` or ``"responses"``); permissive:
        entries it cannot read are skipped (vLLM rejects malformed tools itself)."""
        names: list[str] = []
        custom: list[str] = []
        for _, kind, namespace, name in request_tools(body, api):
            (custom if kind == "custom" else names).append(flat_name(name, namespace))
        return cls(names, custom)

    def __repr__(self) -> str:
        return f"AllowedNames({sorted(self.catalog)!r}, custom={sorted(self.custom_names)!r})"


class AllowedToolsViolation(AllowedToolsError):
    """The model (or a parser) produced a call outside the turn's policy; nothing of it was sent.

    ``name`` is the offending flat name (None when the call had none), ``source`` the metrics label
    (``unary_guard`` / ``stream_guard`` / ``parser``), ``kind`` ``"function"`` or ``"custom"``.
    """

    status = 500
    type = "server_error"
    code = CODE_VIOLATION

    def __init__(self, message: str, *, name: str | None, source: str,
                 kind: str = "function") -> None:
        super().__init__(message, param=None)
        self.name = name
        self.source = source
        self.kind = kind




def _refusal_reason(policy: Any, name: str | None, kind: str) -> str:
    if name is None:
        return "has no name"
    if kind == "custom":
        return "is a custom tool, which this turn's policy does not allow"
    catalog = getattr(policy, "catalog", None)
    known: bool | None = None
    if isinstance(catalog, (set, frozenset)):
        known = name in catalog
    elif callable(getattr(policy, "lookup", None)):
        known = policy.lookup(name) is not None
    if known is False:
        return "is not in the request's tool catalog"
    return "is not in this turn's allowed tools"


def _refuse(policy: Any, name: str | None, kind: str, source: str, *,
            public_name: bool) -> AllowedToolsViolation:
    if public_name:
        shown = repr(name) if name is not None else "(unnamed)"
        message = (f"The model produced a call to {kind} tool {shown}, which "
                   f"{_refusal_reason(policy, name, kind)}. The response was withheld "
                   f"(allowed_tools_violation); retry the request.")
    else:
        message = _STREAM_MESSAGE
    return AllowedToolsViolation(message, name=name, source=source, kind=kind)


def unreadable_violation(what: str) -> AllowedToolsViolation:
    """The violation for a response the guard cannot read while a policy applies (``what`` says
    which part: an unknown content type, a body that is not JSON, a stream event whose data is not
    a JSON object): it may hold a call, so it is refused like one (source ``unreadable``). Not
    counted here: the caller counts it when it refuses."""
    return AllowedToolsViolation(
        f"The response could not be checked against this turn's tools ({what}), so it was withheld "
        f"(allowed_tools_violation); retry the request.", name=None, source=SOURCE_UNREADABLE,
        kind="unreadable")


def _allowed(policy: Any, name: str | None, kind: str) -> bool:
    if kind == "custom":
        check = getattr(policy, "is_custom_allowed", None)
        return bool(check(name)) if callable(check) and name is not None else False
    return name is not None and bool(policy.is_allowed(name))


# ------------------------------------------------------------------------------------------ unary

def _item_identity(item: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """(kind, flat name) of a Responses output item that is a model tool call, else None."""
    kind = item.get("type")
    if kind == "function_call":
        return "function", flat_name(item.get("name"), item.get("namespace"))
    if kind == "custom_tool_call":
        return "custom", flat_name(item.get("name"), item.get("namespace"))
    return None


def _responses_violation(body: Any, policy: Any, source: str, *,
                         public_name: bool) -> AllowedToolsViolation | None:
    output = body.get("output") if isinstance(body, Mapping) else None
    for item in output if isinstance(output, list) else ():
        if isinstance(item, Mapping):
            identity = _item_identity(item)
            if identity is not None and not _allowed(policy, identity[1], identity[0]):
                return _refuse(policy, identity[1], identity[0], source, public_name=public_name)
    return None


def check_responses_object(body: Mapping[str, Any], policy: CallFilter, *,
                           source: str = "unary_guard") -> None:
    """Raise :class:`AllowedToolsViolation` if a Responses object's ``output`` holds a refused call
    (``function_call`` by flat name; ``custom_tool_call`` per ``is_custom_allowed``)."""
    violation = _responses_violation(body, policy, source, public_name=True)
    if violation is not None:
        record_violation(source)
        raise violation


def _chat_call_identity(call: Any) -> tuple[str, str | None]:
    if not isinstance(call, Mapping):
        return "function", None
    if call.get("type") == "custom" or ("custom" in call and "function" not in call):
        custom = call.get("custom")
        return "custom", flat_name(custom.get("name")) if isinstance(custom, Mapping) else None
    fn = call.get("function")
    return "function", flat_name(fn.get("name")) if isinstance(fn, Mapping) else None


def check_chat_completion(body: Mapping[str, Any], policy: CallFilter, *,
                          source: str = "unary_guard") -> None:
    """Raise :class:`AllowedToolsViolation` if any ``choices[].message`` calls a refused tool
    (``tool_calls[].function.name``, and the legacy ``function_call.name``)."""
    choices = body.get("choices") if isinstance(body, Mapping) else None
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, Mapping) else None
        if not isinstance(message, Mapping):
            continue
        calls = message.get("tool_calls")
        identities = [_chat_call_identity(call) for call in (calls if isinstance(calls, list) else ())]
        legacy = message.get("function_call")
        if isinstance(legacy, Mapping):
            identities.append(("function", flat_name(legacy.get("name"))))
        for kind, name in identities:
            if not _allowed(policy, name, kind):
                record_violation(source)
                raise _refuse(policy, name, kind, source, public_name=True)


# -------------------------------------------------------------------------------- Responses stream

_UPSTREAM_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed",
                                "error"})
_SNAPSHOT_TYPES = frozenset({"response.created", "response.in_progress", "response.queued"})
_TEXT_DELTAS = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                          "response.refusal.delta"})


class _Sent:
    """An output item the client has seen added: enough state to close it as incomplete."""

    __slots__ = ("done", "item", "parts", "payload")

    def __init__(self, item: Mapping[str, Any]) -> None:
        self.item = dict(item)
        self.parts: dict[int, tuple[dict[str, Any], list[str]]] = {}
        self.payload: list[str] | None = None     # arguments / custom input deltas
        self.done: dict[str, Any] | None = None   # the item of its output_item.done

    def closed(self) -> dict[str, Any]:
        if self.done is not None:
            return self.done
        item = dict(self.item)
        item["status"] = "incomplete"
        if self.payload is not None:
            item["input" if item.get("type") == "custom_tool_call" else "arguments"] = \
                "".join(self.payload)
        if self.parts:
            content = []
            for index in sorted(self.parts):
                part, pieces = self.parts[index]
                field = "refusal" if part.get("type") == "refusal" else "text"
                content.append({**part, field: "".join(pieces)})
            item["content"] = content
        return item


def _index_key(index: Any) -> tuple[bool, int]:
    return (not isinstance(index, int), index if isinstance(index, int) else 0)


class ResponsesStreamGuard:
    """Guard a Responses event stream (see the module docstring for the exact semantics)."""

    def __init__(self, policy: CallFilter, *, source: str = "stream_guard") -> None:
        self.policy = policy
        self.source = source
        self.terminal = False
        self.violation: AllowedToolsViolation | None = None
        self._seq: int | None = None
        self._snapshot: dict[str, Any] | None = None
        self._sent: dict[int, _Sent] = {}
        self._held: list[dict[str, Any]] | None = None
        self._pending: tuple[Any, Any, Any, str] | None = None  # (output_index, item id, ns, kind)
        self._named: dict[Any, str] = {}   # output_index -> name learnt while held

    # -- public

    @property
    def holding(self) -> bool:
        """True while events are withheld until a call's name is known."""
        return self._held is not None

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if self.terminal:
            return []
        if self._held is not None:
            return self._feed_held(event)
        return self._step(event)

    def finish(self) -> list[dict[str, Any]]:
        """Upstream ended (with or without a terminal event): a call still unnamed is refused."""
        if self.terminal or self._held is None:
            return []
        return self._fail(None, self._pending[3] if self._pending else "function")

    # -- holding an item whose name is not known yet

    def _feed_held(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        assert self._held is not None and self._pending is not None
        index, item_id, namespace, kind = self._pending
        kind_type = event.get("type") if isinstance(event, dict) else None
        name: str | None = None
        resolved = False
        if kind_type == "response.function_call_arguments.done" and self._is_pending(event):
            name, resolved = event.get("name"), bool(event.get("name"))
        elif kind_type == "response.output_item.done" and self._is_pending(event):
            item = event.get("item") or {}
            name, resolved = item.get("name"), bool(item.get("name"))
            namespace = item.get("namespace") or namespace
        elif kind_type in _UPSTREAM_TERMINAL:
            response = event.get("response") if isinstance(event.get("response"), dict) else {}
            for item in response.get("output") or ():
                if isinstance(item, dict) and item.get("id") == item_id and item.get("name"):
                    name, resolved = item.get("name"), True
                    namespace = item.get("namespace") or namespace
            if not resolved:   # the call ended without a name: fail closed
                return self._fail(None, kind)
        self._held.append(event)
        if not resolved:
            return []
        flat = flat_name(name, namespace)
        if not _allowed(self.policy, flat, kind):
            return self._fail(flat, kind)
        held, self._held, self._pending = self._held, None, None
        self._named[index] = flat  # type: ignore[assignment]
        out: list[dict[str, Any]] = []
        for queued in held:
            if self.terminal:
                break
            if self._held is not None:
                out += self._feed_held(queued)
            else:
                out += self._step(queued)
        return out

    def _is_pending(self, event: Mapping[str, Any]) -> bool:
        index, item_id, _, _ = self._pending  # type: ignore[misc]
        if event.get("item_id") is not None and item_id is not None:
            return event.get("item_id") == item_id
        item = event.get("item")
        if isinstance(item, Mapping) and item.get("id") is not None and item_id is not None:
            return item.get("id") == item_id
        return event.get("output_index") == index

    # -- the normal path

    def _step(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if not isinstance(event, dict):
            return [event]
        kind = event.get("type")
        if kind in _SNAPSHOT_TYPES and isinstance(event.get("response"), dict):
            self._snapshot = event["response"]
        elif kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, Mapping):
                identity = _item_identity(item)
                if identity is not None:
                    call_kind, name = identity
                    index = event.get("output_index")
                    if name is None and index not in self._named:
                        self._held = [event]
                        self._pending = (index, item.get("id"), item.get("namespace"), call_kind)
                        return []
                    if name is not None and not _allowed(self.policy, name, call_kind):
                        return self._fail(name, call_kind)
                self._sent[event.get("output_index")] = _Sent(item)  # type: ignore[index]
        elif kind == "response.function_call_arguments.done":
            sent = self._sent.get(event.get("output_index"))  # type: ignore[arg-type]
            if event.get("name"):
                namespace = sent.item.get("namespace") if sent is not None else None
                name = flat_name(event.get("name"), namespace)
                if not _allowed(self.policy, name, "function"):
                    return self._fail(name, "function")
        elif kind == "response.output_item.done":
            item = event.get("item")
            if isinstance(item, Mapping):
                identity = _item_identity(item)
                judged = identity is not None and (identity[1] is not None
                                                   or event.get("output_index") not in self._named)
                if judged and not _allowed(self.policy, identity[1], identity[0]):  # type: ignore[index]
                    return self._fail(identity[1], identity[0])  # type: ignore[index]
                sent = self._sent.get(event.get("output_index"))  # type: ignore[arg-type]
                if sent is not None:
                    sent.done = item  # type: ignore[assignment]
        elif kind in _TEXT_DELTAS:
            sent = self._sent.get(event.get("output_index"))  # type: ignore[arg-type]
            entry = sent.parts.get(event.get("content_index", 0)) if sent is not None else None
            if entry is not None and isinstance(event.get("delta"), str):
                entry[1].append(event["delta"])
        elif kind in ("response.function_call_arguments.delta",
                      "response.custom_tool_call_input.delta"):
            sent = self._sent.get(event.get("output_index"))  # type: ignore[arg-type]
            if sent is not None and isinstance(event.get("delta"), str):
                if sent.payload is None:
                    sent.payload = []
                sent.payload.append(event["delta"])
        elif kind in ("response.content_part.added", "response.content_part.done"):
            sent = self._sent.get(event.get("output_index"))  # type: ignore[arg-type]
            part = event.get("part")
            if sent is not None and isinstance(part, Mapping):
                field = "refusal" if part.get("type") == "refusal" else "text"
                text = part.get(field)
                sent.parts[event.get("content_index", 0)] = (
                    dict(part), [text] if isinstance(text, str) else [])
        elif kind in ("response.completed", "response.incomplete"):
            violation = _responses_violation(event.get("response"), self.policy, self.source,
                                             public_name=False)
            if violation is not None:
                return self._fail(violation.name, violation.kind)
        return [self._number(event)]

    def _number(self, event: dict[str, Any]) -> dict[str, Any]:
        upstream = event.get("sequence_number")
        if not isinstance(upstream, int) or isinstance(upstream, bool):
            return event
        if self._seq is None:
            self._seq = upstream
        number, self._seq = self._seq, self._seq + 1
        if upstream == number:
            return event
        return {**event, "sequence_number": number}

    def _next_seq(self) -> int:
        number = 0 if self._seq is None else self._seq
        self._seq = number + 1
        return number

    # -- failure

    def _fail(self, name: str | None, kind: str) -> list[dict[str, Any]]:
        return self.refuse(_refuse(self.policy, name, kind, self.source, public_name=False))

    def refuse(self, violation: AllowedToolsViolation) -> list[dict[str, Any]]:
        """End the stream now with ``violation`` (counted under its ``source``): the closing events
        of a violation. :class:`GuardedSSE` uses it for an event it cannot read."""
        if self.terminal:
            return []
        self.violation = violation
        self._held = None
        self._pending = None
        record_violation(violation.source)
        out: list[dict[str, Any]] = []
        output: list[dict[str, Any]] = []
        for index in sorted(self._sent, key=_index_key):
            sent = self._sent[index]
            closed = sent.closed()
            output.append(closed)
            if sent.done is None:
                out.append({"type": "response.output_item.done", "sequence_number": self._next_seq(),
                            "output_index": index, "item": closed})
        response = copy.deepcopy(self._snapshot) if self._snapshot is not None else {
            "object": "response"}
        response["status"] = "failed"
        response["error"] = {"code": CODE_VIOLATION, "message": violation.message}
        response["output"] = copy.deepcopy(output)
        response["incomplete_details"] = None
        self.terminal = True   # before the terminal event leaves this method
        out.append({"type": "response.failed", "sequence_number": self._next_seq(),
                    "response": response})
        return out


# ------------------------------------------------------------------------------------- Chat stream

class _ChatCall:
    __slots__ = ("decided", "kind", "name")

    def __init__(self) -> None:
        self.name: list[str] = []
        self.kind = "function"
        self.decided = False


class ChatStreamGuard:
    """Guard a Chat Completions chunk stream (see the module docstring for the exact semantics)."""

    def __init__(self, policy: CallFilter, *, source: str = "stream_guard") -> None:
        self.policy = policy
        self.source = source
        self.terminal = False
        self.violation: AllowedToolsViolation | None = None
        self._calls: dict[tuple[Any, Any], _ChatCall] = {}
        self._held: list[dict[str, Any]] = []
        self._finished = False

    @property
    def holding(self) -> bool:
        """True while chunks are withheld until a call's name is complete."""
        return bool(self._held)

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self.terminal or self._finished:
            return []
        if not isinstance(chunk, dict):
            return self._release([chunk]) if not self._held else self._hold(chunk)
        if "error" in chunk and "choices" not in chunk:   # upstream's own error ends the stream
            failure = self._complete(lambda key: True)
            if failure is not None:
                return failure
            return self._release([chunk])
        complete: set[tuple[Any, Any]] = set()
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, Mapping):
                continue
            c_index = choice.get("index", 0)
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if isinstance(delta, Mapping) else None
            for position, call in enumerate(calls if isinstance(calls, list) else ()):
                if not isinstance(call, Mapping):
                    continue
                key = (c_index, call.get("index", position))
                state = self._calls.get(key)
                if state is None:
                    # another tool index of this choice starts: earlier ones have their full names
                    complete.update(k for k, s in self._calls.items()
                                    if k[0] == c_index and not s.decided)
                    state = self._calls[key] = _ChatCall()
                kind, piece, arguments = self._delta_parts(call)
                if kind == "custom":
                    state.kind = "custom"
                if piece:
                    state.name.append(piece)
                    if state.decided:     # a name growing after it was judged: judge it again
                        state.decided = False
                        complete.add(key)
                if arguments:
                    complete.add(key)
            if choice.get("finish_reason") is not None:
                complete.update(k for k, s in self._calls.items() if k[0] == c_index and not s.decided)
        failure = self._complete(lambda key: key in complete)
        if failure is not None:
            return failure
        if any(not s.decided for s in self._calls.values()):
            return self._hold(chunk)
        return self._release([chunk])

    def finish(self) -> list[dict[str, Any]]:
        """Upstream ended: every name is complete; returns the held chunks, or the error chunk."""
        if self.terminal or self._finished:
            return []
        self._finished = True
        failure = self._complete(lambda key: True)
        if failure is not None:
            return failure
        return self._release([])

    # -- internals

    @staticmethod
    def _delta_parts(call: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
        custom = call.get("custom")
        if call.get("type") == "custom" or (isinstance(custom, Mapping) and "function" not in call):
            body = custom if isinstance(custom, Mapping) else {}
            return "custom", body.get("name"), body.get("input")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            return "function", None, None
        name, arguments = fn.get("name"), fn.get("arguments")
        return ("function", name if isinstance(name, str) else None,
                arguments if isinstance(arguments, str) else None)

    def _complete(self, is_complete) -> list[dict[str, Any]] | None:
        """Judge every undecided call whose name is complete; the failure output if one is refused."""
        for key, state in self._calls.items():
            if state.decided or not is_complete(key):
                continue
            name = "".join(state.name) or None
            if not _allowed(self.policy, name, state.kind):
                return self._fail(name, state.kind)
            state.decided = True
        return None

    def _hold(self, chunk: Any) -> list[dict[str, Any]]:
        self._held.append(chunk)
        return []

    def _release(self, tail: list[Any]) -> list[Any]:
        if not self._held:
            return tail
        out, self._held = self._held + tail, []
        return out

    def _fail(self, name: str | None, kind: str) -> list[dict[str, Any]]:
        return self.refuse(_refuse(self.policy, name, kind, self.source, public_name=False))

    def refuse(self, violation: AllowedToolsViolation) -> list[dict[str, Any]]:
        """End the stream now with ``violation`` (counted under its ``source``): the error chunk.
        :class:`GuardedSSE` uses it for an event it cannot read."""
        if self.terminal:
            return []
        self.violation = violation
        self._held = []
        record_violation(violation.source)
        self.terminal = True   # before the terminal chunk leaves this method
        return [violation.to_openai()]


# ------------------------------------------------------------------------------------ SSE adapter

_DONE = b"data: [DONE]\n\n"


class GuardedSSE:
    """Run a guard over raw SSE bytes in any chunking; unchanged events keep their exact bytes.

    ``feed(chunk) -> bytes`` to send now; ``close() -> bytes`` when upstream ended; ``terminal``
    once a violation ended the stream (stop reading upstream then and close it). For a Chat stream a
    violation sends the error chunk followed by ``data: [DONE]``; upstream's ``[DONE]`` first gives
    the guard the end of the stream (``finish``), then passes.

    Framing is the SSE spec's (:mod:`~vllm_allowed_tools.response.sse`: CRLF, LF and CR line ends, in any
    chunking), so the guard reads exactly the events a client will dispatch. Events without data
    (comments, keep-alives, a bare ``event:``) pass at once: a client dispatches nothing for them.
    An event whose data is neither ``[DONE]`` nor a JSON object cannot be read, so it might hide a
    call: it ends the stream as a violation (source ``unreadable``). A partial event left when
    upstream ends (no closing empty line) is dropped, not forwarded: clients never dispatch it, and
    the guard does not send bytes it has not judged.
    """

    def __init__(self, guard: ResponsesStreamGuard | ChatStreamGuard) -> None:
        self.guard = guard
        self._framer = SSEFramer()
        self._chat = isinstance(guard, ChatStreamGuard)
        self._raw: dict[int, tuple[Any, bytes]] = {}   # id(fed data) -> (data, its bytes), unsent
        self._closed = False

    @property
    def terminal(self) -> bool:
        return self.guard.terminal

    @property
    def violation(self) -> AllowedToolsViolation | None:
        return self.guard.violation

    def feed(self, chunk: bytes) -> bytes:
        if self.guard.terminal or self._closed:
            return b""
        out: list[bytes] = []
        self._take(self._framer.feed(chunk), out)
        return b"".join(out)

    def close(self) -> bytes:
        """Upstream ended: what is still to send (held events, a trailing partial event)."""
        if self._closed:
            return b""
        self._closed = True
        if self.guard.terminal:
            return b""
        out: list[bytes] = []
        self._take(self._framer.close(), out)    # events only the end completes (a final CR)
        if not self.guard.terminal:
            self._emit(self.guard.finish(), out)
        self._framer.flush()   # a partial event: never dispatched by a client, never forwarded
        return b"".join(out)

    def refuse(self, violation: AllowedToolsViolation) -> bytes:
        """End the stream now with ``violation`` (counted): the guard's closing events, as bytes."""
        out: list[bytes] = []
        if not self._closed:
            self._emit(self.guard.refuse(violation), out)
        return b"".join(out)

    def _take(self, events: list[SSEEvent], out: list[bytes]) -> None:
        for event in events:
            if self.guard.terminal:
                return
            if event.data is None:
                out.append(event.raw)
                continue
            if event.data == "[DONE]":
                self._emit(self.guard.finish(), out)
                if not self.guard.terminal:
                    out.append(event.raw)
                continue
            data = event.json()
            if not isinstance(data, dict):
                self._emit(self.guard.refuse(unreadable_violation(
                    "a stream event whose data is not a JSON object")), out)
                return
            self._raw[id(data)] = (data, event.raw)
            self._emit(self.guard.feed(data), out)
            if not self.guard.holding:
                self._raw.clear()

    def _emit(self, items: list[Any], out: list[bytes]) -> None:
        for item in items:
            known = self._raw.pop(id(item), None)
            if known is not None and known[0] is item:
                out.append(known[1])
            else:
                name = item.get("type") if not self._chat and isinstance(item, dict) else None
                out.append(SSEEvent.encode(item, name))
        if self.guard.terminal:
            self._raw.clear()
            if self._chat:
                out.append(_DONE)
