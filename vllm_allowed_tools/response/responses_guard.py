"""The output guard as a step on a Responses stream: every call's name is judged before it leaves,
its arguments before the event that completes it, and the whole answer at its terminal event."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..request import flat_name
from .call_names import item_identity
from .contract import NAMES_ONLY, OutputContract, is_cut
from .responses_stream import NEXT_NUMBER, SNAPSHOT_TYPES, ResponsesStream, run_sync
from .unary import close_cut_call, responses_violation
from .violations import (
    ARGUMENTS_NOT_OBJECT,
    AllowedToolsViolation,
    ArgumentsRefusal,
    CallFilter,
    arguments_violation,
    record_reason,
    refusal,
)

_UPSTREAM_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed",
                                "error"})


_COMPLETING = frozenset({"response.function_call_arguments.done", "response.output_item.done"})


def _state_of(name: Any) -> str:
    return "named" if name else "unnamed"


class _Suspect:
    """A call whose arguments are not one JSON object: its completing events, held until the
    next event says whether the token limit cut it (then it is closed as incomplete) or not."""

    __slots__ = ("arguments", "events", "index", "name", "refused")

    def __init__(self, index: Any, name: str | None, refused: ArgumentsRefusal, arguments: Any,
                 event: dict[str, Any]) -> None:
        self.index = index
        self.name = name
        self.refused = refused
        self.arguments = arguments
        self.events = [event]


class ResponsesStreamGuard:
    """Guard a Responses event stream (``docs/response-path.md``).

    Standalone (``stream`` omitted) it runs on a stream of its own: ``feed(event) -> list`` to
    send now, ``finish()`` when upstream ended, ``refuse(violation)`` to end it. Given a
    :class:`ResponsesStream`, it is one step on that stream. ``contract``: the turn's backstops.
    """

    def __init__(self, call_filter: CallFilter, *, source: str = "stream_guard",
                 stream: ResponsesStream | None = None,
                 contract: OutputContract = NAMES_ONLY) -> None:
        self.call_filter = call_filter
        self.contract = contract
        self.source = source
        self.stream = stream if stream is not None else ResponsesStream()
        self.stream.steps.append(self)
        self._held: list[dict[str, Any]] | None = None
        self._pending: tuple[Any, Any, Any, str] | None = None  # (output_index, item id, ns, kind)
        self._named: dict[Any, str] = {}        # output_index -> name learnt while held
        self._namespaces: dict[Any, Any] = {}   # output_index -> namespace of the added item
        self._call_names: dict[Any, str | None] = {}   # output_index -> a function call's flat name
        self._custom_names: dict[Any, str | None] = {}   # output_index -> a custom call's flat name
        self._items: dict[Any, Mapping[str, Any]] = {}  # output_index -> its added function call
        self._judged: dict[Any, Any] = {}       # output_index -> arguments judged complete and fine
        self._suspect: _Suspect | None = None
        self._called = False                    # a call item was let out

    # -- the stream it is on

    @property
    def terminal(self) -> bool:
        return self.stream.terminal

    @property
    def violation(self) -> Any:
        return self.stream.error

    @property
    def holding(self) -> bool:
        """True while events are withheld until a call's name is known, or until what follows a
        call whose arguments are not an object says whether the token limit cut it."""
        return (self._held is not None or self._suspect is not None) and not self.stream.terminal

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        return self.stream.feed(event)

    def finish(self) -> list[dict[str, Any]]:
        """Upstream ended (with or without a terminal event): a call still unnamed is refused."""
        return run_sync(self.stream.finish())

    def refuse(self, violation: AllowedToolsViolation) -> list[dict[str, Any]]:
        """End the stream now with ``violation`` (counted under its ``source``): the closing
        events. :class:`~.guarded_sse.GuardedSSE` uses it for an event it cannot read."""
        return self.stream.terminate(violation)

    # -- the step

    def process(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if self._held is not None:
            return self._feed_held(event)
        return self._step(event)

    def drain(self) -> list[dict[str, Any]]:
        if self._held is not None:
            self._fail(None, self._pending[3] if self._pending else "function")
        elif self._suspect is not None:   # upstream ended without saying the limit cut it
            self._fail_with(arguments_violation(self._suspect.refused, self._suspect.name,
                                                self.source, public_name=False))
        return []

    # -- holding an item whose name is not known yet

    def _feed_held(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        assert self._held is not None and self._pending is not None
        index, _, namespace, kind = self._pending
        name, state, namespace = self._name_from(event, namespace)
        if state == "ended":   # the call ended without a name: fail closed
            return self._fail(None, kind)
        self._held.append(event)
        if state != "named":
            return []
        flat = flat_name(name, namespace)
        if not self.call_filter.allows(kind, flat):
            return self._fail(flat, kind)
        held, self._held, self._pending = self._held, None, None
        self._named[index] = flat
        out: list[dict[str, Any]] = []
        for queued in held:
            if self.stream.terminal:
                break
            out += self._feed_held(queued) if self._held is not None else self._step(queued)
        return out

    def _name_from(self, event: Any, namespace: Any) -> tuple[Any, str, Any]:
        """(name, ``named`` / ``unnamed`` / ``ended``, namespace) of the held call from an event;
        ``ended``: the stream ends without naming it."""
        _, item_id, _, _ = self._pending  # type: ignore[misc]
        kind_type = event.get("type") if isinstance(event, dict) else None
        if kind_type == "response.function_call_arguments.done" and self._is_pending(event):
            return event.get("name"), _state_of(event.get("name")), namespace
        if kind_type == "response.output_item.done" and self._is_pending(event):
            item = event.get("item") or {}
            return item.get("name"), _state_of(item.get("name")), item.get("namespace") or namespace
        if kind_type in _UPSTREAM_TERMINAL:
            response = event.get("response") if isinstance(event.get("response"), dict) else {}
            for item in response.get("output") or ():
                if isinstance(item, dict) and item.get("id") == item_id and item.get("name"):
                    return item.get("name"), "named", item.get("namespace") or namespace
            return None, "ended", namespace
        return None, "unnamed", namespace

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
        if self._suspect is not None:
            return self._after_suspect(event)
        kind, index = event.get("type"), event.get("output_index")
        if kind in SNAPSHOT_TYPES:
            return [event]
        if kind == "response.output_item.added":
            return self._added(event)
        if kind == "response.function_call_arguments.done":
            name = flat_name(event.get("name"), self._namespaces.get(index))
            if event.get("name") and not self.call_filter.allows("function", name):
                return self._fail(name, "function")
            return self._arguments(event, name or self._call_names.get(index),
                                   event.get("arguments"))
        if kind == "response.output_item.done":
            item = event.get("item")
            identity = item_identity(item) if isinstance(item, Mapping) else None
            judged = identity is not None and (identity[1] is not None or index not in self._named)
            if judged and not self.call_filter.allows(identity[0], identity[1]):  # type: ignore[index]
                return self._fail(identity[1], identity[0])  # type: ignore[index]
            if identity is not None and item.get("type") == "function_call":  # type: ignore[union-attr]
                return self._arguments(event, identity[1] or self._call_names.get(index),
                                       item.get("arguments"))  # type: ignore[union-attr]
            if identity is not None and item.get("type") == "custom_tool_call":  # type: ignore[union-attr]
                return self._custom_input(event, identity[1] or self._custom_names.get(index),
                                          item.get("input"))  # type: ignore[union-attr]
        elif kind == "response.custom_tool_call_input.done":
            return self._custom_input(event, self._custom_names.get(index), event.get("input"))
        elif kind in ("response.completed", "response.incomplete"):
            return self._terminal(event)
        return [event]

    # -- arguments, judged before the event that completes the call

    def _arguments(self, event: dict[str, Any], name: str | None, arguments: Any,
                   refusal: Any = None) -> list[dict[str, Any]]:
        """A call's complete arguments (a function call's) or input (a custom call's, judged by
        ``refusal``: :meth:`OutputContract.input_refusal`), each judged once per output item."""
        index = event.get("output_index")
        if index in self._judged and self._judged[index] == arguments:
            return [event]
        refused = (refusal or self.contract.arguments_refusal)(name, arguments)
        if refused is None:
            self._judged[index] = arguments
            return [event]
        if refused.reason == ARGUMENTS_NOT_OBJECT:   # cut by the token limit? what follows says
            self._suspect = _Suspect(index, name, refused, arguments, event)
            return []
        return self._fail_with(arguments_violation(refused, name, self.source, public_name=False))

    def _after_suspect(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The next event after a call whose arguments are not one JSON object: more of its
        completing events are held; an incomplete terminal (the token limit cut the call) closes
        it as incomplete; anything else refuses it."""
        suspect = self._suspect
        assert suspect is not None
        kind = event.get("type")
        if kind in _COMPLETING and event.get("output_index") == suspect.index:
            suspect.events.append(event)
            return []
        if kind in ("response.completed", "response.incomplete") and is_cut(event.get("response")):
            self._suspect = None
            closed = self._closed_cut(suspect)
            tail = self._terminal(event)
            return [] if self.stream.terminal else [closed, *tail]
        return self._fail_with(arguments_violation(suspect.refused, suspect.name, self.source,
                                                   public_name=False))

    def _closed_cut(self, suspect: _Suspect) -> dict[str, Any]:
        """The ``output_item.done`` of a call the token limit cut: ``status: "incomplete"``, its
        arguments as they are (its ``arguments.done``, which would call them done, is dropped)."""
        done = next((e for e in reversed(suspect.events) if e.get("type") == "response.output_item.done"
                     and isinstance(e.get("item"), Mapping)), None)
        base = dict(done["item"]) if done is not None else dict(self._items.get(suspect.index) or {})
        item = {**base, "arguments": base.get("arguments", suspect.arguments), "status": "incomplete"}
        if done is not None:
            return {**done, "item": item}
        return {"type": "response.output_item.done", "sequence_number": NEXT_NUMBER,
                "output_index": suspect.index, "item": item}

    def _terminal(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """A terminal event: every call in its snapshot judged, a call required where the contract
        says so, and the call an incomplete snapshot was cut inside marked incomplete."""
        response = event.get("response")
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            copied = {**response, "output": [dict(item) if isinstance(item, Mapping) else item
                                             for item in response["output"]]}
            if close_cut_call(copied, self.contract):
                response, event = copied, {**event, "response": copied}
        violation = responses_violation(response, self.call_filter, self.source, public_name=False,
                                        contract=self.contract, called=self._called)
        if violation is not None:
            return self._fail_with(violation)
        return [event]

    def _added(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        item = event.get("item")
        if not isinstance(item, Mapping):
            return [event]
        index = event.get("output_index")
        identity = item_identity(item)
        if identity is not None:
            call_kind, name = identity
            if name is None and index not in self._named:
                self._held = [event]
                self._pending = (index, item.get("id"), item.get("namespace"), call_kind)
                return []
            if name is not None and not self.call_filter.allows(call_kind, name):
                return self._fail(name, call_kind)
            self._called = True
            if item.get("type") == "function_call":
                self._call_names[index] = name or self._named.get(index)
                self._items[index] = item
            elif item.get("type") == "custom_tool_call":
                self._custom_names[index] = name
        self._namespaces[index] = item.get("namespace")
        return [event]

    def _custom_input(self, event: dict[str, Any], name: str | None, text: Any) -> list[dict[str, Any]]:
        """A custom call's complete input, judged before the event that completes the call: its
        grammar must admit it (the tool's ``format``; free-form tools take any text)."""
        return self._arguments(event, name, text, self.contract.input_refusal)

    def _fail(self, name: str | None, kind: str) -> list[dict[str, Any]]:
        return self._fail_with(refusal(self.call_filter, name, kind, self.source,
                                       public_name=False))

    def _fail_with(self, violation: AllowedToolsViolation) -> list[dict[str, Any]]:
        """End the stream with ``violation`` (counted under its source and, for a backstop, its
        reason); nothing this step holds is shown."""
        self._held = None
        self._pending = None
        self._suspect = None
        if not self.stream.terminal:
            self.stream.fail(violation)
            record_reason(violation)
        return []
