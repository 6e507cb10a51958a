"""One Responses event stream on its way to the client: the state its steps share, and its end.

The output guard and the approvals are steps on a :class:`ResponsesStream`; the stream owns what
the client has seen (items, the last snapshot, sequence numbers) and the single way to end early,
:meth:`ResponsesStream.terminate`. The rules are in ``docs/response-path.md``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Generator, Mapping
from typing import Any, Protocol, TypeVar

from ..metrics import record_violation
from .violations import AllowedToolsViolation

#: What a step yields when it needs something done off the event loop (a grant-store decision):
#: a call without arguments whose result is sent back into the step. An exception it raises is
#: thrown into the step instead.
Request = Callable[[], Any]
Steps = Generator[Request, Any, list[dict[str, Any]]]

#: ``sequence_number`` of an event a step makes: the stream numbers it when it is sent.
NEXT_NUMBER: Any = object()

T = TypeVar("T")

SNAPSHOT_TYPES = frozenset({"response.created", "response.in_progress", "response.queued"})
TEXT_DELTAS = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                         "response.refusal.delta"})
PAYLOAD_DELTAS = frozenset({"response.function_call_arguments.delta",
                            "response.custom_tool_call_input.delta"})


class Step(Protocol):
    """A stage of a Responses stream: what it passes on, in order, for each upstream event (a
    list, or :data:`Steps` when it must ask for something first)."""

    holding: bool

    def process(self, event: dict[str, Any]) -> list[dict[str, Any]] | Steps: ...

    def drain(self) -> list[dict[str, Any]]: ...


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


class ResponsesStream:
    """A Responses stream: upstream events go through its steps, then out, numbered and tracked.

    ``restore``: applied to the ``response`` object of every event sent (the tool_choice echo).
    ``conform``: applied to every event sent, closing events included, before ``restore`` (the
    Open Responses fixer, :func:`~.conformance.conformed_event`); it returns the very event when
    nothing changes, so an unchanged event keeps its bytes.
    After a step fails it (:meth:`fail`) or a caller ends it (:meth:`terminate`), ``terminal`` is
    True, ``error`` says why, and the stream sends its closing events once.
    """

    def __init__(self, *, restore: Callable[[dict[str, Any]], Any] | None = None,
                 conform: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.steps: list[Step] = []
        self.restore = restore
        self.conform = conform
        self.error: Exception | None = None
        self.terminal = False
        self._closed = False
        self._seq: int | None = None
        self._snapshot: dict[str, Any] | None = None
        self._sent: dict[Any, _Sent] = {}

    @property
    def holding(self) -> bool:
        """True while a step withholds events it may still send."""
        if self.error is None:
            for step in self.steps:
                if step.holding:
                    return True
        return False

    # -- driving

    def process(self, event: dict[str, Any]) -> Steps:
        """Feed one upstream event; yields the requests steps need answered; returns what to send."""
        return self._through(0, [event] if self.error is None else [])

    def finish(self) -> Steps:
        """Upstream ended: what the steps still hold and may send (or the closing events)."""
        out: list[dict[str, Any]] = []
        for index, step in enumerate(self.steps):
            if self.terminal:
                break
            out += yield from self._through(index + 1, step.drain())
        return out + self._closing()

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """:meth:`process`, answering every request inline."""
        return run_sync(self.process(event))

    def _through(self, start: int, events: list[dict[str, Any]]) -> Steps:
        for step in self.steps[start:]:
            failed_before = self.error
            passed: list[dict[str, Any]] = []
            for event in events:
                result = step.process(event)
                passed += result if isinstance(result, list) else (yield from result)
                if self.error is not failed_before:   # this step ended the stream
                    break
            events = passed
        return [self.send(event) for event in events] + self._closing()

    # -- the way out

    def send(self, event: dict[str, Any]) -> dict[str, Any]:
        """The event as the client gets it (the very object when nothing changes): numbered,
        its response echo restored; what it adds or closes is remembered."""
        if not isinstance(event, dict):
            return event
        if event.get("type") in SNAPSHOT_TYPES and isinstance(event.get("response"), dict):
            self._snapshot = event["response"]
        event = self._number(event)
        self._track(event)
        return self._outgoing(event)

    def _outgoing(self, event: dict[str, Any]) -> dict[str, Any]:
        if self.conform is not None:
            event = self.conform(event)
        if self.restore is not None and isinstance(event.get("response"), dict):
            event = {**event, "response": self.restore(dict(event["response"]))}
        return event

    def _number(self, event: dict[str, Any]) -> dict[str, Any]:
        upstream = event.get("sequence_number")
        if upstream is NEXT_NUMBER:
            if self._seq is None:
                return {k: v for k, v in event.items() if k != "sequence_number"}
            return {**event, "sequence_number": self._next_seq()}
        if not isinstance(upstream, int) or isinstance(upstream, bool):
            return event
        if self._seq is None:
            self._seq = upstream
        number = self._next_seq()
        return event if upstream == number else {**event, "sequence_number": number}

    def _next_seq(self) -> int:
        number = 0 if self._seq is None else self._seq
        self._seq = number + 1
        return number

    def _track(self, event: dict[str, Any]) -> None:
        kind, index = event.get("type"), event.get("output_index")
        item = event.get("item")
        if kind == "response.output_item.added" and isinstance(item, Mapping):
            self._sent[index] = _Sent(item)
            return
        sent = self._sent.get(index)
        if sent is None:
            return
        if kind == "response.output_item.done" and isinstance(item, Mapping):
            sent.done = item  # type: ignore[assignment]
        elif kind in TEXT_DELTAS:
            entry = sent.parts.get(event.get("content_index", 0))
            if entry is not None and isinstance(event.get("delta"), str):
                entry[1].append(event["delta"])
        elif kind in PAYLOAD_DELTAS and isinstance(event.get("delta"), str):
            if sent.payload is None:
                sent.payload = []
            sent.payload.append(event["delta"])
        elif kind in ("response.content_part.added", "response.content_part.done"):
            part = event.get("part")
            if isinstance(part, Mapping):
                field = "refusal" if part.get("type") == "refusal" else "text"
                text = part.get(field)
                sent.parts[event.get("content_index", 0)] = (
                    dict(part), [text] if isinstance(text, str) else [])

    # -- ending early

    def fail(self, error: Exception) -> None:
        """A step ends the stream with ``error`` (a violation is counted under its ``source``);
        the closing events follow what was already passed on."""
        if self.error is None:
            self.error = error
            self.terminal = True
            if isinstance(error, AllowedToolsViolation):
                record_violation(error.source)

    def terminate(self, error: Exception) -> list[dict[str, Any]]:
        """End the stream now with ``error``: its closing events (none if it already ended)."""
        if self.terminal:
            return []
        self.fail(error)
        return self._closing()

    def _closing(self) -> list[dict[str, Any]]:
        """Items the client saw open are closed as ``incomplete`` (ascending ``output_index``,
        partial text and arguments filled in), then one ``response.failed``: the last snapshot
        with the error and the items sent so far."""
        if self.error is None or self._closed:
            return []
        self._closed = True
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
        response["error"] = {"code": getattr(self.error, "code", "server_error"),
                             "message": getattr(self.error, "message", str(self.error))}
        response["output"] = copy.deepcopy(output)
        response["incomplete_details"] = None
        out.append({"type": "response.failed", "sequence_number": self._next_seq(),
                    "response": response})
        return [self._outgoing(event) for event in out]


def run_sync(steps: Generator[Request, Any, T], answer: Callable[[Request], Any] | None = None) -> T:
    """Drive ``steps`` to its result, answering each request inline (``answer(request)``, or by
    calling it); an exception an answer raises is thrown into the steps."""
    try:
        request = next(steps)
        while True:
            asked = request
            outcome = _outcome((lambda: answer(asked)) if answer is not None else asked)
            request = _resume(steps, outcome)
    except StopIteration as stop:
        return stop.value


async def run_in_threads(steps: Generator[Request, Any, T]) -> T:
    """Drive ``steps`` to its result, answering each request in a worker thread (never on the
    event loop: a request may wait on the grant store)."""
    try:
        request = next(steps)
        while True:
            request = _resume(steps, await asyncio.to_thread(_outcome, request))
    except StopIteration as stop:
        return stop.value


def _outcome(request: Request) -> tuple[Any, Exception | None]:
    try:
        return request(), None
    except Exception as exc:   # noqa: BLE001 - the step decides what it can handle
        return None, exc


def _resume(steps: Generator[Request, Any, Any], outcome: tuple[Any, Exception | None]) -> Request:
    reply, error = outcome
    return steps.throw(error) if error is not None else steps.send(reply)
