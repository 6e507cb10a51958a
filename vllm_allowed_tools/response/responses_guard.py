"""The output guard as a step on a Responses stream: every call's name is judged before it leaves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..request import flat_name
from .calls import item_identity
from .responses_stream import SNAPSHOT_TYPES, ResponsesStream, run_sync
from .unary import responses_violation
from .violations import AllowedToolsViolation, CallFilter, is_call_allowed, refusal

_UPSTREAM_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed",
                                "error"})


def _state_of(name: Any) -> str:
    return "named" if name else "unnamed"


class ResponsesStreamGuard:
    """Guard a Responses event stream (``docs/response-path.md``).

    Standalone (``stream`` omitted) it runs on a stream of its own: ``feed(event) -> list`` to
    send now, ``finish()`` when upstream ended, ``refuse(violation)`` to end it. Given a
    :class:`ResponsesStream`, it is one step on that stream.
    """

    def __init__(self, call_filter: CallFilter, *, source: str = "stream_guard",
                 stream: ResponsesStream | None = None) -> None:
        self.call_filter = call_filter
        self.source = source
        self.stream = stream if stream is not None else ResponsesStream()
        self.stream.steps.append(self)
        self._held: list[dict[str, Any]] | None = None
        self._pending: tuple[Any, Any, Any, str] | None = None  # (output_index, item id, ns, kind)
        self._named: dict[Any, str] = {}        # output_index -> name learnt while held
        self._namespaces: dict[Any, Any] = {}   # output_index -> namespace of the added item

    # -- the stream it is on

    @property
    def terminal(self) -> bool:
        return self.stream.terminal

    @property
    def violation(self) -> Any:
        return self.stream.error

    @property
    def holding(self) -> bool:
        """True while events are withheld until a call's name is known."""
        return self._held is not None and not self.stream.terminal

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
        if not is_call_allowed(self.call_filter, flat, kind):
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
        kind = event.get("type")
        if kind in SNAPSHOT_TYPES:
            return [event]
        if kind == "response.output_item.added":
            return self._added(event)
        if kind == "response.function_call_arguments.done" and event.get("name"):
            name = flat_name(event.get("name"), self._namespaces.get(event.get("output_index")))
            if not is_call_allowed(self.call_filter, name, "function"):
                return self._fail(name, "function")
        elif kind == "response.output_item.done":
            item = event.get("item")
            identity = item_identity(item) if isinstance(item, Mapping) else None
            judged = identity is not None and (identity[1] is not None
                                               or event.get("output_index") not in self._named)
            if judged and not is_call_allowed(self.call_filter, identity[1], identity[0]):  # type: ignore[index]
                return self._fail(identity[1], identity[0])  # type: ignore[index]
        elif kind in ("response.completed", "response.incomplete"):
            violation = responses_violation(event.get("response"), self.call_filter, self.source,
                                            public_name=False)
            if violation is not None:
                return self._fail(violation.name, violation.kind)
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
            if name is not None and not is_call_allowed(self.call_filter, name, call_kind):
                return self._fail(name, call_kind)
        self._namespaces[index] = item.get("namespace")
        return [event]

    def _fail(self, name: str | None, kind: str) -> list[dict[str, Any]]:
        self._held = None
        self._pending = None
        self.stream.fail(refusal(self.call_filter, name, kind, self.source, public_name=False))
        return []
