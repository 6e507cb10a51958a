"""Approvals as a step on a Responses stream: a gated call leaves as its elicitation, or not at all."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

from ..response import NEXT_NUMBER, ResponsesStream, run_sync
from ..response.responses_stream import Steps
from .answers import CALL_ITEM_TYPES
from .approval_errors import GrantStoreUnavailable
from .response_bodies import ResponseApprovals

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


class ApprovalStream:
    """Hold each tool call item's events (``function_call``, ``custom_tool_call``: its arguments
    or input deltas too) until its ``output_item.done``, then pass it as is,
    as an ``elicitation`` (added + done at one output_index), or not at all. The client's output
    indexes are its own: dense, in the order items are sent, and the terminal snapshot lists the
    items at those positions (``docs/response-path.md``).

    A decision may need the grant store: as a step (:meth:`process`) it asks for it as a request
    the driver answers off the event loop; :class:`GrantStoreUnavailable` thrown back ends the
    stream (``response.failed``). Standalone (``stream`` omitted) :meth:`feed` takes decisions made
    by the caller (:meth:`pending_calls` says which calls), or decides inline; :meth:`fail` ends it.
    """

    def __init__(self, approvals: ResponseApprovals, stream: ResponsesStream | None = None) -> None:
        self.approvals = approvals
        self.stream = stream if stream is not None else ResponsesStream()
        self.stream.steps.append(self)
        self._held: dict[int, list[dict[str, Any]]] = {}
        self._decisions: dict[str, dict[str, Any] | None] = {}
        self._passed: set[str] = set()          # call ids sent as they were (no approval needed)
        self._placed: dict[Any, int] = {}       # upstream output_index -> the client's
        self._placed_ids: dict[Any, int] = {}   # upstream item id -> the client's output_index
        self._withheld: set[Any] = set()        # upstream output indexes never shown

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def pending_calls(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The tool calls that feeding ``event`` will decide: the held call its
        ``output_item.done`` completes, or calls a terminal snapshot carries that no event
        announced (never passed unchecked)."""
        kind = event.get("type", "")
        index = event.get("output_index")
        if kind == "response.output_item.done" and index in self._held:
            item = event.get("item")
            return [dict(item)] if isinstance(item, Mapping) else []
        response = event.get("response")
        if isinstance(response, Mapping) and kind in _TERMINAL:
            return [dict(item) for item in response.get("output") or ()
                    if isinstance(item, Mapping) and item.get("type") in CALL_ITEM_TYPES
                    and item.get("call_id") not in self._decisions
                    and item.get("call_id") not in self._passed]
        return []

    def feed(self, event: dict[str, Any],
             decisions: Mapping[str, dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
        """Feed one event through the stream; ``decisions`` answer its pending calls (else they
        are decided inline)."""
        return run_sync(self.stream.process(event),
                        None if decisions is None else lambda request: dict(decisions))

    def fail(self, error: Exception) -> list[dict[str, Any]]:
        """The events that end the stream when a decision could not be made (the store is down)."""
        return self.stream.terminate(error)

    # -- the step

    def process(self, event: dict[str, Any]) -> list[dict[str, Any]] | Steps:
        pending = self.pending_calls(event)
        return self._decide(event, pending) if pending else self._apply(event, None)

    def _decide(self, event: dict[str, Any], pending: list[dict[str, Any]]) -> Steps:
        try:
            decisions = yield functools.partial(self.approvals.decide, pending)
        except GrantStoreUnavailable as exc:   # fail closed: the gated call is never shown
            self.stream.fail(exc)
            return []
        return self._apply(event, decisions)

    def drain(self) -> list[dict[str, Any]]:
        return []   # a call whose item never completed is never shown

    def _apply(self, event: dict[str, Any],
               decisions: Mapping[str, dict[str, Any] | None] | None) -> list[dict[str, Any]]:
        kind = event.get("type", "")
        index = event.get("output_index")
        item = event.get("item") if isinstance(event.get("item"), Mapping) else None
        if kind == "response.output_item.added" and item and item.get("type") in CALL_ITEM_TYPES:
            self._held[index] = [event]  # type: ignore[index]
            return []
        if index in self._held:
            self._held[index].append(event)
            if kind != "response.output_item.done":
                return []
            return self._decided(index, item, decisions)  # type: ignore[arg-type]
        if isinstance(event.get("response"), dict) and kind in _TERMINAL:
            event = self._terminal(event, decisions)
        if index in self._withheld:
            return []   # nothing of a withheld call is shown
        return [self._placed_at(event, index, item)]

    def _decided(self, index: int, item: Any,
                 decisions: Mapping[str, dict[str, Any] | None] | None) -> list[dict[str, Any]]:
        """The held call's events, its elicitation, or nothing."""
        events = self._held.pop(index)
        decision = dict(decisions) if decisions is not None else self.approvals.decide([item])
        self._decisions.update(decision)
        call_id = item.get("call_id")
        if call_id not in decision:
            self._passed.add(call_id)
            return [self._placed_at(e, index, e.get("item")) for e in events]
        replacement = decision[call_id]
        if replacement is None:
            self._withheld.add(index)
            return []
        out_index = self._place(index, events[0].get("item"))
        return [{"type": kind, "output_index": out_index, "item": replacement,
                 "sequence_number": NEXT_NUMBER}
                for kind in ("response.output_item.added", "response.output_item.done")]

    def _terminal(self, event: dict[str, Any],
                  decisions: Mapping[str, dict[str, Any] | None] | None) -> dict[str, Any]:
        """A terminal snapshot with every call in it decided (late calls: decided now)."""
        event = copy.copy(event)
        late = self.pending_calls(event)
        if late:
            self._decisions.update(dict(decisions) if decisions is not None
                                   else self.approvals.decide(late))
            self._passed.update(str(call.get("call_id")) for call in late
                                if call.get("call_id") not in self._decisions)
        response = dict(event["response"])
        if isinstance(response.get("output"), list):
            response["output"] = self._in_client_order(response["output"])
        event["response"] = self.approvals.apply_to_response(response, self._decisions)
        return event

    # -- the client's output indexes

    def _place(self, index: Any, item: Any) -> int:
        """The client's output_index of the upstream item at ``index``: the next free one the
        first time it is sent."""
        if index not in self._placed:
            self._placed[index] = len(self._placed)
            if isinstance(item, Mapping) and item.get("id") is not None:
                self._placed_ids[item["id"]] = self._placed[index]
        return self._placed[index]

    def _placed_at(self, event: dict[str, Any], index: Any, item: Any) -> dict[str, Any]:
        """``event`` at the client's output_index (the very object when that is upstream's)."""
        if not isinstance(index, int) or isinstance(index, bool):
            return event
        placed = self._place(index, item)
        return event if placed == index else {**event, "output_index": placed}

    def _in_client_order(self, output: list[Any]) -> list[Any]:
        """A snapshot's items in the order the client saw them added (matched by item id, else by
        position); items it never saw keep their order after them."""
        def key(entry: tuple[int, Any]) -> tuple[int, int]:
            position, item = entry
            item_id = item.get("id") if isinstance(item, Mapping) else None
            placed = self._placed_ids.get(item_id) if item_id is not None else \
                self._placed.get(position)
            return (0, placed) if placed is not None else (1, position)
        return [item for _, item in sorted(enumerate(output), key=key)]
